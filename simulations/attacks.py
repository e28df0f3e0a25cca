"""Scenario: attacks (see simulations/README.md).

Usage: python simulations/attacks.py [--seed N] [--quick] [--out DIR]
"""

from cumulus_p2p.simulation.cli import main

if __name__ == "__main__":
    main("attacks")
