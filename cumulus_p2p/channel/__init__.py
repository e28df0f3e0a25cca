"""Channels: how a consumer's op stream travels between two machines.

- ``transport``: frame channels, one small interface with plain TCP and in-process
  implementations.
- ``secure``: the authenticated, encrypted, resumable session channel that implements it.

Nothing here imports torch, so the nodes that only carry sessions (boot nodes, a
consumer's node) start without loading it; ``cumulus_p2p.remote`` is the torch side.
"""
