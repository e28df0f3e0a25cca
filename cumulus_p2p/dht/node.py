"""``MeshNode``: one node's host, DHT, gossip and NAT services, composed under trio.

Theory of operation
-------------------
``open_mesh_node`` starts, in order: the libp2p host (Noise, yamux, TCP), pubsub with
gossipsub, the Kademlia DHT, the NAT services, then a nursery of the node's own
loops. Leaving the ``async with`` block cancels the loops and stops the services in
reverse order.

Every envelope a node receives, by gossip or from the DHT, goes through the one
``EnvelopeValidator`` the caller passes in. Accepted envelopes come out of
``MeshNode.messages`` as ``MeshMessage`` values; nothing else does.

Offers are *announcements*: ``announce(name, kind, body)`` hands the node a body to
keep alive. On every announce heartbeat the node re-seals each body into a fresh
envelope (new expiry and nonce) and gossips it on the market topic. It stores all of
them as its offer sheet in the DHT (see ``records``) when one changed, and often enough
that a stored sheet never holds an offer near its expiry. A late joiner reads every
host's sheet (``sync_offers``), so it has the whole book without waiting for fresh
gossip. When a host stops (or ``withdraw``s), nothing renews its envelopes and every
node drops them when they expire, at most ``offer_ttl`` after the last heartbeat.

All envelopes signed by one identity must draw nonces from one increasing source,
or receivers refuse the older ones as stale; seal through ``MeshNode.seal``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field

import multiaddr
import trio
from libp2p.abc import INetStream
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.peer.id import ID
from libp2p.pubsub.pubsub import Pubsub
from libp2p.tools.anyio_service import background_trio_service
from libp2p.utils.address_validation import find_free_port

from .._errors import AnnouncementError, MeshError, PeerUnreachableError
from ..envelope import Envelope, EnvelopeValidator, Rejected, seal
from ..identity import NodeIdentity
from .gossip import MARKET_TOPIC, TOPICS, ExcusingScorer, GossipConfig, TopicGate, new_gossip
from .host import (
    connect,
    interface_ipv4s,
    is_connected,
    listen_addrs_with_id,
    new_mesh_host,
    parse_peer_addr,
    peers_to_dial,
)
from .kad import fetch_offer_sheets, new_dht
from .nat import NatConfig, NatTraversal, open_nat_traversal
from .ratelimit import RateLimiter
from .records import OFFERS_INDEX, SHEET_KIND, encode_sheet_body, offers_key

__all__ = [
    "MeshConfig",
    "MeshMessage",
    "MeshNode",
    "MeshStatistics",
    "mesh_validator",
    "open_mesh_node",
]

logger = logging.getLogger(__name__)

#: An announcement's body: fixed bytes, or ``body(nonce, expires_at) -> bytes``.
AnnouncedBody = bytes | Callable[[int, float], bytes]

DHT_SOURCE = "dht"
GOSSIP_SOURCE = "gossip"


@dataclass(frozen=True, slots=True)
class MeshConfig:
    """How a node joins and serves the mesh.

    Attributes:
        listen_addrs: Multiaddrs to listen on. Empty means the node cannot be dialed
            (behind NAT): it runs the DHT in client mode and is reached through relays.
        bootstrap: ``/ip4/.../tcp/.../p2p/<id>`` addresses dialed at start.
        relays: Relay addresses an unreachable node connects to and reserves on.
        enable_mdns: Discover peers on the LAN with mDNS (opt-in).
        announce_interval: Seconds between re-announcements of this node's offers.
        offer_ttl: Lifetime of each announced envelope; keep it at least twice
            ``announce_interval`` so one late heartbeat does not drop the offer.
        maintenance_interval: Seconds between routing-table and peer upkeep rounds.
        reachability_interval: Seconds between AutoNAT checks (0 disables them).
        provide_every: Re-provide the offer index every this many stores of the sheet.
        max_offers: Most offers one node may announce (and one sheet may list).
        sync_on_start: Read the book from the DHT once connected to bootstrap peers.
        message_buffer: Accepted messages held for a slow consumer before readers wait.
        gossip: Gossipsub parameters.
        nat: Relay limits and switches.
    """

    listen_addrs: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    bootstrap: tuple[str, ...] = ()
    relays: tuple[str, ...] = ()
    enable_mdns: bool = False
    announce_interval: float = 10.0
    offer_ttl: float = 30.0
    maintenance_interval: float = 5.0
    reachability_interval: float = 120.0
    provide_every: int = 6
    max_offers: int = 64
    sync_on_start: bool = True
    message_buffer: int = 1024
    gossip: GossipConfig = field(default_factory=GossipConfig)
    nat: NatConfig = field(default_factory=NatConfig)

    def __post_init__(self) -> None:
        if not (self.announce_interval > 0 and self.offer_ttl >= 2 * self.announce_interval):
            raise MeshError("offer_ttl must be at least twice a positive announce_interval")
        if self.max_offers < 0 or self.message_buffer < 1 or self.provide_every < 1:
            raise MeshError("max_offers, message_buffer and provide_every must be positive")


@dataclass(frozen=True, slots=True)
class MeshMessage:
    """One accepted envelope.

    Attributes:
        topic: The gossip topic it belongs to (offers from the DHT: the market topic).
        envelope: The validated envelope.
        source: ``"gossip"`` or ``"dht"``.
        forwarder: The peer that handed it to us (``None`` from the DHT).
    """

    topic: str
    envelope: Envelope
    source: str
    forwarder: ID | None


@dataclass(frozen=True, slots=True)
class MeshStatistics:
    """A snapshot of a node's mesh state."""

    connected_peers: int
    routing_table_size: int
    announcements: int
    accepted: int
    rejected: Mapping[str, int]
    dht_offers_delivered: int
    reachability: str


def mesh_validator(kinds: Sequence[str], **kwargs: float | int) -> EnvelopeValidator:
    """Return an ``EnvelopeValidator`` for ``kinds`` plus the mesh's own ``SHEET_KIND``.

    Keyword arguments go to ``EnvelopeValidator`` (``max_size``, ``max_ttl``, ...).
    """
    return EnvelopeValidator([*kinds, SHEET_KIND], **kwargs)  # type: ignore[arg-type]


class MeshNode:
    """A running mesh node. Get one from ``open_mesh_node``; do not construct it."""

    def __init__(
        self,
        identity: NodeIdentity,
        config: MeshConfig,
        validator: EnvelopeValidator,
        clock: Callable[[], float],
    ) -> None:
        self.identity = identity
        self.config = config
        self.validator = validator
        self._clock = clock
        self.host = new_mesh_host(
            identity.key_pair,
            listen_addrs=[multiaddr.Multiaddr(a) for a in config.listen_addrs],
            enable_mdns=config.enable_mdns,
        )
        self.reachable = bool(config.listen_addrs)
        self.pubsub, self.router = new_gossip(self.host, config.gossip)
        self.dht: KadDHT = new_dht(
            self.host,
            validator,
            mode=DHTMode.SERVER if self.reachable else DHTMode.CLIENT,
            clock=clock,
            max_offers=config.max_offers,
        )
        self.nat: NatTraversal | None = None
        send, receive = trio.open_memory_channel[MeshMessage](config.message_buffer)
        self._send = send
        self.messages: trio.MemoryReceiveChannel[MeshMessage] = receive
        self._nonce = 0
        self._announced: dict[str, tuple[str, AnnouncedBody]] = {}
        self._current: dict[str, Envelope] = {}
        self._dirty = trio.Event()
        self._store_due = trio.Event()
        # The offer sheet in the DHT: how many times it was stored, when last, and
        # whether an offer was announced or withdrawn since (see _store_sheet).
        self._stores = 0
        self._stored_at = -float("inf")
        self._sheet_changed = False
        # Digests of offers delivered from the DHT, with their expiry: their gossip
        # copies are honest late arrivals, not replays (see gossip.TopicGate).
        self._from_dht: dict[bytes, float] = {}
        self._dht_delivered = 0
        # One budget per peer and per author across both topics.
        gossip = config.gossip
        self.peer_limiter = RateLimiter(gossip.peer_limit, max_keys=gossip.max_limited_keys)
        self.author_limiter = RateLimiter(gossip.author_limit, max_keys=gossip.max_limited_keys)
        scorer = self.router.scorer
        self._gates = {
            topic: TopicGate(
                validator,
                clock=clock,
                message_id=self.pubsub.get_message_id,
                from_dht=self._from_dht.__contains__,
                own_id=self.host.get_id(),
                peer_limiter=self.peer_limiter,
                author_limiter=self.author_limiter,
                excuse=scorer.excuse if isinstance(scorer, ExcusingScorer) else lambda p: None,
            )
            for topic in TOPICS
        }

    # --- identity and addresses ---------------------------------------------------

    @property
    def peer_id(self) -> ID:
        """This node's libp2p peer ID."""
        return self.host.get_id()

    @property
    def addrs(self) -> list[multiaddr.Multiaddr]:
        """Where this node can be dialed, each ending in ``/p2p/<peer id>``."""
        return listen_addrs_with_id(self.host)

    def next_nonce(self) -> int:
        """Return a nonce larger than every earlier one from this node.

        A counter, not a timestamp: receivers accept out-of-order envelopes only within
        a window of nonces below the author's highest, so consecutive envelopes must get
        consecutive nonces. It starts at the microseconds since the epoch, so a
        restarted node still goes up unless it sealed over a million envelopes a second.
        """
        if self._nonce == 0:
            self._nonce = time.time_ns() // 1000
        self._nonce += 1
        return self._nonce

    def seal(self, kind: str, body: bytes, *, ttl: float | None = None) -> Envelope:
        """Sign ``body`` as this node, with the node's nonce source and clock.

        Args:
            kind: The envelope kind.
            body: The encoded message.
            ttl: Lifetime in seconds; ``config.offer_ttl`` if not given.
        """
        return seal(
            self.identity,
            kind,
            body,
            now=self._clock(),
            ttl=self.config.offer_ttl if ttl is None else ttl,
            nonce=self.next_nonce(),
        )

    def _seal_announced(self, kind: str, body: AnnouncedBody) -> Envelope:
        if isinstance(body, bytes):
            return self.seal(kind, body)
        now, ttl, nonce = self._clock(), self.config.offer_ttl, self.next_nonce()
        # seal() computes the expiry the same way, so body and envelope agree exactly.
        encoded = body(nonce, float(now + ttl))
        return seal(self.identity, kind, encoded, now=now, ttl=ttl, nonce=nonce)

    # --- publishing -----------------------------------------------------------------

    async def publish(self, envelope: Envelope | bytes, *, topic: str = MARKET_TOPIC) -> None:
        """Gossip one envelope (a bid, a cancel, a report) on ``topic``.

        Our own validator checks it too, so the node's own consumer sees it, and a
        replayed or invalid envelope is silently not sent.
        """
        if topic not in TOPICS:
            raise MeshError(f"unknown topic {topic!r}; use one of {TOPICS}")
        raw = envelope.to_bytes() if isinstance(envelope, Envelope) else envelope
        await self.pubsub.publish(topic, raw)

    async def drain(self, timeout: float = 2.0) -> None:
        """Wait, at most ``timeout`` seconds, for the gossip queued for peers to leave.

        ``publish`` only queues a message per peer (py-libp2p's ``RpcQueue``); a node that
        stops right after publishing (a consumer's last service reports) would drop it.
        """
        queues = getattr(self.pubsub, "peer_queues", {})
        with trio.move_on_after(timeout):
            while any(len(queue) for queue in queues.values()):
                await trio.sleep(0.05)
            await trio.sleep(0.2)  # the last message taken off a queue may still be in flight

    async def announce(self, name: str, kind: str, body: AnnouncedBody) -> Envelope:
        """Keep an offer alive: gossip it now and re-announce it every heartbeat.

        Args:
            name: This node's handle for the offer; announcing a name again replaces it.
            kind: The envelope kind (e.g. ``"market/offer"``).
            body: The encoded offer, or a function ``body(nonce, expires_at)`` that
                encodes it for each sealing: market messages repeat their envelope's
                nonce and expiry inside the body, so each re-announcement needs a new one.

        Returns:
            The envelope gossiped now.

        Raises:
            AnnouncementError: Over ``config.max_offers``, or the validator refuses the
                kind.
        """
        if name not in self._announced and len(self._announced) >= self.config.max_offers:
            raise AnnouncementError(f"already announcing {self.config.max_offers} offers")
        if kind not in self.validator.kinds:
            raise AnnouncementError(f"our own validator does not accept kind {kind!r}")
        self._announced[name] = (kind, body)
        envelope = self._seal_announced(kind, body)
        self._current[name] = envelope
        self._sheet_changed = True
        await self.publish(envelope)
        self._dirty.set()
        return envelope

    def withdraw(self, name: str) -> None:
        """Stop re-announcing an offer; it expires everywhere within ``offer_ttl``.

        Withdrawing does not tell the market; publish a signed cancel for that.
        """
        self._announced.pop(name, None)
        self._current.pop(name, None)
        self._sheet_changed = True
        self._dirty.set()

    # --- joining and reading the DHT ------------------------------------------------

    async def connect(self, addr: str | multiaddr.Multiaddr) -> ID:
        """Connect to a peer and add it to the DHT routing table.

        Raises:
            MeshError: ``addr`` is not a ``/p2p/`` multiaddr.
            PeerUnreachableError: The dial failed.
        """
        info = parse_peer_addr(addr)
        await connect(self.host, info)
        await self._add_to_routing_table(info.peer_id)
        return info.peer_id

    async def connect_via_relay(self, relay_addr: str | multiaddr.Multiaddr, target: ID) -> None:
        """Reach ``target`` through the relay at ``relay_addr`` (connecting to it first).

        Raises:
            PeerUnreachableError: The relay or the target cannot be reached.
        """
        if self.nat is None:
            raise MeshError("the node is not running")
        info = parse_peer_addr(relay_addr)
        if not is_connected(self.host, info.peer_id):
            await connect(self.host, info)
        await self.nat.dial_via_relay(info.addrs[0], info.peer_id, target)

    async def sync_offers(self) -> dict[ID, list[Envelope]]:
        """Read every host's live offers from the DHT and deliver the unseen ones.

        Returns:
            Each host's live offers as the DHT holds them, including ones already
            delivered by gossip (those are not delivered again).
        """
        now = self._clock()
        for digest in [d for d, t in self._from_dht.items() if t <= now]:
            del self._from_dht[digest]
        found = await fetch_offer_sheets(
            self.dht, self.validator, clock=self._clock, max_offers=self.config.max_offers
        )
        for offers in found.values():
            for offer in offers:
                result = self.validator.validate_envelope(offer, now=self._clock())
                if isinstance(result, Rejected):
                    # REPLAYED: gossip delivered it first. EXPIRED: it died meanwhile.
                    continue
                self._from_dht[offer.digest] = offer.expires_at
                self._dht_delivered += 1
                await self._send.send(MeshMessage(MARKET_TOPIC, offer, DHT_SOURCE, None))
        return found

    def statistics(self) -> MeshStatistics:
        """Return a snapshot of this node's mesh state."""
        rejected: Counter[str] = Counter()
        for gate in self._gates.values():
            rejected.update(gate.rejections)
        return MeshStatistics(
            connected_peers=len(self.host.get_connected_peers()),
            routing_table_size=self.dht.get_routing_table_size(),
            announcements=len(self._announced),
            accepted=sum(g.accepted for g in self._gates.values()),
            rejected=dict(rejected),
            dht_offers_delivered=self._dht_delivered,
            reachability=self.nat.reachability() if self.nat is not None else "unknown",
        )

    # --- services -------------------------------------------------------------------

    async def _add_to_routing_table(self, peer_id: ID) -> None:
        try:
            await self.dht.add_peer(peer_id)
        except Exception as exc:  # noqa: BLE001 - a peer's failure must not stop the node
            logger.debug("cannot add %s to the routing table: %s", peer_id, exc)

    async def _read_topic(self, topic: str, pubsub: Pubsub) -> None:
        subscription = await pubsub.subscribe(topic)
        gate = self._gates[topic]
        while True:
            msg = await subscription.get()
            envelope = gate.take(msg)
            if envelope is None:
                continue  # forwarded only, or parked entry evicted under load
            forwarder = ID(msg.from_id) if msg.from_id else None
            await self._send.send(MeshMessage(topic, envelope, GOSSIP_SOURCE, forwarder))

    async def _gossip_loop(self) -> None:
        """Re-seal and gossip every announced offer each heartbeat; ask for the offer
        sheet to be stored then, and on each change."""
        interval = self.config.announce_interval
        next_reseal = trio.current_time() + interval
        while True:
            with trio.move_on_at(next_reseal):
                await self._dirty.wait()
            self._dirty = trio.Event()
            if trio.current_time() >= next_reseal:
                next_reseal = trio.current_time() + interval
                for name, (kind, body) in list(self._announced.items()):
                    envelope = self._seal_announced(kind, body)
                    self._current[name] = envelope
                    await self.publish(envelope)
            self._store_due.set()

    async def _store_loop(self) -> None:
        """Store the offer sheet when it is due, in a task of its own: a DHT lookup waits
        on a slow peer for as long as py-libp2p's query timeouts allow (10 s each, not
        bounded as a whole), and the offers' gossip must not wait with it."""
        while True:
            await self._store_due.wait()
            self._store_due = trio.Event()
            with trio.move_on_after(self.config.offer_ttl) as deadline:
                await self._store_sheet()
            if deadline.cancelled_caught:
                logger.warning("storing the offer sheet outlasted offer_ttl: given up")
                self._sheet_changed = True

    async def _store_sheet(self) -> None:
        if not self._current and self._stores == 0:
            return  # nothing ever announced: no sheet, no provider record
        # Storing the sheet costs a DHT lookup and a put to the closest peers: 40 % of
        # an idle node's CPU at a heartbeat every 2 s (an offer_ttl of 30 s). A sheet
        # lists the same offers until one is announced or withdrawn, and a late joiner
        # needs its offers to outlive the wait for fresh gossip: it is stored again on
        # a change, or before the stored one has lived half of offer_ttl by the next
        # heartbeat (at the defaults, 10 s and 30 s, that is every heartbeat).
        now = self._clock()
        refresh_at = self._stored_at + self.config.offer_ttl / 2 - self.config.announce_interval
        if not self._sheet_changed and now < refresh_at:
            return
        self._sheet_changed = False
        sheet = self.seal(
            SHEET_KIND, encode_sheet_body(e.to_bytes() for e in self._current.values())
        )
        try:
            await self.dht.put_value(offers_key(self.peer_id), sheet.to_bytes())
            if self._stores % self.config.provide_every == 0:
                await self.dht.provide(OFFERS_INDEX)
        except Exception as exc:  # noqa: BLE001 - DHT RPC failures have no common base
            # Gossip still carries the offers; the next heartbeat retries the DHT.
            logger.warning("storing the offer sheet failed: %s", exc)
            self._sheet_changed = True
            return
        self._stores += 1
        self._stored_at = now

    async def _maintenance_loop(self) -> None:
        while True:
            for peer_id in self.host.get_connected_peers():
                if self.dht.routing_table.peer_in_table(peer_id):
                    continue
                await self._add_to_routing_table(peer_id)
            if self.config.enable_mdns:
                for info in peers_to_dial(self.host)[:8]:
                    try:
                        await connect(self.host, info, timeout=5.0)
                    except PeerUnreachableError:
                        continue
                    await self._add_to_routing_table(info.peer_id)
            now = self._clock()
            self.validator.expire(now)
            await trio.sleep(self.config.maintenance_interval)

    async def _reachability_loop(self) -> None:
        interval = self.config.reachability_interval
        while True:
            await trio.sleep(interval)
            if self.nat is None:
                continue
            servers = self.host.get_connected_peers()[:8]
            if len(servers) < 4:
                continue
            verdict = await self.nat.check_reachability(servers)
            if verdict == "private" and self.dht.mode == DHTMode.SERVER:
                await self.dht.switch_mode(DHTMode.CLIENT)
            elif verdict == "public" and self.dht.mode == DHTMode.CLIENT and self.reachable:
                await self.dht.switch_mode(DHTMode.SERVER)

    async def _join(self) -> None:
        for addr in self.config.bootstrap:
            try:
                await self.connect(addr)
            except PeerUnreachableError as exc:
                logger.warning("bootstrap peer %s unreachable: %s", addr, exc)
        if self.config.relays and self.nat is not None:
            for addr in self.config.relays:
                try:
                    await self.connect(addr)
                except PeerUnreachableError as exc:
                    logger.warning("relay %s unreachable: %s", addr, exc)
            await self.nat.use_relays()

    async def _initial_sync(self) -> None:
        if self.config.sync_on_start and self.host.get_connected_peers():
            await self.sync_offers()

    async def _run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            for topic in TOPICS:
                self.pubsub.set_topic_validator(topic, self._gates[topic], False)
                nursery.start_soon(self._read_topic, topic, self.pubsub)
            nursery.start_soon(self._maintenance_loop)
            if self.config.reachability_interval > 0 and self.reachable:
                nursery.start_soon(self._reachability_loop)
            await self._join()
            # After started(): delivering the book can wait on the consumer, who only
            # starts reading once open_mesh_node has yielded.
            task_status.started()
            await self._initial_sync()
            nursery.start_soon(self._gossip_loop)
            nursery.start_soon(self._store_loop)


@asynccontextmanager
async def open_mesh_node(
    identity: NodeIdentity,
    validator: EnvelopeValidator,
    config: MeshConfig | None = None,
    *,
    clock: Callable[[], float] = time.time,
) -> AsyncIterator[MeshNode]:
    """Start a mesh node and stop it on exit.

    When this yields, the node listens and has dialed its bootstrap peers and relays.
    It then reads the current book from the DHT (``sync_offers``) and delivers those
    offers on ``messages`` before it starts announcing its own offers.

    Args:
        identity: The node's key.
        validator: The one validator for every received envelope; it must accept
            ``records.SHEET_KIND`` (``mesh_validator`` builds one that does).
        config: How to join and serve; defaults to ``MeshConfig()``.
        clock: Returns the current Unix time (envelope expiry is wall-clock time).

    Yields:
        The running node.

    Raises:
        MeshError: The validator does not accept ``SHEET_KIND``.
    """
    config = config or MeshConfig()
    if SHEET_KIND not in validator.kinds:
        raise MeshError(f"the validator must accept {SHEET_KIND!r}; see mesh_validator()")
    node = MeshNode(identity, config, validator, clock)
    listen = concrete_listen_addrs(config.listen_addrs)
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(node.host.run(listen_addrs=listen))
        await stack.enter_async_context(background_trio_service(node.pubsub))
        # Runs on exit right before pubsub's service stops, once the DHT and the
        # router have stopped (so nothing of ours dials out any more).
        stack.push_async_callback(_leave_quietly, node)
        await stack.enter_async_context(background_trio_service(node.router))
        await node.pubsub.wait_until_ready()
        await stack.enter_async_context(background_trio_service(node.dht))
        node.nat = await stack.enter_async_context(
            open_nat_traversal(node.host, config.nat, reachable=node.reachable)
        )
        nursery = await stack.enter_async_context(trio.open_nursery())
        await nursery.start(node._run)
        try:
            yield node
        finally:
            nursery.cancel_scope.cancel()
            node._send.close()


async def _leave_quietly(node: MeshNode) -> None:
    """Refuse new pubsub streams, then close every connection, before pubsub stops.

    py-libp2p hands each received gossip message to pubsub's task nursery. One that
    arrives while that nursery is closing raises "Nursery is closed to new arrivals"
    out of the host, and the node exits with an error after its work is done (seen
    on a provider leaving on SIGTERM, and on a consumer whose job had finished while
    a peer redialed it). A pubsub stream a peer opens from now on is reset at once,
    so none can deliver a message. The handlers are replaced, not removed: multiselect
    looks its handler up again after an await, and a protocol removed in between
    raises KeyError out of the host instead.
    """
    for protocol in node.pubsub.protocols:
        node.host.set_stream_handler(protocol, _reset_stream)
    with trio.CancelScope(shield=True), trio.move_on_after(2.0):
        for peer in list(node.host.get_connected_peers()):
            try:
                await node.host.disconnect(peer)
            except Exception as exc:  # noqa: BLE001 - py-libp2p raises many types here
                logger.debug("closing the connection to %s: %r", peer, exc)


async def _reset_stream(stream: INetStream) -> None:
    await stream.reset()


def concrete_listen_addrs(addrs: Sequence[str]) -> list[multiaddr.Multiaddr]:
    """``addrs`` with ``/ip4/0.0.0.0`` replaced by each interface's address (one port).

    py-libp2p advertises its listen addresses as they are: peers told ``0.0.0.0`` dial
    themselves. Listening on each interface's address instead (loopback included)
    advertises addresses other machines can dial.
    """
    result = []
    for text in addrs:
        parts = text.split("/")
        if len(parts) == 5 and parts[1:4] == ["ip4", "0.0.0.0", "tcp"]:
            port = int(parts[4]) or find_free_port()
            result.extend(multiaddr.Multiaddr(f"/ip4/{ip}/tcp/{port}") for ip in interface_ipv4s())
        else:
            result.append(multiaddr.Multiaddr(text))
    return result
