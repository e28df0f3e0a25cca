"""Cumulus: a peer-to-peer GPU mesh.

Rooms, each with one job (see DESIGN.md):

- ``cumulus_p2p.remote``: the ``cumulus`` torch device, the executor and the op stream.
- ``cumulus_p2p.market``: offers, bids, the order book, leases and the ledger.
- ``cumulus_p2p.dht``: the libp2p host, Kademlia DHT and signed gossip.
- ``cumulus_p2p.reputation``: evidence and host scores.
"""

__version__ = "0.1.0"
