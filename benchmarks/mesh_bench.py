"""Mesh benchmark: gossip propagation across real py-libp2p nodes, and validation rate.

Prints one JSON object and writes it to ``benchmarks/results/mesh.json``:

- ``nodes``: real mesh nodes on 127.0.0.1, one process (Noise, yamux, gossipsub).
- ``propagation_p50_ms`` / ``propagation_p99_ms``: from ``publish`` on one node until
  the *last* node's consumer has the envelope (validated), over ``publishes`` samples.
- ``validations_per_s``: ``EnvelopeValidator.validate`` of distinct signed envelopes
  (decode, size, kind, expiry, ed25519 signature, replay memory) on one core.

Usage: ``python benchmarks/mesh_bench.py [--quick] [--nodes N] [--publishes K]``.
``--quick`` takes fewer samples and finishes well within a minute.
"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path

import trio

from cumulus_p2p.dht.node import mesh_validator
from cumulus_p2p.envelope import seal
from cumulus_p2p.identity import NodeIdentity
from cumulus_p2p.testing.benchargs import per_second, quick_parser, save_result
from cumulus_p2p.testing.mesh import fast_config, open_mesh, wait_for

RESULTS = Path(__file__).parent / "results" / "mesh.json"


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


async def measure_propagation(nodes: int, publishes: int) -> list[float]:
    """Publish ``publishes`` bids from node 0; return ms until the last node has each."""
    # Announcements off the hot path: a long re-announce interval keeps the
    # measurement about one message crossing the mesh.
    config = fast_config(announce_interval=30.0, offer_ttl=120.0)
    samples: list[float] = []
    async with open_mesh(nodes, config=config) as mesh:
        # One warm-up message so every stream is open before timing.
        publisher = mesh.nodes[0]
        for k in range(publishes + 1):
            env = publisher.seal("market/bid", b"bid %d" % k, ttl=60.0)
            start = trio.current_time()
            await publisher.publish(env)
            await wait_for(
                lambda env=env: all(mesh.arrival(i, env.digest) is not None for i in range(nodes)),
                timeout=10.0,
                poll=0.001,
                what="every node has the bid",
            )
            last = max(mesh.arrival(i, env.digest) or start for i in range(nodes))
            if k:
                samples.append((last - start) * 1000.0)
            await trio.sleep(0.05)
    return samples


def measure_validations(count: int) -> float:
    """Return ``EnvelopeValidator.validate`` calls per second on distinct envelopes."""
    now = time.time()
    authors = [NodeIdentity.generate() for _ in range(16)]
    raws = [
        seal(
            authors[i % 16], "market/offer", b"offer %d" % i, now=now, ttl=600.0, nonce=i
        ).to_bytes()
        for i in range(count)
    ]
    validator = mesh_validator(["market/offer"])
    return per_second(lambda raw: validator.validate(raw, now=now), raws)


def main() -> None:
    parser = quick_parser(__doc__.splitlines()[0], "fewer samples (< 60 s)")
    parser.add_argument("--nodes", type=int, default=20)
    parser.add_argument("--publishes", type=int, default=None)
    args = parser.parse_args()
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    publishes = args.publishes or (20 if args.quick else 100)
    samples = trio.run(measure_propagation, args.nodes, publishes)
    result = {
        "nodes": args.nodes,
        "publishes": len(samples),
        "propagation_p50_ms": round(statistics.median(samples), 2),
        "propagation_p99_ms": round(percentile(samples, 0.99), 2),
        "validations_per_s": round(measure_validations(2000 if args.quick else 10000)),
        "quick": args.quick,
    }
    save_result(RESULTS, result)


if __name__ == "__main__":
    main()
