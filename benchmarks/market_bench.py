"""Order book benchmark: insert rate and match latency with many resting orders.

Prints one JSON object and writes it to ``benchmarks/results/market.json``:

- ``resting_orders``: orders in the book while matching (offers and bids).
- ``inserts_per_s``: ``OrderBook.insert`` of already-decoded orders into an empty book.
- ``match_p50_ms`` / ``match_p99_ms``: ``OrderBook.match_bid`` latency for incoming bids
  against the full book.
- ``intake_per_s``: the whole receive path for signed offers (envelope decode,
  signature check, replay memory, ``open_message``, insert): the figure a gossip
  handler sees, bounded by ed25519 verification.

Usage: ``python benchmarks/market_bench.py [--quick] [--orders N] [--seed S]``.
``--quick`` takes fewer samples and finishes well within a minute.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from pathlib import Path

from cumulus_p2p.identity import NodeIdentity
from cumulus_p2p.market import Bid, MarketIntake, Offer, OrderBook, PriorityClass, seal_message
from cumulus_p2p.testing.benchargs import per_second, quick_parser, save_result

NOW = 1_700_000_000.0
MODELS = [
    ("RTX 3090", 24576, 70),
    ("RTX 4090", 24576, 100),
    ("A100", 40960, 150),
    ("A100", 81920, 160),
    ("H100", 81920, 300),
    ("L40S", 46068, 120),
    ("RTX 4080", 16376, 75),
    ("A6000", 49140, 90),
]
RESULTS = Path(__file__).parent / "results" / "market.json"


def make_orders(n: int, rng: random.Random) -> list[Offer | Bid]:
    """``n`` orders: 80% offers spread over the models, 20% resting bids below the asks."""
    orders: list[Offer | Bid] = []
    for i in range(n):
        model, vram, perf = rng.choice(MODELS)
        created = NOW - rng.uniform(0, 3600)
        if i % 5:
            orders.append(
                Offer(
                    f"host{i}",
                    "gpu0",
                    model,
                    vram,
                    perf + rng.randint(-10, 10),
                    rng.randint(1, 8),
                    rng.randint(500, 5000),
                    rng.choice([0, 60, 600]),
                    "eu",
                    created,
                    NOW + 3600,
                    i,
                )
            )
        else:
            shares, price = rng.randint(1, 4), rng.randint(100, 499)
            orders.append(bid(f"consumer{i}", vram, (model,), shares, price, created, i))
    return orders


def incoming_bids(n: int, rng: random.Random) -> list[Bid]:
    """Bids that cross the book: some name a model, some take any model above a VRAM floor."""
    bids = []
    for i in range(n):
        model, vram, _ = rng.choice(MODELS)
        models = (model,) if i % 2 else ()
        shares, price = rng.randint(1, 16), rng.randint(600, 5000)
        floor = vram if models else 24576
        bids.append(bid(f"buyer{i}", floor, models, shares, price, NOW, i, ttl=600))
    return bids


def bid(
    buyer: str,
    min_vram: int,
    models: tuple,
    shares: int,
    max_price: int,
    created: float,
    nonce: int,
    *,
    ttl: float = 3600,
) -> Bid:
    """An on-demand bid for an hour, made at ``created`` and open for ``ttl`` seconds
    from ``NOW``."""
    return Bid(
        buyer,
        "b",
        min_vram,
        models,
        0,
        shares,
        max_price,
        PriorityClass.ON_DEMAND,
        3600,
        created,
        NOW + ttl,
        nonce,
    )


def percentile(samples: list[float], q: float) -> float:
    """The q-th percentile (0..100) by nearest rank."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def bench_intake(n: int) -> float:
    """Signed offers per second through the full receive path."""
    hosts = [NodeIdentity.generate() for _ in range(32)]
    raws = []
    for i in range(n):
        host = hosts[i % len(hosts)]
        offer = Offer(
            host.peer_id.to_base58(),
            f"gpu{i}",
            "RTX 4090",
            24576,
            100,
            4,
            1000,
            0,
            "eu",
            NOW,
            NOW + 600,
            i,
        )
        raws.append(seal_message(host, offer, now=NOW).to_bytes())
    intake = MarketIntake(OrderBook())
    return per_second(lambda raw: intake.receive(raw, now=NOW), raws)


def main() -> None:
    parser = quick_parser(__doc__.splitlines()[0], "fewer samples (< 60 s)")
    parser.add_argument("--orders", type=int, default=100_000, help="resting orders")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    match_samples = 1_000 if args.quick else 10_000
    intake_samples = 2_000 if args.quick else 10_000

    orders = make_orders(args.orders, rng)
    book = OrderBook()
    gc.collect()
    start = time.perf_counter()
    for order in orders:
        book.insert(order, now=NOW)
    insert_s = time.perf_counter() - start
    stats = book.statistics()
    resting = stats.offers + stats.bids

    latencies = []
    for bid in incoming_bids(match_samples, rng):
        t0 = time.perf_counter()
        book.match_bid(bid, now=NOW)
        latencies.append((time.perf_counter() - t0) * 1000)

    result = {
        "resting_orders": resting,
        "inserts_per_s": round(len(orders) / insert_s),
        "match_p50_ms": round(statistics.median(latencies), 4),
        "match_p99_ms": round(percentile(latencies, 99), 4),
        "match_samples": len(latencies),
        "intake_per_s": round(bench_intake(intake_samples)),
        "quick": args.quick,
    }
    save_result(RESULTS, result)


if __name__ == "__main__":
    main()
