"""Scenario (e): what the market costs each node as the network grows to 10,000 nodes.

Every node holds the whole order book and validates every order gossiped to it, so the
cost per node grows with the network. For each size this measures, on this machine and
with the real code, what one node pays: a node's book filled through the real receive
path (``MarketIntake``: envelope decode, ed25519 check, replay memory, insert) with
signed offers from half the nodes and bids from a quarter; the time per message on that
path; the matcher's time to rank a bid against the full book; the book's memory. The
gossip load then follows from how often orders are re-sent:

- a host re-announces its offer every half hour (``OFFER_TTL_S / 2``) and whenever a
  lease starts or ends (``LEASE_CHANGES_PER_HOST_HOUR``, ASSUMED from the pooling
  scenario's moderate load);
- a consumer re-sends its bid every ``BID_REFRESH_S`` while it waits (ASSUMED);
- GossipSub delivers each message once, plus up to ``GOSSIP_DEGREE - 1`` duplicates
  that cost bandwidth but no validation (its seen-cache drops them).

Nothing here is simulated in time: these are measured costs times assumed rates.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
import tracemalloc

from ..identity import NodeIdentity
from ..market.book import OrderBook
from ..market.intake import Admitted, MarketIntake
from ..market.matcher import rank_offers
from ..market.messages import Bid, Offer, PriorityClass, seal_message
from .market import EPOCH, OFFER_TTL_S
from .world import GOSSIP_DEGREE, GPU_MIX, REGIONS, SHARES_PER_GPU, pick

LEASE_CHANGES_PER_HOST_HOUR = 2.0
BID_REFRESH_S = 300.0
#: Signing keys are expensive to make by the thousand; nodes share a pool of them for
#: the orders' signatures (each order still carries and passes a real signature).
KEY_POOL = 64


def run(seed: int, *, quick: bool) -> dict:
    """The per-node cost at each network size."""
    sizes = (100, 1000) if quick else (100, 1000, 3000, 10_000)
    rows = [measure(nodes, random.Random(seed)) for nodes in sizes]
    return {
        "scenario": "scale",
        "seed": seed,
        "quick": quick,
        "assumed": {
            "offer_refresh_s": OFFER_TTL_S / 2,
            "lease_changes_per_host_hour": LEASE_CHANGES_PER_HOST_HOUR,
            "bid_refresh_s": BID_REFRESH_S,
            "gossip_degree": GOSSIP_DEGREE,
        },
        "rows": rows,
    }


def measure(nodes: int, rng: random.Random) -> dict:
    """One node's costs in a network of ``nodes`` (half hosts, a quarter bidding)."""
    hosts, bidders = nodes // 2, nodes // 4
    raws = _signed_orders(hosts, bidders, rng)
    _fill(raws)  # warm up
    gc.collect()
    started = time.perf_counter()
    book, admitted = _fill(raws)
    intake_s = (time.perf_counter() - started) / len(raws)
    tracemalloc.start()
    _fill(raws)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    bids = [b.order for b in book.bids()][:200]
    rank_ms = []
    for bid in bids:
        t0 = time.perf_counter()
        rank_offers(book, bid, limit=8)
        rank_ms.append((time.perf_counter() - t0) * 1e3)
    per_hour = hosts * (3600 / (OFFER_TTL_S / 2) + LEASE_CHANGES_PER_HOST_HOUR)
    per_hour += bidders * 3600 / BID_REFRESH_S
    messages_per_s = per_hour / 3600
    size = statistics.fmean(len(raw) for raw in raws)
    return {
        "nodes": nodes,
        "orders_in_book": admitted,
        "intake_us_per_message": round(intake_s * 1e6, 1),
        "rank_ms_p50": round(statistics.median(rank_ms), 3),
        "book_memory_mb": round(peak / 1e6, 2),
        "message_bytes": round(size),
        "messages_per_s": round(messages_per_s, 2),
        "cpu_share_of_one_core": round(messages_per_s * intake_s, 5),
        "gossip_kb_per_s": round(messages_per_s * size * GOSSIP_DEGREE / 1e3, 2),
    }


def _fill(raws: list[bytes]) -> tuple[OrderBook, int]:
    book = OrderBook()
    intake = MarketIntake(book)
    admitted = sum(isinstance(intake.receive(raw, now=EPOCH), Admitted) for raw in raws)
    return book, admitted


def _signed_orders(hosts: int, bidders: int, rng: random.Random) -> list[bytes]:
    keys = [NodeIdentity.from_seed(rng.randbytes(32)) for _ in range(KEY_POOL)]
    raws = []
    for i in range(hosts):
        key, model = keys[i % KEY_POOL], pick(rng, GPU_MIX)
        price = round(model.price_per_gpu_hour / SHARES_PER_GPU * 1e6 * rng.uniform(0.8, 1.2))
        offer = Offer(
            key.peer_id.to_base58(),
            f"gpu{i}",
            model.name,
            model.vram_mib,
            model.perf_units,
            SHARES_PER_GPU,
            price,
            0,
            rng.choice(REGIONS),
            EPOCH,
            EPOCH + OFFER_TTL_S,
            i + 1,
        )
        raws.append(seal_message(key, offer, now=EPOCH).to_bytes())
    for i in range(bidders):
        key = keys[i % KEY_POOL]
        bid = Bid(
            key.peer_id.to_base58(),
            f"bid{i}",
            24_576,
            (),
            0,
            rng.randint(1, 4),
            10**9,
            PriorityClass.ON_DEMAND,
            3600,
            EPOCH,
            EPOCH + BID_REFRESH_S,
            hosts + i + 1,
        )
        raws.append(seal_message(key, bid, now=EPOCH).to_bytes())
    return raws
