"""The mesh: a libp2p host, a Kademlia DHT and signed gossip of offers, bids and reports.

Parts, bottom up (hivemind-style split):

- ``records``: sans-IO. DHT keys under ``/cumulus/``, the per-host *offer sheet*
  record, its validation and selection (freshest wins), and ``LiveEnvelopes``, a
  minimal expiring view of accepted envelopes.
- ``host``: the libp2p host factory. Noise only (never plaintext), yamux only, TCP;
  mDNS opt-in; address parsing and dialing.
- ``gossip``: gossipsub on ``/cumulus/market/1`` and ``/cumulus/reputation/1`` with a
  1 s heartbeat and real score thresholds, and ``TopicGate``, the topic validator that
  runs the node's ``EnvelopeValidator`` on every message.
- ``kad``: the KadDHT shell. A strict namespaced validator for ``cumulus`` records and
  ``fetch_offer_sheets``, which reads the whole book for a late joiner.
- ``nat``: AutoNAT, circuit relay v2 (serving as a relay with limits, or reserving on
  one) and DCUtR.
- ``node``: ``open_mesh_node``, which composes all of the above under one nursery,
  re-announces the node's offers on a heartbeat and yields accepted envelopes on
  ``MeshNode.messages``.

Typical use::

    validator = mesh_validator(market.KINDS)      # the one validator for gossip and DHT
    async with open_mesh_node(identity, validator, MeshConfig(bootstrap=(addr,))) as node:
        await node.announce("gpu0", "market/offer", offer_body)   # kept alive until withdrawn
        await node.publish(node.seal("market/bid", bid_body, ttl=60))
        async for msg in node.messages:                           # MeshMessage
            ...

Test helpers live in ``cumulus_p2p.testing.mesh``.
"""

from .gossip import MARKET_TOPIC as MARKET_TOPIC
from .gossip import REPUTATION_TOPIC as REPUTATION_TOPIC
from .gossip import GossipConfig as GossipConfig
from .nat import NatConfig as NatConfig
from .node import MeshConfig as MeshConfig
from .node import MeshMessage as MeshMessage
from .node import MeshNode as MeshNode
from .node import MeshStatistics as MeshStatistics
from .node import mesh_validator as mesh_validator
from .node import open_mesh_node as open_mesh_node
from .records import OFFERS_INDEX as OFFERS_INDEX
from .records import SHEET_KIND as SHEET_KIND
from .records import LiveEnvelopes as LiveEnvelopes
from .records import offers_key as offers_key
