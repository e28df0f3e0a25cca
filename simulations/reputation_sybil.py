"""Simulate a population of hosts and consumers, plus Sybil attackers, against the real
reputation core, and print a ranking table and a JSON summary.

Population (deterministic for a given ``--seed``):

- honest hosts that serve every lease; flaky hosts that vanish from some leases;
- honest consumers, some of which this node has transacted with (pre-trusted);
- a Sybil ring: one fresh host and ``--sybils`` fresh identities that lease from it,
  countersign its receipts and report glowing heartbeats (all signatures real);
- a smear crowd: ``--sybils`` fresh identities that really lease from the best honest
  host and then claim it vanished.

Every lease, receipt and report is signed with real ed25519 keys and goes through
``Reputation.receive`` as wire bytes. Run:

    .venv/bin/python simulations/reputation_sybil.py [--seed 1] [--sybils 20]
"""

from __future__ import annotations

import argparse
import json
import random
import time

from rich.console import Console
from rich.table import Table

from cumulus_p2p.identity import NodeIdentity
from cumulus_p2p.reputation import Accepted, HeartbeatObservation, Reputation
from cumulus_p2p.reputation.testing import Minter, peer

DAY = 86_400.0
NOW = 1_700_000_000.0


def build_world(rng: random.Random, args: argparse.Namespace) -> dict:
    """Create identities; flaky hosts get a per-lease drop probability."""
    hosts = {f"honest-{i}": (NodeIdentity.generate(), 0.0) for i in range(args.honest)}
    hosts |= {f"flaky-{i}": (NodeIdentity.generate(), rng.uniform(0.2, 0.5))
              for i in range(args.flaky)}
    consumers = [NodeIdentity.generate() for _ in range(args.consumers)]
    return {"hosts": hosts, "consumers": consumers, "me": NodeIdentity.generate()}


def simulate_market(rep: Reputation, world: dict, rng: random.Random, args, mint) -> int:
    """Honest consumers lease from random hosts over ``--days`` days and report."""
    sent = 0
    names = list(world["hosts"])
    for _ in range(args.leases):
        consumer = rng.choice(world["consumers"])
        host, drop_p = world["hosts"][rng.choice(names)]
        start = NOW - rng.uniform(0, args.days * DAY)
        lease = mint.lease(consumer, host, start=start, duration_s=rng.choice([1800, 3600, 7200]),
                           shares=rng.randint(1, 4))
        if rng.random() < drop_p:
            evidence = mint.failure(host, lease, ended_at=start + rng.uniform(0, 600))
        else:
            evidence = mint.service(consumer, host, lease)
        sent += _deliver(rep, mint.report(consumer, peer(host), evidence, now=NOW))
    return sent


def simulate_sybil_ring(rep: Reputation, fresh: NodeIdentity, n: int, mint) -> int:
    """A fresh host and ``n`` fresh identities fake a glowing record among themselves."""
    sent = 0
    for _ in range(n):
        sybil = NodeIdentity.generate()
        lease = mint.lease(sybil, fresh, start=NOW - 2 * DAY, duration_s=86_400, shares=8)
        record = mint.service(sybil, fresh, lease)
        sent += _deliver(rep, mint.report(sybil, peer(fresh), record, now=NOW))
        beat = HeartbeatObservation(peer(fresh), NOW - DAY, NOW - 60, 1000, 1000)
        sent += _deliver(rep, mint.report(sybil, peer(fresh), beat, now=NOW))
    return sent


def simulate_smear(rep: Reputation, victim: NodeIdentity, n: int, mint) -> int:
    """``n`` fresh identities really lease from ``victim``, then claim it vanished."""
    sent = 0
    for _ in range(n):
        smearer = NodeIdentity.generate()
        lease = mint.lease(smearer, victim, start=NOW - 3600, duration_s=86_400, shares=8)
        sent += _deliver(rep, mint.report(smearer, peer(victim), mint.failure(victim, lease),
                                          now=NOW))
        silent = HeartbeatObservation(peer(victim), NOW - DAY, NOW - 60, 1000, 0)
        sent += _deliver(rep, mint.report(smearer, peer(victim), silent, now=NOW))
    return sent


def _deliver(rep: Reputation, envelope) -> int:
    return int(isinstance(rep.receive(envelope.to_bytes(), now=NOW), Accepted))


def ranking(rep: Reputation, names: dict[str, str]) -> list[tuple[str, object]]:
    """Hosts by lower bound, best first, as (label, HostScore)."""
    scores = rep.scores(now=NOW, hosts=names.values())
    by_peer = {p: label for label, p in names.items()}
    ordered = sorted(scores.values(), key=lambda s: -s.lower_bound)
    return [(by_peer.get(s.host, s.host[:12]), s) for s in ordered if s.host in by_peer]


def print_table(console: Console, title: str, ranked) -> None:
    table = Table(title=title)
    for column in ("rank", "host", "mean", "lower bound", "evidence"):
        table.add_column(column, justify="right" if column != "host" else "left")
    for i, (label, s) in enumerate(ranked, 1):
        table.add_row(str(i), label, f"{s.mean:.3f}", f"{s.lower_bound:.3f}",
                      f"{s.evidence_weight:.1f}")
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--honest", type=int, default=6)
    parser.add_argument("--flaky", type=int, default=3)
    parser.add_argument("--consumers", type=int, default=12)
    parser.add_argument("--pre-trusted", type=int, default=4)
    parser.add_argument("--leases", type=int, default=240)
    parser.add_argument("--days", type=float, default=30.0)
    parser.add_argument("--sybils", type=int, default=20)
    args = parser.parse_args()
    rng, mint, console = random.Random(args.seed), Minter(), Console()
    started = time.perf_counter()
    world = build_world(rng, args)
    rep = Reputation(peer(world["me"]),
                     pre_trusted=[peer(c) for c in world["consumers"][: args.pre_trusted]])
    names = {label: peer(ident) for label, (ident, _) in world["hosts"].items()}
    accepted = simulate_market(rep, world, rng, args, mint)
    before = ranking(rep, names)
    print_table(console, "Before the attacks", before)
    victim_label = before[0][0]
    fresh = NodeIdentity.generate()
    names["sybil-fresh"] = peer(fresh)
    accepted += simulate_sybil_ring(rep, fresh, args.sybils, mint)
    accepted += simulate_smear(rep, world["hosts"][victim_label][0], args.sybils, mint)
    after = ranking(rep, names)
    print_table(console, f"After a {args.sybils}-identity Sybil ring and smear", after)
    order_after = [label for label, _ in after]
    summary = {
        "seed": args.seed,
        "hosts": len(names),
        "reports_accepted": accepted,
        "findings_held": len(rep.store),
        "smear_victim": victim_label,
        "victim_rank_before": 1,
        "victim_rank_after": order_after.index(victim_label) + 1,
        "sybil_fresh_rank": order_after.index("sybil-fresh") + 1,
        "sybil_fresh_lower_bound": round(dict(after)["sybil-fresh"].lower_bound, 4),
        "prior_lower_bound": round(rep.prior().lower_bound, 4),
        "worst_honest_rank": max(order_after.index(n) + 1 for n in order_after
                                 if n.startswith("honest")),
        "best_flaky_rank": min(order_after.index(n) + 1 for n in order_after
                               if n.startswith("flaky")),
        "runtime_s": round(time.perf_counter() - started, 2),
    }
    console.print_json(json.dumps(summary))


if __name__ == "__main__":
    main()
