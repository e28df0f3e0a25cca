"""Real libp2p meshes on loopback for tests and benchmarks.

``open_mesh(n)`` starts ``n`` real mesh nodes on ``127.0.0.1/tcp/0``, connects them
(each to the first node and to its predecessor), waits until the gossip mesh of the
market topic spans all of them, and drains each node's accepted messages into a
``LiveEnvelopes`` book. Nodes can join later (``Mesh.add_node``) and leave
(``Mesh.stop_node``). Everything stops when the ``async with`` block ends.

``open_rogue_peer`` starts a bare libp2p host with gossipsub and *no* validator, to
inject forged, replayed, expired or oversized payloads the way an attacker would.
``open_stuck_dht_peer`` starts one that takes DHT requests and answers none, as a peer
frozen mid-exchange would.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field

import multiaddr
import trio
from libp2p.custom_types import TProtocol
from libp2p.kad_dht.kad_dht import PROTOCOL_ID as DHT_PROTOCOL
from libp2p.network.stream.exceptions import StreamError
from libp2p.pubsub.pubsub import Pubsub
from libp2p.tools.anyio_service import background_trio_service

from ..dht.gossip import MARKET_TOPIC, TOPICS, GossipConfig, new_gossip
from ..dht.host import LOOPBACK, connect, new_mesh_host, parse_peer_addr
from ..dht.nat import NatConfig
from ..dht.node import MeshConfig, MeshMessage, MeshNode, mesh_validator, open_mesh_node
from ..dht.records import LiveEnvelopes
from ..identity import NodeIdentity

__all__ = [
    "TEST_KINDS",
    "Mesh",
    "RoguePeer",
    "fast_config",
    "open_mesh",
    "open_rogue_peer",
    "open_stuck_dht_peer",
    "wait_for",
]

TEST_KINDS = ("market/offer", "market/bid", "market/cancel", "reputation/report")


def fast_config(**overrides: object) -> MeshConfig:
    """Return a loopback config with short heartbeats and TTLs, for tests.

    Keyword arguments override ``MeshConfig`` fields.
    """
    base = MeshConfig(
        listen_addrs=(str(LOOPBACK),),
        announce_interval=0.5,
        offer_ttl=2.0,
        maintenance_interval=0.5,
        reachability_interval=0.0,
        gossip=GossipConfig(heartbeat_interval=0.5),
        nat=NatConfig(),
    )
    return dataclasses.replace(base, **overrides)  # type: ignore[arg-type]


async def wait_for(
    predicate: Callable[[], bool], *, timeout: float, poll: float = 0.02, what: str = ""
) -> float:
    """Wait until ``predicate()`` is true; return the seconds it took.

    Raises:
        trio.TooSlowError: Not true within ``timeout``; the message says ``what``.
    """
    start = trio.current_time()
    try:
        with trio.fail_after(timeout):
            while not predicate():
                await trio.sleep(poll)
    except trio.TooSlowError as exc:
        raise trio.TooSlowError(f"not true within {timeout}s: {what}") from exc
    return trio.current_time() - start


@dataclass
class _Member:
    node: MeshNode
    book: LiveEnvelopes
    received: list[MeshMessage]
    stop: trio.CancelScope
    stopped: trio.Event
    # Envelope digest -> trio.current_time() when the consumer got it (benchmarks).
    arrivals: dict[bytes, float] = field(default_factory=dict)


@dataclass
class Mesh:
    """A set of running nodes, their books and a way to add and stop nodes."""

    nursery: trio.Nursery
    config: MeshConfig
    kinds: Sequence[str]
    clock: Callable[[], float]
    members: list[_Member] = field(default_factory=list)

    @property
    def nodes(self) -> list[MeshNode]:
        """Every node started so far (stopped ones included)."""
        return [m.node for m in self.members]

    @property
    def books(self) -> list[LiveEnvelopes]:
        """Each node's book of accepted envelopes, by node index."""
        return [m.book for m in self.members]

    def received(self, index: int) -> list[MeshMessage]:
        """Every message node ``index`` accepted, in order."""
        return self.members[index].received

    def arrival(self, index: int, digest: bytes) -> float | None:
        """When node ``index``'s consumer got the envelope (``trio.current_time()``)."""
        return self.members[index].arrivals.get(digest)

    def running(self) -> list[int]:
        """Indices of the nodes not stopped."""
        return [i for i, m in enumerate(self.members) if not m.stopped.is_set()]

    async def add_node(self, config: MeshConfig | None = None) -> MeshNode:
        """Start one more node; it returns once the node has joined (and synced)."""
        member: _Member = await self.nursery.start(self._run_member, config or self.config)
        self.members.append(member)
        return member.node

    async def stop_node(self, index: int) -> None:
        """Stop node ``index`` (as a host that goes away) and wait until it is down."""
        member = self.members[index]
        member.stop.cancel()
        await member.stopped.wait()

    async def _run_member(
        self, config: MeshConfig, *, task_status: trio.TaskStatus[_Member]
    ) -> None:
        stopped = trio.Event()
        try:
            with trio.CancelScope() as scope:
                async with open_mesh_node(
                    NodeIdentity.generate(),
                    mesh_validator(self.kinds),
                    config,
                    clock=self.clock,
                ) as node:
                    member = _Member(node, LiveEnvelopes(), [], scope, stopped)
                    task_status.started(member)
                    async for msg in node.messages:
                        member.arrivals.setdefault(msg.envelope.digest, trio.current_time())
                        member.received.append(msg)
                        member.book.add(msg.envelope, source=msg.source, now=self.clock())
        finally:
            stopped.set()


def _mesh_is_connected(nodes: Sequence[MeshNode], topic: str) -> bool:
    ids = {n.peer_id: n for n in nodes}
    seen = {nodes[0].peer_id}
    frontier = [nodes[0]]
    while frontier:
        node = frontier.pop()
        for peer in node.router.mesh.get(topic, ()):
            if peer in ids and peer not in seen:
                seen.add(peer)
                frontier.append(ids[peer])
    return len(seen) == len(nodes)


async def wait_for_gossip_mesh(
    nodes: Sequence[MeshNode], *, timeout: float = 10.0, topics: Sequence[str] = TOPICS
) -> float:
    """Wait until each topic's gossipsub mesh connects all ``nodes``."""
    return await wait_for(
        lambda: all(_mesh_is_connected(nodes, t) for t in topics),
        timeout=timeout,
        poll=0.05,
        what="gossip mesh spans all nodes",
    )


@asynccontextmanager
async def open_mesh(
    n: int,
    *,
    config: MeshConfig | None = None,
    kinds: Sequence[str] = TEST_KINDS,
    clock: Callable[[], float] = time.time,
    mesh_timeout: float = 15.0,
) -> AsyncIterator[Mesh]:
    """Start ``n`` connected nodes on loopback.

    Args:
        n: How many nodes.
        config: Node config; ``fast_config()`` by default. Its bootstrap list is
            ignored: nodes are wired here, each to node 0 and to its predecessor.
        kinds: Envelope kinds the nodes' validators accept.
        clock: The nodes' Unix clock.
        mesh_timeout: Seconds to wait for the gossip mesh to span all nodes.

    Yields:
        The mesh.
    """
    config = config or fast_config()
    async with trio.open_nursery() as nursery:
        mesh = Mesh(nursery, config, kinds, clock)
        for _ in range(n):
            await mesh.add_node(dataclasses.replace(config, bootstrap=()))
        nodes = mesh.nodes
        # Concurrently: py-libp2p 0.8.1 holds every dial for its 250 ms happy-eyeballs
        # delay even when the first address succeeds.
        async with trio.open_nursery() as dialing:
            for i in range(1, n):
                dialing.start_soon(nodes[i].connect, nodes[0].addrs[0])
                if i > 1:
                    dialing.start_soon(nodes[i].connect, nodes[i - 1].addrs[0])
        if n > 1:
            await wait_for_gossip_mesh(nodes, timeout=mesh_timeout)
        try:
            yield mesh
        finally:
            nursery.cancel_scope.cancel()


@dataclass
class RoguePeer:
    """A bare host with gossipsub and no validation: it publishes whatever it is given."""

    pubsub: Pubsub
    peer_id: object

    async def publish_raw(self, data: bytes, *, topic: str = MARKET_TOPIC) -> None:
        """Gossip ``data`` unchecked."""
        await self.pubsub.publish(topic, data)

    async def flood(self, payloads: Sequence[bytes], *, topic: str = MARKET_TOPIC) -> None:
        """Gossip every payload as fast as the peers take them: py-libp2p drops what is
        published past a peer's outbound queue (32 RPCs), so wait while one is half full."""
        for data in payloads:
            while any(len(q) >= 16 for q in getattr(self.pubsub, "peer_queues", {}).values()):
                await trio.sleep(0.005)
            await self.pubsub.publish(topic, data)


@asynccontextmanager
async def open_rogue_peer(
    targets: Sequence[MeshNode], *, gossip: GossipConfig | None = None
) -> AsyncIterator[RoguePeer]:
    """Start a validator-less gossip peer connected to every node in ``targets``.

    Returns once every target has it in its gossip mesh for the market topic, so a
    payload it publishes reaches each target directly.
    """
    identity = NodeIdentity.generate()
    host = new_mesh_host(identity.key_pair)
    # A wide mesh degree makes it graft every target, as a flooding attacker would.
    wide = GossipConfig(heartbeat_interval=0.5, degree=64, degree_low=32, degree_high=128)
    pubsub, router = new_gossip(host, gossip or wide)
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(host.run(listen_addrs=[multiaddr.Multiaddr(str(LOOPBACK))]))
        await stack.enter_async_context(background_trio_service(pubsub))
        await stack.enter_async_context(background_trio_service(router))
        await pubsub.wait_until_ready()
        for topic in TOPICS:
            await pubsub.subscribe(topic)
        async with trio.open_nursery() as dialing:
            for node in targets:
                dialing.start_soon(connect, host, parse_peer_addr(node.addrs[0]))
        # Its own publishes go to its mesh peers, so wait until that mesh holds them all.
        await wait_for(
            lambda: all(n.peer_id in router.mesh.get(MARKET_TOPIC, ()) for n in targets),
            timeout=10.0,
            poll=0.05,
            what="every target in the rogue peer's gossip mesh",
        )
        yield RoguePeer(pubsub, host.get_id())


@asynccontextmanager
async def open_stuck_dht_peer(node: MeshNode, release: trio.Event) -> AsyncIterator[None]:
    """Start a bare host in ``node``'s DHT routing table that takes each DHT request and
    answers none until ``release`` is set, as a peer frozen mid-exchange would; then it
    resets them (and every later one) at once."""
    host = new_mesh_host(NodeIdentity.generate().key_pair)

    async def hold(stream) -> None:
        await release.wait()
        try:
            await stream.reset()
        except StreamError:
            pass  # an escaping error would break the connection's later streams

    host.set_stream_handler(TProtocol(DHT_PROTOCOL), hold)
    async with host.run(listen_addrs=[multiaddr.Multiaddr(str(LOOPBACK))]):
        address = f"{host.get_addrs()[0]}/p2p/{host.get_id()}"
        await connect(node.host, parse_peer_addr(address))
        if not await node.dht.add_peer(host.get_id()):
            raise RuntimeError("the stuck peer did not enter the routing table")
        yield
