"""Gossipsub for the market and reputation topics, and the gate every message passes.

Theory of operation
-------------------
Each topic has one synchronous pubsub validator, a ``TopicGate``. Pubsub runs it
once per distinct pubsub message (it deduplicates by message id first), including
our own publishes. The gate runs the node's ``EnvelopeValidator`` with
``remember=True``, so a forged, expired, oversized, malformed or replayed envelope is
refused. Pubsub then drops it without forwarding, and counts it against the peer that
forwarded it (gossipsub score P4, ``invalid_messages``); once a peer's score falls
under the thresholds set in ``score_params`` its messages are no longer accepted or
gossiped, and below the graylist threshold it is ignored.

One exception: an envelope this node already took from a DHT offer sheet comes back
as a "replay" when its gossip copy arrives later. That is an honest race, not an
attack, so the gate accepts it for forwarding but does not deliver it twice.

Floods of valid messages
------------------------
Valid, signed messages cost a flooder only its keys, so the gate also limits rates
(``ratelimit``, token buckets with a penalty box): per *originating peer* (pubsub's
``from``, signed under ``strict_signing``, whoever forwards it) and per envelope
*author*, each checked before the signature (the originator) or right after it (the
author, so no one can spend another author's budget). A message past either limit is
rejected: pubsub neither delivers nor forwards it, so the excess dies at the first
honest hop. The peer that handed it over is penalised (P4) only when it published the
message itself; an honest peer relaying a flood it did not start is excused (py-libp2p
has no "ignore" result, so the gate tells the scorer, ``ExcusingScorer``). Our own
publishes are never limited.

Accepted envelopes are parked by pubsub message id; the subscription reader picks
them up, so the consumer gets the decoded ``Envelope`` without a second signature
check.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from google.protobuf.message import DecodeError
from libp2p.abc import IHost, INetStream
from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11, PROTOCOL_ID_V12, GossipSub
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.pubsub import Pubsub
from libp2p.pubsub.score import PeerScorer, ScoreParams, TopicScoreParams

from ..envelope import Envelope, EnvelopeValidator, Rejected, Rejection
from .ratelimit import RateLimit, RateLimiter

logger = logging.getLogger(__name__)

__all__ = [
    "MARKET_TOPIC",
    "REPUTATION_TOPIC",
    "TOPICS",
    "ExcusingScorer",
    "GateDecision",
    "GossipConfig",
    "TopicGate",
    "new_gossip",
    "score_params",
]

MARKET_TOPIC = "/cumulus/market/1"
REPUTATION_TOPIC = "/cumulus/reputation/1"
TOPICS = (MARKET_TOPIC, REPUTATION_TOPIC)


@dataclass(frozen=True, slots=True)
class GossipConfig:
    """Gossipsub parameters.

    Attributes:
        heartbeat_interval: Seconds between gossipsub heartbeats. py-libp2p's default
            is 120 s, which makes the mesh form far too slowly.
        degree, degree_low, degree_high: The mesh degree D and its bounds.
        history: Heartbeats of messages kept for IHAVE gossip and for catching up
            newly subscribed peers.
        invalid_message_weight: Score lost per invalid message (P4).
        invalid_message_decay: Per-heartbeat decay of the invalid-message counter.
        publish_threshold: Below this topic score, a peer's messages are refused.
        gossip_threshold: Below this, no IHAVE/IWANT gossip with the peer.
        graylist_threshold: Below this, the peer is ignored.
        max_messages_per_topic_per_second: Per-forwarder rate limit. py-libp2p's 10/s
            also applies to our own publishes, which a re-announcing host exceeds.
        peer_limit: Messages one originating peer may publish (all its authors
            together): well above what any honest node sends.
        author_limit: Envelopes one author may sign: a host re-announces each of its
            offers (at most ``book.BookLimits.max_orders_per_author``) once per
            heartbeat, plus a bid, cancels and reports.
        max_limited_keys: Peers and authors whose buckets are kept.
    """

    heartbeat_interval: float = 1.0
    degree: int = 6
    degree_low: int = 4
    degree_high: int = 12
    history: int = 5
    invalid_message_weight: float = 10.0
    invalid_message_decay: float = 0.9
    publish_threshold: float = -40.0
    gossip_threshold: float = -20.0
    graylist_threshold: float = -80.0
    max_messages_per_topic_per_second: float = 500.0
    peer_limit: RateLimit = RateLimit(rate=50.0, burst=200.0, penalty_s=10.0)
    author_limit: RateLimit = RateLimit(rate=4.0, burst=24.0, penalty_s=30.0)
    max_limited_keys: int = 8192


class ExcusingScorer(PeerScorer):
    """py-libp2p's scorer, except that the gate may excuse the next invalid message.

    Pubsub counts every message a validator rejects against the peer that forwarded it
    (P4). A message refused for a rate limit that peer did not break (it relayed an
    author's or another peer's flood) must not count: the gate calls ``excuse(peer)``
    right before returning False, and pubsub calls ``on_invalid_message`` right after,
    with no checkpoint in between.
    """

    def __init__(self, params: ScoreParams) -> None:
        super().__init__(params)
        self._excused: ID | None = None
        self.excused = 0

    def excuse(self, peer: ID) -> None:
        self._excused = peer

    def on_invalid_message(self, peer: ID, topic: str) -> None:
        if self._excused is not None and peer == self._excused:
            self._excused = None
            self.excused += 1
            return
        self._excused = None
        super().on_invalid_message(peer, topic)


def score_params(config: GossipConfig) -> ScoreParams:
    """Return peer-scoring parameters with real thresholds (py-libp2p defaults to -inf)."""
    return ScoreParams(
        p4_invalid_messages=TopicScoreParams(
            weight=config.invalid_message_weight,
            # The cap bounds how deep one burst can push a score; decay lets it recover.
            cap=100.0,
            decay=config.invalid_message_decay,
        ),
        p5_behavior_penalty_weight=1.0,
        p5_behavior_penalty_decay=0.9,
        p5_behavior_penalty_threshold=5.0,
        publish_threshold=config.publish_threshold,
        gossip_threshold=config.gossip_threshold,
        graylist_threshold=config.graylist_threshold,
        accept_px_threshold=0.0,
    )


def new_gossip(host: IHost, config: GossipConfig) -> tuple[Pubsub, GossipSub]:
    """Build (but do not start) gossipsub and pubsub on ``host``.

    Run both with ``background_trio_service``; pubsub signs every message with the
    host key (``strict_signing``), on top of the envelope signature inside.
    """
    router = GossipSub(
        [PROTOCOL_ID_V12, PROTOCOL_ID_V11],
        degree=config.degree,
        degree_low=config.degree_low,
        degree_high=config.degree_high,
        gossip_history=config.history,
        heartbeat_initial_delay=0.1,
        heartbeat_interval=config.heartbeat_interval,  # type: ignore[arg-type]
        score_params=score_params(config),
        max_messages_per_topic_per_second=config.max_messages_per_topic_per_second,
        # Loopback and LAN meshes share one IP; diversity grafting would fight the mesh.
        eclipse_protection_enabled=False,
    )
    router.scorer = ExcusingScorer(router.scorer.params)
    pubsub = Pubsub(host, router, strict_signing=True)
    for protocol in pubsub.protocols:
        host.set_stream_handler(protocol, partial(read_pubsub_stream, pubsub))
    return pubsub, router


async def read_pubsub_stream(pubsub: Pubsub, stream: INetStream) -> None:
    """Pubsub's own handler for a peer's stream, except that an RPC that does not decode
    ends that peer's stream, as a truncated one does, instead of the whole node.

    py-libp2p's read loop lets protobuf's ``DecodeError`` out of the handler, and from
    there out of the host: one varint-prefixed line of junk from any peer stopped every
    node it reached. Honest peers sent one too, under load: yamux takes its write lock
    per frame, so an RPC larger than a frame can interleave with a heartbeat's RPC on the
    same stream (a clean CI run met it while a 100 kB offer was gossiped).
    """
    try:
        await pubsub.stream_handler(stream)
    except DecodeError as exc:
        peer = stream.muxed_conn.peer_id
        logger.warning("dropping peer %s's pubsub stream: an RPC did not decode (%s)", peer, exc)
        with contextlib.suppress(Exception):  # a stream already gone cannot be reset
            await stream.reset()
        # What py-libp2p does for a stream that fails to parse: the peer is redialed later.
        pubsub._handle_dead_peer(peer)


class GateDecision(enum.Enum):
    """What the gate decided for one message."""

    DELIVER = "deliver"
    FORWARD_ONLY = "forward only"
    REJECT = "reject"


class TopicGate:
    """The pubsub topic validator: the node's ``EnvelopeValidator`` plus bookkeeping.

    Args:
        validator: The node's single envelope validator (shared with the DHT).
        clock: Returns the current Unix time.
        message_id: Pubsub's message-id function, to park accepted envelopes.
        from_dht: Returns whether an envelope digest was already delivered from the DHT.
        kinds: The envelope kinds this topic carries; ``None`` accepts every kind the
            validator accepts.
        max_parked: Bound on accepted envelopes waiting for the reader.
        own_id: This node's peer ID: its own publishes are not rate-limited.
        peer_limiter, author_limiter: Rate limits per originating peer and per author
            (shared by the node's gates); ``None`` for none.
        excuse: Tells the scorer not to count the next rejection against a forwarder.
    """

    def __init__(
        self,
        validator: EnvelopeValidator,
        *,
        clock: Callable[[], float],
        message_id: Callable[[rpc_pb2.Message], bytes],
        from_dht: Callable[[bytes], bool],
        kinds: frozenset[str] | None = None,
        max_parked: int = 4096,
        own_id: ID | None = None,
        peer_limiter: RateLimiter | None = None,
        author_limiter: RateLimiter | None = None,
        excuse: Callable[[ID], None] = lambda peer: None,
    ) -> None:
        self._own_id = own_id
        self._peer_limiter = peer_limiter
        self._author_limiter = author_limiter
        self._excuse = excuse
        self._validator = validator
        self._clock = clock
        self._message_id = message_id
        self._from_dht = from_dht
        self._kinds = kinds
        self._max_parked = max_parked
        self._parked: OrderedDict[bytes, Envelope] = OrderedDict()
        self.rejections: Counter[str] = Counter()
        self.accepted = 0

    def decide(self, raw: bytes, *, now: float) -> tuple[GateDecision, Envelope | Rejected]:
        """Check one payload. Sans-IO: the decision, and the envelope or the rejection."""
        result = self._validator.validate(raw, now=now, remember=True)
        if isinstance(result, Rejected):
            if result.reason is Rejection.REPLAYED:
                # The DHT-first race (see the module docstring): forward, do not deliver.
                replayed = Envelope.from_bytes(raw)
                if self._from_dht(replayed.digest):
                    return GateDecision.FORWARD_ONLY, replayed
            return GateDecision.REJECT, result
        if self._kinds is not None and result.kind not in self._kinds:
            # Checked after the signature, so a nonce is spent: harmless, the author
            # chose the wrong topic and re-sending on the right one is its own problem.
            return GateDecision.REJECT, Rejected(
                Rejection.UNKNOWN_KIND, f"kind {result.kind!r} is not carried on this topic"
            )
        return GateDecision.DELIVER, result

    def __call__(self, forwarder: ID, msg: rpc_pb2.Message) -> bool:
        """Pubsub's synchronous validator hook. Never raises on peer input."""
        now = self._clock()
        origin = ID(msg.from_id) if msg.from_id else forwarder
        own = self._own_id is not None and origin == self._own_id
        if not own and self._peer_limiter is not None:
            if not self._peer_limiter.allow(origin, now=now):
                return self._rate_limited("RATE_LIMITED_PEER", forwarder, origin)
        decision, result = self.decide(bytes(msg.data), now=now)
        if isinstance(result, Rejected):
            self.rejections[result.reason.name] += 1
            return False
        if not own and self._author_limiter is not None and decision is GateDecision.DELIVER:
            if not self._author_limiter.allow(result.author, now=now):
                # The peer that published an author's flood is as much to blame.
                return self._rate_limited("RATE_LIMITED_AUTHOR", forwarder, origin)
        if decision is GateDecision.DELIVER:
            self.accepted += 1
            self._parked[self._message_id(msg)] = result
            while len(self._parked) > self._max_parked:
                self._parked.popitem(last=False)
        return True

    def _rate_limited(self, what: str, forwarder: ID, offender: ID) -> bool:
        """Reject a message past a rate limit; excuse a forwarder that only relayed it."""
        self.rejections[what] += 1
        if forwarder != offender:
            self._excuse(forwarder)
        return False

    def take(self, msg: rpc_pb2.Message) -> Envelope | None:
        """Return the envelope the gate accepted for ``msg`` (once), or ``None``."""
        return self._parked.pop(self._message_id(msg), None)
