"""The consumer's cost of entry: a newcomer counts once its host answered a liveness probe.

In-process, over real py-libp2p hosts on loopback: a consumer node's ``Runtime`` and
``Consumer``, and bare hosts whose offers sit in its book. An honest newcomer serves the
lease and liveness protocols; a silent one (like ``cumulus_p2p.testing.spammer``) takes
lease proposals and answers nothing, and does not speak the liveness protocol.
"""

import itertools
import time
from contextlib import asynccontextmanager

import trio

from cumulus_p2p.dht.node import MeshConfig
from cumulus_p2p.identity import NodeIdentity
from cumulus_p2p.market import LeaseBook, LeaseServer, Offer, serve_leases
from cumulus_p2p.market.liveness import LivenessState
from cumulus_p2p.market.negotiation import LEASE_PROTOCOL
from cumulus_p2p.market.probing import serve_liveness
from cumulus_p2p.market.settlement import ReceiptDesk
from cumulus_p2p.node import consumer as consumer_module
from cumulus_p2p.node.consumer import Consumer, ConsumerOptions
from cumulus_p2p.node.datadir import DataDir
from cumulus_p2p.node.runtime import open_runtime
from cumulus_p2p.testing.hosts import connect, noise_hosts

MARKET = 400_000
OPTIONS = ConsumerOptions(command=("job.py",), max_price=1_000_000, match_timeout=20)


def offer_of(identity: NodeIdentity, price: int, now: float) -> Offer:
    host = identity.peer_id_text
    return Offer(host, "gpu0", "RTX 4090", 24_576, 100, 4, price, 0, "", now, now + 600, 1)


@asynccontextmanager
async def market(tmp_path, *, honest=(), silent=(), recorded=()):
    """A consumer whose book holds one offer from each host, priced as given.

    Yields ``(consumer, peer IDs by role, lease proposals each silent host received)``.
    """
    data = DataDir(tmp_path)
    config = MeshConfig(listen_addrs=("/ip4/127.0.0.1/tcp/0",))
    roles = (
        [("honest", p) for p in honest]
        + [("recorded", p) for p in recorded]
        + [("silent", p) for p in silent]
    )
    identities = [NodeIdentity.generate() for _ in roles]
    proposals: dict[str, int] = {}
    async with open_runtime(data.identity(), data, config) as runtime:
        consumer = Consumer(runtime, OPTIONS, ReceiptDesk(data.identity(), data.ledger()))
        now = runtime.clock()
        consumer.bid_body(runtime.mesh.next_nonce(), now + 60)
        async with noise_hosts(identities) as hosts:
            ids: dict[str, list[str]] = {"honest": [], "recorded": [], "silent": []}
            for (role, price), identity, host in zip(roles, identities, hosts, strict=True):
                offer = offer_of(identity, price, now)
                name = identity.peer_id_text
                ids[role].append(name)
                if role == "silent":
                    proposals[name] = 0
                    host.set_stream_handler(LEASE_PROTOCOL, ignoring(proposals, name))
                else:
                    book = LeaseBook(identity)
                    book.publish(offer)
                    endpoints = lambda: ["127.0.0.1:9"]  # noqa: E731 - never dialed here
                    serve_leases(host, LeaseServer(book, endpoints=endpoints))
                    serve_liveness(
                        host, identity, free_shares=lambda: 4,
                        next_nonce=itertools.count(1).__next__,
                    )  # fmt: skip
                if role == "recorded":
                    runtime.book.vouch(name)  # a report of its paid leases reached the node
                runtime.book.insert(offer, now=now)
                await connect(runtime.mesh.host, host)
            yield consumer, ids, proposals


def ignoring(proposals: dict[str, int], name: str):
    async def handle(stream) -> None:
        proposals[name] += 1
        await trio.sleep_forever()

    return handle


async def test_a_newcomer_with_an_honest_probe_is_leased_and_silent_cheaper_ones_are_not_tried(
    tmp_path,
):
    cheaper = [int(0.9 * MARKET)] * 3
    async with market(tmp_path, honest=[MARKET], silent=cheaper) as (consumer, ids, proposals):
        held = await consumer.lease(OPTIONS.match_timeout)
        now = time.time()
        assert held.proposal.host == ids["honest"][0]
        assert consumer.liveness.alive(ids["honest"][0], now=now)
        assert proposals == dict.fromkeys(ids["silent"], 0)


async def test_a_host_that_answers_no_probe_is_set_aside_for_the_backoff(tmp_path):
    async with market(tmp_path, honest=[MARKET], silent=[MARKET - 1]) as (consumer, ids, _):
        await consumer.lease(OPTIONS.match_timeout)
        now = time.time()
        (silent,) = ids["silent"]
        assert consumer.liveness.state(silent, now=now) is LivenessState.SILENT
        assert consumer.snapshot()["liveness"]["silent"] == 1


async def test_a_host_that_answers_no_probe_never_takes_the_newcomer_slot(tmp_path, monkeypatch):
    monkeypatch.setattr(consumer_module, "NEWCOMER_SHARE", 1.0)  # every match tries newcomers
    silent = [int(0.9 * MARKET)] * 2
    async with market(tmp_path, recorded=[MARKET], silent=silent) as (consumer, ids, proposals):
        held = await consumer.lease(OPTIONS.match_timeout)
        assert held.proposal.host == ids["recorded"][0]
        assert proposals == dict.fromkeys(ids["silent"], 0)


async def test_a_probed_newcomer_takes_the_newcomer_share_ahead_of_a_host_with_a_record(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(consumer_module, "NEWCOMER_SHARE", 1.0)
    silent = [int(0.9 * MARKET)] * 2
    async with market(tmp_path, honest=[MARKET], recorded=[MARKET], silent=silent) as (
        consumer,
        ids,
        proposals,
    ):
        held = await consumer.lease(OPTIONS.match_timeout)
        assert held.proposal.host == ids["honest"][0]
        assert proposals == dict.fromkeys(ids["silent"], 0)
