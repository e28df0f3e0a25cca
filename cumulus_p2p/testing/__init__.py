"""Helpers for tests, benchmarks and simulations: real processes, small models.

- ``executor``: start a real ``cumulus-executor`` process and get its address.
- ``models``: tiny MLP, CNN and transformer, plus a deterministic training loop.
"""
