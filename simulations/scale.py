"""Scenario: scale (see simulations/README.md).

Usage: python simulations/scale.py [--seed N] [--quick] [--out DIR]
"""

from cumulus_p2p.simulation.cli import main

if __name__ == "__main__":
    main("scale")
