"""The mesh with real py-libp2p hosts on 127.0.0.1: gossip, DHT, expiry, bad input, relay.

Every test starts its own nodes through ``cumulus_p2p.testing.mesh`` and short
heartbeats and TTLs (``fast_config``), and waits with trio timeouts, never sleeps
on a guess.
"""

from __future__ import annotations

import logging
import time

import multiaddr
import pytest
import trio
from libp2p import new_host
from libp2p.custom_types import TProtocol
from libp2p.host.exceptions import StreamFailure
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.network.stream.exceptions import StreamEOF, StreamReset
from libp2p.records.validator import BlankValidator, NamespacedValidator
from libp2p.security.insecure.transport import PLAINTEXT_PROTOCOL_ID, InsecureTransport
from libp2p.tools.anyio_service import background_trio_service
from libp2p.utils.varint import encode_uvarint

from cumulus_p2p._errors import PeerUnreachableError
from cumulus_p2p.dht.gossip import MARKET_TOPIC, GossipConfig
from cumulus_p2p.dht.host import LOOPBACK, connect, new_mesh_host, parse_peer_addr, yamux_only
from cumulus_p2p.dht.node import _leave_quietly, mesh_validator, open_mesh_node
from cumulus_p2p.dht.records import SHEET_KIND, encode_sheet_body, offers_key
from cumulus_p2p.envelope import Envelope, seal
from cumulus_p2p.identity import NodeIdentity
from cumulus_p2p.testing.mesh import (
    TEST_KINDS,
    Mesh,
    fast_config,
    open_mesh,
    open_rogue_peer,
    open_stuck_dht_peer,
    wait_for,
)

# Starts meshes of real libp2p hosts: scripts/test --fast skips it. The tests that bound
# how long gossip, expiry or a rejection may take are marked timing: scripts/test runs
# them alone, after the parallel workers, whose load would stretch those bounds.
pytestmark = pytest.mark.slow

N = 10
OFFER = "market/offer"

# py-libp2p logs every closed DHT stream as a warning; keep test output readable.
logging.getLogger("libp2p").setLevel(logging.ERROR)


def has_offer_from(mesh: Mesh, index: int, author: bytes) -> bool:
    return author in mesh.books[index].authors(time.time(), kind=OFFER)


@pytest.mark.timing  # every book within 2 s
async def test_offer_reaches_every_node_within_two_seconds() -> None:
    async with open_mesh(N) as mesh:
        env = await mesh.nodes[N // 2].announce("gpu0", OFFER, b"rtx4090 x1")
        took = await wait_for(
            lambda: all(env.digest in book for book in mesh.books),
            timeout=2.0,
            what="offer in every book",
        )
        assert took < 2.0
        assert all(mesh.received(i)[0].source == "gossip" for i in range(N))


async def test_an_announcement_built_per_seal_repeats_each_envelopes_nonce_and_expiry():
    # Market messages carry their envelope's nonce and expiry in the body, so a
    # re-announcement must rebuild the body, not re-sign the old one.
    async with open_mesh(2, config=fast_config(announce_interval=0.3, offer_ttl=2.0)) as mesh:
        built: list[tuple[int, float]] = []

        def body(nonce: int, expires_at: float) -> bytes:
            built.append((nonce, expires_at))
            return b"offer %d %r" % (nonce, expires_at)

        await mesh.nodes[0].announce("gpu0", OFFER, body)
        await wait_for(lambda: len(mesh.received(1)) >= 2, timeout=5.0, what="a re-announce")
    for msg in mesh.received(1)[:2]:
        env = msg.envelope
        assert env.body == b"offer %d %r" % (env.nonce, env.expires_at)
        assert (env.nonce, env.expires_at) in built


async def test_offers_are_gossiped_each_heartbeat_while_a_stuck_dht_peer_holds_the_sheet():
    async with open_mesh(2, config=fast_config(announce_interval=0.3, offer_ttl=2.0)) as mesh:
        release = trio.Event()
        async with open_stuck_dht_peer(mesh.nodes[0], release):
            try:
                await mesh.nodes[0].announce("gpu0", OFFER, b"rtx4090 x1")
                # Storing the sheet waits on the stuck peer (py-libp2p: 10 s per query).
                await wait_for(
                    lambda: len(mesh.received(1)) >= 4, timeout=5.0, what="three re-announcements"
                )
            finally:
                release.set()


@pytest.mark.timing  # gossip history rolls over in 3 heartbeats
async def test_late_joiner_reads_every_live_offer_from_the_dht() -> None:
    # Re-announce rarely and keep little gossip history, so the joiner cannot get the
    # offers from fresh or replayed gossip: only the DHT has them.
    config = fast_config(
        announce_interval=20.0,
        offer_ttl=60.0,
        gossip=GossipConfig(heartbeat_interval=0.5, history=3),
    )
    async with open_mesh(N, config=config) as mesh:
        hosts = [0, 3, 7]
        for i in hosts:
            await mesh.nodes[i].announce("gpu", OFFER, b"offer from %d" % i)
        authors = {mesh.nodes[i].identity.public_key for i in hosts}
        await wait_for(
            lambda: all(mesh.books[i].authors(time.time()) >= authors for i in range(N)),
            timeout=5.0,
            what="offers gossiped",
        )
        # Let the DHT puts land and the gossip message cache (3 heartbeats) roll over.
        await wait_for(
            lambda: (
                all(mesh.nodes[i].statistics().announcements == 1 for i in hosts)
                and all(mesh.nodes[i].dht.get_value_store_size() >= 1 for i in range(N))
            ),
            timeout=5.0,
            what="offer sheets stored",
        )
        # Routing tables fill and gossip caches roll over on the heartbeat; what the joiner
        # needs of the routing tables has no single condition to wait on (kept from before).
        await trio.sleep(2.0)

        joiner = await mesh.add_node(
            fast_config(
                bootstrap=(str(mesh.nodes[5].addrs[0]),),
                announce_interval=20.0,
                offer_ttl=60.0,
                gossip=GossipConfig(heartbeat_interval=0.5, history=3),
            )
        )
        j = len(mesh.nodes) - 1
        await wait_for(
            lambda: mesh.books[j].authors(time.time(), kind=OFFER) == authors,
            timeout=3.0,
            what="joiner has every offer",
        )
        assert {m.source for m in mesh.received(j)} == {"dht"}
        assert joiner.statistics().dht_offers_delivered == len(hosts)
        # Asking again reads the same book from the DHT but delivers nothing twice.
        found = await joiner.sync_offers()
        assert {offers[0].author for offers in found.values()} == authors
        assert len(mesh.received(j)) == len(hosts)


@pytest.mark.timing  # gone within the TTL
async def test_offers_of_a_departed_host_expire_everywhere_within_the_ttl() -> None:
    config = fast_config(announce_interval=0.5, offer_ttl=2.0)
    async with open_mesh(N, config=config) as mesh:
        leaver = mesh.nodes[4]
        author = leaver.identity.public_key
        await leaver.announce("gpu", OFFER, b"going away soon")
        await wait_for(
            lambda: all(has_offer_from(mesh, i, author) for i in range(N)),
            timeout=3.0,
            what="offer everywhere",
        )
        # Past the first offer's expiry: it is renewed everywhere, not left to lapse.
        first = min(m.envelope.expires_at for m in mesh.received(0))
        await wait_for(lambda: time.time() > first + 0.5, timeout=5.0, what="first expiry")
        assert all(has_offer_from(mesh, i, author) for i in range(N))

        stopped_at = time.time()
        await mesh.stop_node(4)
        others = [i for i in range(N) if i != 4]
        await wait_for(
            lambda: not any(has_offer_from(mesh, i, author) for i in others),
            timeout=config.offer_ttl + 1.0,
            what="departed host's offers gone",
        )
        assert time.time() - stopped_at <= config.offer_ttl + 0.5
        # The DHT no longer yields them either.
        found = await mesh.nodes[0].sync_offers()
        assert leaver.peer_id not in found


def stored_sheet_nonce(node, author) -> int | None:
    """The nonce of ``author``'s offer sheet in ``node``'s DHT store (None: none there)."""
    record = node.dht.value_store.get(offers_key(author.peer_id).encode())
    return None if record is None else Envelope.from_bytes(record.value).nonce


def offer_nonce(mesh: Mesh, index: int) -> int:
    """The newest offer nonce node ``index`` received by gossip (0: none yet)."""
    return max((m.envelope.nonce for m in mesh.received(index)), default=0)


async def announce_and_wait_for_the_sheet(mesh: Mesh, body: bytes) -> int:
    """Node 0 announces ``body``; returns the nonce of its sheet once node 1 stores it."""
    host = mesh.nodes[0]
    await host.announce("gpu", OFFER, body)
    await wait_for(
        lambda: stored_sheet_nonce(mesh.nodes[1], host) is not None,
        timeout=5.0,
        what="the sheet stored at the peer",
    )
    return stored_sheet_nonce(mesh.nodes[1], host)


async def test_an_unchanged_offer_sheet_is_stored_again_only_as_it_ages() -> None:
    # A heartbeat every 0.2 s, envelopes living 12 s: a stored sheet lives on for 5.8 s.
    config = fast_config(announce_interval=0.2, offer_ttl=12.0)
    async with open_mesh(2, config=config) as mesh:
        host = mesh.nodes[0]
        first = await announce_and_wait_for_the_sheet(mesh, b"unchanged")
        # Eight heartbeats gossip the offer afresh; the stored sheet is still the first.
        await wait_for(lambda: offer_nonce(mesh, 1) > first + 8, timeout=5.0, what="heartbeats")
        assert stored_sheet_nonce(mesh.nodes[1], host) == first
        # It is stored again before it has lived half its life.
        await wait_for(
            lambda: stored_sheet_nonce(mesh.nodes[1], host) != first,
            timeout=config.offer_ttl / 2,
            what="the sheet stored again",
        )


async def test_a_changed_offer_is_stored_in_the_sheet_at_the_next_heartbeat() -> None:
    config = fast_config(announce_interval=0.2, offer_ttl=10.0)
    async with open_mesh(2, config=config) as mesh:
        host = mesh.nodes[0]
        first = await announce_and_wait_for_the_sheet(mesh, b"first")
        changed = await host.announce("gpu", OFFER, b"second")
        await wait_for(
            lambda: (stored_sheet_nonce(mesh.nodes[1], host) or 0) > changed.nonce,
            timeout=2.0,
            what="the changed sheet stored",
        )
        assert stored_sheet_nonce(mesh.nodes[1], host) > first
        found = await mesh.nodes[1].sync_offers()
        assert [e.body for e in found[host.peer_id]] == [b"second"]


# --- bad input: each kind of bad message, sent by a peer that does not validate ---------


async def _assert_dropped_everywhere(mesh: Mesh, payload: bytes, reason: str) -> None:
    targets = mesh.nodes
    async with open_rogue_peer(targets) as rogue:
        before = [len(mesh.received(i)) for i in range(N)]
        await rogue.publish_raw(payload)
        await wait_for(
            lambda: all(n.statistics().rejected.get(reason, 0) >= 1 for n in targets),
            timeout=3.0,
            what=f"every node rejected the payload as {reason}",
        )
        # Nothing from it ever reaches a book; let any stray delivery surface first.
        await trio.sleep(0.3)
        assert [len(mesh.received(i)) for i in range(N)] == before
        for node in targets:
            score = node.router.scorer.score(rogue.peer_id, [MARKET_TOPIC])
            assert score < 0, "the sender of an invalid message loses gossip score"


@pytest.mark.timing  # rejected everywhere within 3 s
async def test_forged_offer_is_dropped_by_every_node() -> None:
    async with open_mesh(N) as mesh:
        victim = NodeIdentity.generate()
        good = seal(victim, OFFER, b"cheap gpu", now=time.time(), ttl=30.0, nonce=1)
        forged = Envelope(
            good.kind, good.author, b"free gpu", good.expires_at, good.nonce, good.signature
        )
        await _assert_dropped_everywhere(mesh, forged.to_bytes(), "BAD_SIGNATURE")


@pytest.mark.timing  # delivered within 3 s
async def test_gossip_drained_before_a_node_stops_still_arrives() -> None:
    async with open_mesh(3) as mesh:
        envs = [mesh.nodes[2].seal("market/bid", f"last words {i}".encode()) for i in range(5)]
        for env in envs:
            await mesh.nodes[2].publish(env)
        await mesh.nodes[2].drain()
        await mesh.stop_node(2)  # what a consumer does once its reports are out
        await wait_for(
            lambda: all(env.digest in mesh.books[0] for env in envs),
            timeout=3.0,
            what="every message published before the stop",
        )


async def test_a_leaving_node_hangs_up_and_resets_every_new_gossip_stream() -> None:
    # The last step before pubsub stops: a peer that redials then could deliver a
    # message into pubsub's closing nursery, which py-libp2p raises out of the host.
    async with open_mesh(2) as mesh:
        leaving, peer = mesh.nodes
        await _leave_quietly(leaving)
        assert leaving.host.get_connected_peers() == []
        await peer.connect(leaving.addrs[0])
        # The protocol is still there to negotiate (a handler removed while a peer
        # negotiates raises KeyError out of py-libp2p's host), but the stream is reset:
        # during the negotiation's last reply, or at the first read.
        with trio.fail_after(5), pytest.raises((StreamFailure, StreamReset, StreamEOF)) as died:
            stream = await peer.host.new_stream(leaving.peer_id, list(peer.pubsub.protocols))
            await stream.read(1)
        assert "protocols not supported" not in str(died.value.__cause__)


@pytest.mark.timing  # rejected everywhere within 3 s
async def test_replayed_offer_is_dropped_by_every_node() -> None:
    async with open_mesh(N) as mesh:
        # A long TTL, so the copy is still live (a replay, not merely expired) when resent.
        env = mesh.nodes[2].seal("market/bid", b"once only", ttl=60.0)
        await mesh.nodes[2].publish(env)
        await wait_for(
            lambda: all(env.digest in b for b in mesh.books), timeout=3.0, what="original"
        )
        await _assert_dropped_everywhere(mesh, env.to_bytes(), "REPLAYED")
        for i in range(N):
            assert sum(m.envelope.digest == env.digest for m in mesh.received(i)) == 1


@pytest.mark.timing  # rejected everywhere within 3 s
async def test_expired_offer_is_dropped_by_every_node() -> None:
    async with open_mesh(N) as mesh:
        author = NodeIdentity.generate()
        stale = seal(author, OFFER, b"old", now=time.time() - 60.0, ttl=30.0, nonce=1)
        await _assert_dropped_everywhere(mesh, stale.to_bytes(), "EXPIRED")


@pytest.mark.timing  # rejected everywhere within 3 s
async def test_oversized_offer_is_dropped_by_every_node() -> None:
    async with open_mesh(N) as mesh:
        author = NodeIdentity.generate()
        huge = seal(author, OFFER, b"x" * 100_000, now=time.time(), ttl=30.0, nonce=1)
        await _assert_dropped_everywhere(mesh, huge.to_bytes(), "OVERSIZED")


@pytest.mark.timing  # rejected everywhere within 3 s
async def test_malformed_payload_is_dropped_by_every_node() -> None:
    async with open_mesh(N) as mesh:
        await _assert_dropped_everywhere(mesh, b"\x96not an envelope", "MALFORMED")


@pytest.mark.slow  # a mesh of three
async def test_a_peers_undecodable_pubsub_rpc_ends_its_stream_not_the_node() -> None:
    # py-libp2p alone let protobuf's DecodeError out of the host: the node stopped.
    async with open_mesh(3) as mesh:
        target, sender, author = mesh.nodes
        stream = await sender.host.new_stream(target.peer_id, list(sender.pubsub.protocols))
        junk = b"\xff\xfe not a protobuf RPC \x00\x01"
        await stream.write(encode_uvarint(len(junk)) + junk)
        with trio.fail_after(5), pytest.raises((StreamReset, StreamEOF)):
            await stream.read(1)
        env = author.seal("market/bid", b"after the junk", ttl=60.0)
        await author.publish(env)
        await wait_for(lambda: env.digest in mesh.books[0], timeout=5.0, what="gossip after junk")


# --- transport security and NAT traversal -----------------------------------------------


async def test_plaintext_peer_cannot_connect() -> None:
    async with open_mesh(1) as mesh:
        identity = NodeIdentity.generate()
        plain = new_host(
            key_pair=identity.key_pair,
            sec_opt={PLAINTEXT_PROTOCOL_ID: InsecureTransport(identity.key_pair)},
            muxer_opt=yamux_only(),
        )
        async with plain.run(listen_addrs=[LOOPBACK]):
            with pytest.raises(PeerUnreachableError):
                await connect(plain, parse_peer_addr(mesh.nodes[0].addrs[0]), timeout=5.0)
        assert mesh.nodes[0].statistics().connected_peers == 0


ECHO = TProtocol("/cumulus/test-echo/1.0.0")


async def _echo(stream) -> None:  # type: ignore[no-untyped-def]
    # Catch stream errors here: one escaping a handler breaks later streams.
    try:
        data = await stream.read(1024)
        await stream.write(b"echo:" + data)
        await stream.close()
    except Exception:  # noqa: BLE001
        await stream.reset()


async def test_node_that_cannot_be_dialed_is_reached_through_a_relay() -> None:
    async with open_mesh(2) as mesh:
        relay, dialer = mesh.nodes
        assert relay.nat is not None and relay.nat.is_relay
        hidden = await mesh.add_node(fast_config(listen_addrs=(), relays=(str(relay.addrs[0]),)))
        assert hidden.host.get_addrs() == []  # nothing to dial directly
        assert hidden.nat is not None
        # The reservation is made in the background after the node starts: wait for it.
        await wait_for(
            lambda: relay.peer_id in hidden.nat.transport.discovery.get_relays(),
            timeout=10.0,
            what="relay reservation",
        )
        hidden.host.set_stream_handler(ECHO, _echo)

        with trio.fail_after(10):
            await dialer.connect_via_relay(relay.addrs[0], hidden.peer_id)
            stream = await dialer.host.new_stream(hidden.peer_id, [ECHO])
            await stream.write(b"hello")
            assert await stream.read(1024) == b"echo:hello"
            await stream.close()
        conns = dialer.host.get_network().get_connections(hidden.peer_id)
        assert any("p2p-circuit" in str(a) for c in conns for a in _addrs(c))

        # The relayed peer takes part in the market too.
        env = await dialer.announce("gpu", OFFER, b"reachable from behind NAT")
        await wait_for(
            lambda: env.digest in mesh.books[2], timeout=5.0, what="offer at hidden node"
        )


def _addrs(conn: object) -> list[multiaddr.Multiaddr]:
    muxed = getattr(conn, "muxed_conn", None)
    raw = getattr(muxed, "secured_conn", None)
    get = getattr(raw, "get_transport_addresses", None)
    try:
        return list(get()) if get is not None else []
    except Exception:  # noqa: BLE001 - diagnostic only
        return []


async def test_autonat_finds_a_listening_node_publicly_reachable() -> None:
    async with open_mesh(5) as mesh:
        node = mesh.nodes[0]
        assert node.nat is not None
        servers = [n.peer_id for n in mesh.nodes[1:]]
        with trio.fail_after(10):
            assert await node.nat.check_reachability(servers) == "public"
        assert node.statistics().reachability == "public"


async def test_forged_dht_record_is_stored_by_no_node() -> None:
    async with open_mesh(N) as mesh:
        victim = mesh.nodes[1]
        key = offers_key(victim.peer_id)
        rogue = NodeIdentity.generate()
        host = new_mesh_host(rogue.key_pair)
        # The attacker's DHT accepts anything under /cumulus/ and pushes it to peers.
        permissive = NamespacedValidator({"cumulus": BlankValidator()})
        dht = KadDHT(host, DHTMode.SERVER, validator=permissive, validator_changed=True)
        forged = seal(rogue, SHEET_KIND, encode_sheet_body([]), now=time.time(), ttl=30, nonce=1)
        async with host.run(listen_addrs=[LOOPBACK]), background_trio_service(dht):
            for node in mesh.nodes:
                await connect(host, parse_peer_addr(node.addrs[0]))
                await dht.add_peer(node.peer_id)
            await dht.put_value(key, forged.to_bytes())
            # Control: the same peer's own, valid sheet is stored, so the PUTs do land.
            own_key = offers_key(host.get_id())
            own = seal(rogue, SHEET_KIND, encode_sheet_body([]), now=time.time(), ttl=30, nonce=2)
            await dht.put_value(own_key, own.to_bytes())
        assert all(n.dht.value_store.get(key.encode()) is None for n in mesh.nodes)
        assert any(n.dht.value_store.get(own_key.encode()) is not None for n in mesh.nodes)


async def test_nodes_with_mdns_find_each_other_without_a_bootstrap_peer() -> None:
    config = fast_config(enable_mdns=True, maintenance_interval=0.2)
    async with (
        open_mesh_node(NodeIdentity.generate(), mesh_validator(TEST_KINDS), config) as a,
        open_mesh_node(NodeIdentity.generate(), mesh_validator(TEST_KINDS), config) as b,
    ):
        await wait_for(
            lambda: b.host.get_id() in a.host.get_connected_peers(),
            timeout=15,
            what="the two nodes to find each other by mDNS",
        )
