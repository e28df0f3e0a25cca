"""Scenario (d): attacks on reputation, against the real ``Reputation`` core.

Signatures are real here, because trust is the subject: every lease is proposed and
countersigned, every receipt signed and countersigned, every report signed, all with
ed25519 keys through the market's and the reputation's own code (``reputation.testing.
Minter``), and every report enters one node's ``Reputation`` as wire bytes.

The node's history: honest consumers (some of them this node's own counterparties,
its pre-trusted peers) lease from honest and flaky hosts over 30 days and report what
happened. On top of it, one attack per run:

- *sybil ring*: a fresh host and ``sybils`` fresh identities fake leases among
  themselves, countersign its receipts and report glowing heartbeats;
- *smear crowd*: ``sybils`` fresh identities really lease from the best honest host,
  then claim it vanished and report it silent;
- *hardware liars*: hosts that offer 3x the performance they have; the consumers who
  lease them measure it (the shim's probe) and report the measurement;
- *non-payers*: consumers that lease from honest hosts and never countersign a
  receipt; the hosts report them.

Then consumers pick hosts for a day of demand with the real matcher, reliability from
the node's scores, and the report reads the honest hosts' rank and the earnings they
lost to the attack (against the same history with no attack).
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field

from ..identity import NodeIdentity
from ..market.book import OrderBook
from ..market.matcher import RankingPolicy, rank_offers
from ..market.messages import Bid, Cancel, Offer, PriorityClass, Side
from ..reputation import Accepted, HeartbeatObservation, PerformanceObservation, Reputation
from ..reputation.testing import Minter, peer

DAY = 86_400.0
NOW = 1_700_000_000.0
ATTACKS = ("none", "sybil ring", "smear crowd", "hardware liars", "non-payers")
PRICE = 50_000  # every host asks the same, so reputation alone decides
LIAR_CLAIM, LIAR_REAL = 300, 100
#: A host's ``--min-consumer-score`` in the non-payer run (the CLI's example value).
MIN_CONSUMER_SCORE = 0.3


@dataclass
class World:
    """Identities (drawn from the seed) and who is honest."""

    rng: random.Random
    honest: list[NodeIdentity]
    flaky: dict[str, tuple[NodeIdentity, float]]  # peer -> key, chance it drops a lease
    consumers: list[NodeIdentity]
    bad_hosts: list[NodeIdentity] = field(default_factory=list)
    bad_consumers: list[NodeIdentity] = field(default_factory=list)

    def key(self) -> NodeIdentity:
        return NodeIdentity.from_seed(self.rng.randbytes(32))


def run(seed: int, *, quick: bool) -> dict:
    """Each attack on the same history; rows of ranks, scores and earnings."""
    size = dict(honest=8, flaky=3, consumers=16, leases=200, sybils=10)
    if not quick:
        size = dict(honest=40, flaky=10, consumers=80, leases=1500, sybils=50)
    baseline = None
    rows = []
    for attack in ATTACKS:
        row = simulate(seed, attack, **size)
        if baseline is None:
            baseline = row
        row["honest_earnings_lost"] = round(
            1 - row["honest_earnings"] / baseline["honest_earnings"], 4
        )
        rows.append({"attack": attack, **row})
    return {"scenario": "attacks", "seed": seed, "quick": quick, "size": size, "rows": rows}


def simulate(
    seed: int, attack: str, *, honest: int, flaky: int, consumers: int, leases: int, sybils: int
) -> dict:
    """One node's view after the history and ``attack``; then an hour of demand for as
    many shares as the honest hosts have."""
    rng = random.Random(seed)
    world = World(rng, [], {}, [])
    world.honest = [world.key() for _ in range(honest)]
    for key in [world.key() for _ in range(flaky)]:
        world.flaky[peer(key)] = (key, rng.uniform(0.2, 0.5))
    world.consumers = [world.key() for _ in range(consumers)]
    rep = Reputation(peer(world.key()), pre_trusted=[peer(c) for c in world.consumers[:4]])
    mint = Minter()
    hosts = world.honest + [key for key, _ in world.flaky.values()]
    accepted = _history(rep, world, hosts, leases, mint)
    accepted += _ATTACKS[attack](rep, world, sybils, mint)
    everyone = hosts + world.bad_hosts
    scores = rep.scores(now=NOW, hosts=[peer(h) for h in everyone])
    ranked = sorted(everyone, key=lambda h: -scores[peer(h)].lower_bound)
    rank = {peer(h): i + 1 for i, h in enumerate(ranked)}
    reliability = {p: s.lower_bound for p, s in scores.items()}
    earned = _demand(everyone, reliability, bids=8 * honest)
    honest_peers = [peer(h) for h in world.honest]
    row = {
        "reports_accepted": accepted,
        "worst_honest_rank": max(rank[p] for p in honest_peers),
        "best_bad_host_rank": min((rank[peer(h)] for h in world.bad_hosts), default=None),
        "victim_rank": rank[honest_peers[0]],
        "honest_earnings": sum(earned.get(p, 0) for p in honest_peers),
        "bad_host_earnings_share": round(
            sum(earned.get(peer(h), 0) for h in world.bad_hosts) / max(1, sum(earned.values())), 4
        ),
    }
    if world.bad_consumers:
        row |= _consumer_screening(rep, world)
    return row


def _history(rep, world: World, hosts, leases: int, mint: Minter) -> int:
    """Honest consumers lease for 30 days and report; the first honest host is the most
    used (the smear crowd's victim)."""
    rng, sent = world.rng, 0
    for _ in range(leases):
        consumer = rng.choice(world.consumers)
        host = world.honest[0] if rng.random() < 0.2 else rng.choice(hosts)
        start = NOW - rng.uniform(DAY, 30 * DAY)
        lease = mint.lease(
            consumer,
            host,
            start=start,
            duration_s=rng.choice([1800, 3600]),
            shares=rng.randint(1, 4),
        )
        _, drop = world.flaky.get(peer(host), (host, 0.0))
        if rng.random() < drop:
            evidence = mint.failure(host, lease, ended_at=start + rng.uniform(0, 600))
        else:
            evidence = mint.service(consumer, host, lease)
        sent += _deliver(rep, mint.report(consumer, peer(host), evidence, now=NOW))
    return sent


def _sybil_ring(rep, world: World, sybils: int, mint: Minter) -> int:
    fresh = world.key()
    world.bad_hosts.append(fresh)
    sent = 0
    for _ in range(sybils):
        sybil = world.key()
        lease = mint.lease(sybil, fresh, start=NOW - 2 * DAY, duration_s=86_400, shares=8)
        sent += _deliver(
            rep, mint.report(sybil, peer(fresh), mint.service(sybil, fresh, lease), now=NOW)
        )
        beat = HeartbeatObservation(peer(fresh), NOW - DAY, NOW - 60, 1000, 1000)
        sent += _deliver(rep, mint.report(sybil, peer(fresh), beat, now=NOW))
    return sent


def _smear_crowd(rep, world: World, sybils: int, mint: Minter) -> int:
    victim, sent = world.honest[0], 0
    for _ in range(sybils):
        smearer = world.key()
        lease = mint.lease(smearer, victim, start=NOW - 3600, duration_s=86_400, shares=8)
        sent += _deliver(
            rep, mint.report(smearer, peer(victim), mint.failure(victim, lease), now=NOW)
        )
        silent = HeartbeatObservation(peer(victim), NOW - DAY, NOW - 60, 1000, 0)
        sent += _deliver(rep, mint.report(smearer, peer(victim), silent, now=NOW))
    return sent


def _hardware_liars(rep, world: World, sybils: int, mint: Minter) -> int:
    """A fifth as many liars as honest hosts; honest consumers lease each a few times."""
    rng, sent = world.rng, 0
    for _ in range(max(1, len(world.honest) // 5)):
        liar = world.key()
        world.bad_hosts.append(liar)
        for _ in range(4):
            consumer = rng.choice(world.consumers)
            start = NOW - rng.uniform(DAY, 10 * DAY)
            lease = mint.lease(consumer, liar, start=start, duration_s=3600)
            offer = mint.offer(liar, now=start - 60, perf_units=LIAR_CLAIM)
            measured = PerformanceObservation(lease, liar.public_key, offer, LIAR_REAL, start + 30)
            sent += _deliver(rep, mint.report(consumer, peer(liar), measured, now=NOW))
    return sent


def _non_payers(rep, world: World, sybils: int, mint: Minter) -> int:
    """``sybils // 5`` consumers each skip paying three honest hosts."""
    rng, sent = world.rng, 0
    for _ in range(max(1, sybils // 5)):
        cheat = world.key()
        world.bad_consumers.append(cheat)
        for _ in range(3):
            host = rng.choice(world.honest)
            lease = mint.lease(cheat, host, start=NOW - rng.uniform(DAY, 10 * DAY))
            claim = mint.nonpayment(host, lease)
            sent += _deliver(rep, mint.report(host, peer(cheat), claim, now=NOW))
    return sent


_ATTACKS = {
    "none": lambda rep, world, sybils, mint: 0,
    "sybil ring": _sybil_ring,
    "smear crowd": _smear_crowd,
    "hardware liars": _hardware_liars,
    "non-payers": _non_payers,
}


def _deliver(rep: Reputation, envelope) -> int:
    return int(isinstance(rep.receive(envelope.to_bytes(), now=NOW), Accepted))


def _demand(hosts, reliability: dict[str, float], *, bids: int) -> dict[str, int]:
    """``bids`` one-share bids, each leasing the matcher's first choice; returns the
    micro-credits each host earned for an hour of each share."""
    book = OrderBook()
    free = {}
    for i, host in enumerate(hosts):
        free[peer(host)] = 8
        book.insert(_offer(peer(host), 8, i + 1), now=NOW)
    policy = RankingPolicy(neutral_reliability=0.5)
    earned: dict[str, int] = {}
    nonce = len(hosts) + 1
    for i in range(bids):
        bid = Bid(
            "consumer",
            f"b{i}",
            0,
            (),
            0,
            1,
            PRICE,
            PriorityClass.ON_DEMAND,
            3600,
            NOW,
            NOW + DAY,
            i + 1,
        )
        ranked = rank_offers(book, bid, reliability=reliability, limit=1, policy=policy)
        if not ranked:
            break
        host = ranked[0].offer.host
        earned[host] = earned.get(host, 0) + PRICE
        free[host] -= 1
        nonce += 1
        if free[host] > 0:
            book.insert(_offer(host, free[host], nonce), now=NOW)
        else:
            book.insert(Cancel(host, Side.OFFER, "gpu0", NOW + DAY, nonce), now=NOW)
    return earned


def _offer(host: str, shares: int, nonce: int) -> Offer:
    return Offer(host, "gpu0", "RTX 4090", 24_576, 100, shares, PRICE, 0, "", NOW, NOW + DAY, nonce)


def _consumer_screening(rep: Reputation, world: World) -> dict:
    """How a host with ``--min-consumer-score`` would treat non-payers and the honest
    (it reads the score's mean, as ``Provider.screen`` does)."""
    scores = rep.scores(now=NOW, hosts=[peer(c) for c in world.consumers + world.bad_consumers])
    cheats = [scores[peer(c)].mean for c in world.bad_consumers]
    honest = [scores[peer(c)].mean for c in world.consumers]
    return {
        "non_payer_score_mean": round(statistics.fmean(cheats), 4),
        "honest_consumer_score_mean": round(statistics.fmean(honest), 4),
        "non_payers_refused": sum(s < MIN_CONSUMER_SCORE for s in cheats) / len(cheats),
        "honest_consumers_refused": sum(s < MIN_CONSUMER_SCORE for s in honest) / len(honest),
    }
