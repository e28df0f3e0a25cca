"""Scenario: spam on the market (issue 36): a flood of junk offers from N identities.

Usage: python simulations/spam.py [--seed N] [--quick] [--out DIR]

Theory of operation
-------------------
One node's view of the market (the bootstrap node every offer reaches first), and the
consumers who match through it. What is real, and whose defaults:

- **The gossip gate**: every offer, honest or junk, first passes the node's two
  ``dht.ratelimit.RateLimiter`` buckets, per originating peer and per author, built from
  ``dht.gossip.GossipConfig()``'s defaults (50/s and 4/s).
- **The book**: a real ``market.OrderBook`` with the node's default ``BookLimits()``
  (``--max-offers-per-author`` 8, ``--max-book-orders`` 20,000). Hosts with a record are
  ``vouch``-ed, as the node does once a report of paid leases arrives; an honest newcomer
  is vouched after its first lease settles.
- **The cost of entry**: the node's real ``market.Liveness`` prober, with its default
  ``LivenessPolicy`` (8 probes in flight, 3 s to answer, a backoff from 10 s doubling to an
  hour for a host that misses), fed as ``Consumer.probe_newcomers`` feeds it every
  ``PROBE_POLL_S``: the hosts with no record whose offers meet a bid, those priced like
  the market before those far below it. An honest host answers each challenge with a real
  signed ``answer_probe`` after one round trip; no attacker answers (its probes time out).
- **The matcher**: ``rank_offers`` with ``entry_of`` (hosts with a record first, then
  proven newcomers priced like the market, then proven newcomers far below it, then hosts
  that have answered no probe), ``RANKED_OFFERS`` deep.
- **The choice**: each consumer's own ``market.HostChoice``, fed as the node feeds it; its
  batch of proposals is the node's own ``market.proposal_batch`` (``PROPOSALS_AT_ONCE`` at
  once, never an unproven host, a slot for a proven newcomer, ``NEWCOMER_SHARE`` of
  matches newcomers first), each host given ``PROPOSE_TIMEOUT_S`` to answer; a host that
  ignores a proposal is set aside with all its offers. The first match waits
  ``--match-timeout`` (60 s), then the consumer gives up.
- **Leasing**: every proposal to an honest host is a real signed ``LeaseProposal``,
  granted or refused by the host's real ``LeaseBook``; grants that lose to a better one
  in the same batch are released, as the node closes them.

The attacker runs N identities, each its own peer (a Sybil needs only a key pair to be a
peer too, so the per-peer bucket never binds) and each publishing a fresh offer id at
exactly the per-author rate the gate accepts (its burst, then 4/s; faster only earns a
30 s penalty), with the real spammer's 30 s lifetime. Half the identities ask a junk-low
price (0.000001 credits, ``cumulus_p2p.testing.spammer``'s), for an H100 or for the honest
hosts' own class; the other half ask 90% of the market, just under the honest hosts. No
attacker ever answers a lease proposal: the costliest junk for a consumer.

*Defences off* is the same world with each defence at the setting that switches it off
in the real code (no rate limiters, ``book.UNBOUNDED``, ``rank_offers`` by price alone, no
liveness probes: ``entry_of`` without ``alive``)
and the consumer as it was before issue 36: one proposal at a time, and only the offer it
tried set aside, not its host. The attacker sends at the same rate in both, so the
undefended node sees no more junk than the defended one is offered.

Simplified: offers are not signed in the book (it takes authenticated messages, and
checking a million signatures would only measure the signature library); honest
re-announcements reach the book at once (no gossip delay); reliability scores are neutral
and latency the matcher's default, so within an entry tier price decides; a consumer
holds its lease for its whole term. The probes' evidence is the node's, shared by the
consumers that match through it (a real consumer node probes for itself, and probes
inline before a newcomers' match that has no proven newcomer; here the node's prober is
always running, so that is left out).
"""

from __future__ import annotations

import itertools
import random
import statistics
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace

import simpy

from cumulus_p2p.dht.gossip import GossipConfig
from cumulus_p2p.dht.node import MeshConfig
from cumulus_p2p.dht.ratelimit import RateLimiter
from cumulus_p2p.identity import NodeIdentity
from cumulus_p2p.market.book import UNBOUNDED, BookLimits, InsertStatus, OrderBook
from cumulus_p2p.market.hostchoice import HostChoice, Propose, Wait
from cumulus_p2p.market.lease import LeaseBook, Refusal
from cumulus_p2p.market.liveness import CHALLENGE_SIZE, Liveness, LivenessPolicy, answer_probe
from cumulus_p2p.market.matcher import (
    Entry,
    RankedOffer,
    entry_of,
    proposal_batch,
    rank_offers,
)
from cumulus_p2p.market.messages import (
    Bid,
    Cancel,
    LeaseProposal,
    Offer,
    PriorityClass,
    Side,
    seal_message,
)
from cumulus_p2p.node.consumer import (
    _STALE_OFFER,
    HOLD_POLL_S,
    NEWCOMER_SHARE,
    PROBE_POLL_S,
    PROPOSALS_AT_ONCE,
    PROPOSE_TIMEOUT_S,
    RANKED_OFFERS,
)
from cumulus_p2p.simulation.cli import run_and_save, scenario_parser

#: Simulated time zero, as Unix time (signatures and books want real timestamps).
EPOCH = 1_700_000_000.0
MICRO = 1_000_000
SHARES_PER_GPU = 8
#: The honest hosts' class (``simulation/world.py``'s RTX 4090) and its market price.
CLASS = ("RTX 4090", 24_576, 100)
JUNK_CLASS = ("H100 80GB", 81_920, 300)
MARKET_PRICE = 400_000  # micro-credits per share-hour
#: ``cumulus_p2p.testing.spammer``'s price: a millionth of a credit.
JUNK_LOW_PRICE = 1
NEAR_MARKET = 0.9
#: ``cumulus-node --consume``'s defaults and the issue's consumer (``--max-price 1``).
MATCH_TIMEOUT_S = 60.0
MAX_PRICE = 1 * MICRO
#: A proposal's round trip to an honest host (the matcher's default latency).
RTT_S = 0.05
#: What an offer outlives its announcement by, and how often honest hosts re-announce:
#: the node's defaults (``MeshConfig``); the spammer's offers live as long.
ANNOUNCE_S = MeshConfig().announce_interval
OFFER_TTL_S = MeshConfig().offer_ttl
#: How often the node drops expired orders (``Runtime.expire_loop``) and we sample it.
TICK_S = 1.0


@dataclass(frozen=True, slots=True)
class Defences:
    """Which of issue 36's defences are on (each maps to a setting of the real code)."""

    gate: bool = True  # GossipConfig's per-peer and per-author token buckets
    book_limits: BookLimits | None = BookLimits()  # None: book.UNBOUNDED
    entry: bool = True  # rank by entry_of before price
    batch: bool = True  # PROPOSALS_AT_ONCE, a newcomer slot, NEWCOMER_SHARE
    set_aside_host: bool = True  # an ignored proposal sets aside the host, not the offer
    probe: bool = True  # a newcomer counts once it answered a liveness probe


ON = Defences()
OFF = Defences(
    gate=False, book_limits=None, entry=False, batch=False, set_aside_host=False, probe=False
)
#: ``--max-book-orders`` for the row where the book bound, not the cap, is reached.
SMALL_BOOK = 400
#: One defence off at a time, against the largest flood: which one carries the load. (The
#: gate is not among them: the attacker sends at the rate it accepts, so it refuses
#: nothing here; its part is that sending faster earns a penalty, not more junk.)
ABLATIONS = {
    "on, no liveness probe": replace(ON, probe=False),
    "on, no per-author cap": replace(ON, book_limits=UNBOUNDED),
    "on, ranked by price alone": replace(ON, entry=False),
    "on, one proposal at a time": replace(ON, batch=False),
    "on, offer set aside, not host": replace(ON, set_aside_host=False),
    f"on, book bound {SMALL_BOOK}": replace(ON, book_limits=BookLimits(max_orders=SMALL_BOOK)),
}


@dataclass(frozen=True, slots=True)
class Size:
    """The world: honest hosts, consumers, and how long it runs."""

    record_hosts: int = 12
    newcomer_hosts: int = 4
    horizon_s: float = 900.0
    #: Consumers arriving per minute (Poisson), each wanting ``shares`` for ``lease_s``:
    #: about half of the honest capacity in use.
    arrivals_per_min: float = 8.0
    shares: int = 2
    lease_s: int = 240
    #: The flood starts at 0; consumers from here on, when the book is full of junk.
    first_arrival_s: float = 30.0


QUICK = Size(horizon_s=150.0)
FULL = Size(horizon_s=600.0)
IDENTITIES = (0, 10, 50, 200)


@dataclass(eq=False)
class Host:
    """An honest host: one GPU's shares on offer, and its real ``LeaseBook``."""

    identity: NodeIdentity
    peer: str
    price: int
    lease_book: LeaseBook
    record: bool
    nonce: int = 0
    leases: int = 0


@dataclass(eq=False)
class Attacker:
    """One junk identity: what it claims, at what price."""

    peer: str
    cls: tuple[str, int, int]
    price: int
    junk_low: bool
    nonce: int = 0


@dataclass
class Counters:
    """What happened, for the row."""

    sent: int = 0
    gate_refused: int = 0
    book_added: int = 0
    book_refused: dict[str, int] = field(default_factory=dict)
    peak_offers: int = 0
    peak_junk_offers: int = 0
    peak_per_author: int = 0
    looks: int = 0
    junk_low_first: int = 0  # looks whose best candidate was a junk-low offer
    proposals: int = 0
    proposals_to_attackers: int = 0
    probes: int = 0
    probes_to_attackers: int = 0
    #: When each honest newcomer first answered a probe (seconds into the run).
    newcomer_proven_s: dict[str, float] = field(default_factory=dict)
    consumers: list[dict] = field(default_factory=list)


class Market:
    """The node's book and gate, the honest hosts and the attacker, on one SimPy clock."""

    def __init__(
        self, seed: int, identities: int, defences: Defences, size: Size, *, near_market: bool
    ) -> None:
        # One stream per purpose, so that the same seed gives the same hosts and the same
        # consumers arriving at the same times, whatever the flood and the defences.
        self.rng = random.Random(f"{seed}/world")
        self.arrival_rng = random.Random(f"{seed}/arrivals")
        self.choice_rng = random.Random(f"{seed}/choices")
        self.env = simpy.Environment()
        self.defences = defences
        self.size = size
        self.book = OrderBook(defences.book_limits or UNBOUNDED)
        gossip = GossipConfig()
        self.peer_gate = RateLimiter(gossip.peer_limit, max_keys=gossip.max_limited_keys)
        self.author_gate = RateLimiter(gossip.author_limit, max_keys=gossip.max_limited_keys)
        self.author_rate = gossip.author_limit.rate
        self.author_burst = int(gossip.author_limit.burst)
        self.count = Counters()
        node_key = NodeIdentity.from_seed(random.Random(f"{seed}/node").randbytes(32))
        self.node = node_key.peer_id.to_base58()
        self.liveness = Liveness(self.node, LivenessPolicy())
        self.probe_rng = random.Random(f"{seed}/probes")
        self.hosts: dict[str, Host] = {}
        self.attackers: dict[str, Attacker] = {}
        self._ids = itertools.count(1)
        for i in range(size.record_hosts + size.newcomer_hosts):
            self._add_host(record=i < size.record_hosts)
        for i in range(identities):
            junk_low = i % 2 == 0 or not near_market
            cls = (JUNK_CLASS if i % 4 == 0 else CLASS) if junk_low else CLASS
            price = JUNK_LOW_PRICE if junk_low else int(NEAR_MARKET * MARKET_PRICE)
            peer = self._key().peer_id.to_base58()
            self.attackers[peer] = Attacker(peer, cls, price, junk_low)

    def now(self) -> float:
        return EPOCH + self.env.now

    def _key(self) -> NodeIdentity:
        return NodeIdentity.from_seed(self.rng.randbytes(32))

    # --- honest hosts ---------------------------------------------------------------

    def _add_host(self, *, record: bool) -> None:
        identity = self._key()
        peer = identity.peer_id.to_base58()
        price = int(MARKET_PRICE * self.rng.uniform(0.95, 1.15))
        host = Host(identity, peer, price, LeaseBook(identity), record)
        self.hosts[peer] = host
        if record:
            self.book.vouch(peer)  # a report of its paid leases reached the node

    def announce(self, host: Host) -> None:
        """Re-announce ``host``'s offer with its free shares, or cancel it at 0."""
        host.nonce += 1
        now = self.now()
        free = host.lease_book.free_shares("gpu0") if host.nonce > 1 else SHARES_PER_GPU
        if free > 0:
            name, vram, perf = CLASS
            offer = Offer(
                host.peer, "gpu0", name, vram, perf, free, host.price, 0, "",
                now, now + OFFER_TTL_S, host.nonce,
            )  # fmt: skip
            host.lease_book.publish(offer)
            self.receive(host.peer, offer)
        else:  # the LeaseBook keeps the pool, at 0 free, for the shares coming back
            self.receive(
                host.peer, Cancel(host.peer, Side.OFFER, "gpu0", now + OFFER_TTL_S, host.nonce)
            )

    def _keep_announcing(self, host: Host) -> Iterator:
        yield self.env.timeout(self.rng.uniform(0, ANNOUNCE_S))
        while True:
            self.announce(host)
            yield self.env.timeout(ANNOUNCE_S)

    # --- the node's intake ----------------------------------------------------------

    def receive(self, origin: str, message: Offer | Cancel) -> InsertStatus | None:
        """One message through the gate and into the book; ``None`` if the gate refused."""
        now = self.now()
        if self.defences.gate and not (
            self.peer_gate.allow(origin, now=now) and self.author_gate.allow(origin, now=now)
        ):
            return None
        return self.book.insert(message, now=now)

    def _flood(self) -> Iterator:
        """Every identity publishes a fresh offer id at the rate the gate accepts."""
        if not self.attackers:
            return
        attackers = list(self.attackers.values())
        burst = True
        while True:
            now = self.now()
            for attacker in attackers:
                for _ in range(self.author_burst if burst else 1):
                    attacker.nonce += 1
                    name, vram, perf = attacker.cls
                    offer = Offer(
                        attacker.peer, f"junk{attacker.nonce}", name, vram, perf,
                        SHARES_PER_GPU, attacker.price, 0, "", now, now + OFFER_TTL_S,
                        attacker.nonce,
                    )  # fmt: skip
                    self.count.sent += 1
                    status = self.receive(attacker.peer, offer)
                    if status is None:
                        self.count.gate_refused += 1
                    elif status is InsertStatus.ADDED:
                        self.count.book_added += 1
                    else:
                        refused = self.count.book_refused
                        refused[status.name] = refused.get(status.name, 0) + 1
            burst = False
            yield self.env.timeout(1.0 / self.author_rate)

    def _upkeep(self) -> Iterator:
        """Drop expired orders and leases, as the node's expire loop does; sample peaks."""
        while True:
            now = self.now()
            self.book.expire(now)
            for host in self.hosts.values():
                ended = host.lease_book.expire(now)
                if ended:
                    if not host.record and not self.book.vouched(host.peer):
                        self.book.vouch(host.peer)  # its first paid lease was reported
                    self.announce(host)
            stats = self.book.statistics()
            honest = sum(self.book.get(Side.OFFER, h, "gpu0") is not None for h in self.hosts)
            junk = stats.offers - honest
            c = self.count
            c.peak_offers = max(c.peak_offers, stats.offers)
            c.peak_junk_offers = max(c.peak_junk_offers, junk)
            c.peak_per_author = max(c.peak_per_author, stats.most_per_author)
            yield self.env.timeout(TICK_S)

    # --- the cost of entry ----------------------------------------------------------

    def _prober(self) -> Iterator:
        """``Consumer.keep_probing``: every ``PROBE_POLL_S``, probe the unproven hosts
        whose offers meet a bid, within the ``Liveness`` budget."""
        bid = self._bid(self.node)
        while True:
            now = self.now()
            entry = entry_of(self.book, bid, self.book.vouched)
            tiers: dict[str, int] = {}  # priced like the market 0, far below it 1
            for resting in self.book.candidates(bid):
                host = resting.order.host
                if host not in tiers and not self.book.vouched(host):
                    tiers[host] = int(entry(resting.order) is not Entry.NEWCOMER)
            for host in self.liveness.due(tiers, now=now, tier=tiers):
                probe = self.liveness.challenge(
                    host, nonce=self.probe_rng.randbytes(CHALLENGE_SIZE), now=now
                )
                self.count.probes += 1
                self.count.probes_to_attackers += host in self.attackers
                self.env.process(self._answer(probe))
            yield self.env.timeout(PROBE_POLL_S)

    def _answer(self, probe) -> Iterator:
        """An honest host signs the challenge after a round trip; an attacker never does."""
        host = self.hosts.get(probe.host)
        if host is None:
            yield self.env.timeout(self.liveness.policy.timeout_s)
            self.liveness.missed(probe.host, now=self.now())
            return
        yield self.env.timeout(RTT_S)
        free = host.lease_book.free_shares("gpu0")
        raw = answer_probe(
            host.identity, probe.request, prober=self.node, now=self.now(),
            free_shares=free, nonce=host.nonce,
        )  # fmt: skip
        self.liveness.answered(probe.host, raw, now=self.now())
        self.count.newcomer_proven_s.setdefault(probe.host, round(self.env.now, 2))

    # --- consumers ------------------------------------------------------------------

    def _arrivals(self) -> Iterator:
        yield self.env.timeout(self.size.first_arrival_s)
        rate = self.size.arrivals_per_min / 60.0
        last = self.size.horizon_s - MATCH_TIMEOUT_S  # every window closes in the run
        while self.env.now < last:
            key = NodeIdentity.from_seed(self.arrival_rng.randbytes(32))
            self.env.process(self._consumer(key))
            yield self.env.timeout(self.arrival_rng.expovariate(rate))

    def _bid(self, consumer: str) -> Bid:
        now = self.now()
        return Bid(
            consumer, "bid0", 16_384, (), 0, self.size.shares, MAX_PRICE,
            PriorityClass.ON_DEMAND, self.size.lease_s, now, now + OFFER_TTL_S, 1,
        )  # fmt: skip

    def _consumer(self, key: NodeIdentity) -> Iterator:
        """``Consumer.lease``, step by step, with time passed in."""
        arrived, peer = self.env.now, key.peer_id.to_base58()
        bid = self._bid(peer)
        choice = HostChoice()
        choice.search(now=self.now(), patience_s=MATCH_TIMEOUT_S)
        granted_by: set[str] = set()
        tried: set[tuple[str, str, int]] = set()  # defences off: offers, not hosts
        row = {"arrived_s": round(arrived, 2), "leased_s": None, "host": None, "proposals": 0}
        self.count.consumers.append(row)

        def has_record(host: str) -> bool:
            return host in granted_by or self.book.vouched(host)

        while True:
            now = self.now()
            offers, entries = self._candidates(bid, has_record, choice, tried, now)
            decision = choice.next_step(list(offers), now=now)
            if type(decision) is Wait:
                yield self.env.timeout(HOLD_POLL_S)
                continue
            if type(decision) is not Propose:
                return  # gave up: no lease within the match window
            if self.defences.batch:
                newcomers_first = self.choice_rng.random() < NEWCOMER_SHARE
                batch = proposal_batch(
                    decision.hosts, entries, at_once=PROPOSALS_AT_ONCE,
                    newcomers_first=newcomers_first,
                )  # fmt: skip
            else:
                batch = [h for h in decision.hosts if entries.get(h) is not Entry.UNPROVEN][:1]
            if not batch:  # only hosts that answered no probe yet
                yield self.env.timeout(HOLD_POLL_S)
                continue
            winner = yield from self._propose(key, bid, [offers[h] for h in batch], choice, tried)
            row["proposals"] += len(batch)
            if winner is not None:
                granted_by.add(winner.peer)
                choice.leased(winner.peer, now=self.now())
                row["leased_s"] = round(self.env.now - arrived, 3)
                row["host"] = "record" if winner.record else "newcomer"
                return
            yield self.env.timeout(0.25)

    def _candidates(self, bid, has_record, choice, tried, now):
        """``Consumer._candidates``: each host's best ranked offer, best host first."""
        alive = None
        if self.defences.probe:
            alive = lambda host: self.liveness.alive(host, now=now)  # noqa: E731
        entry = entry_of(self.book, bid, has_record, alive=alive) if self.defences.entry else None
        ranked = rank_offers(self.book, bid, limit=RANKED_OFFERS, entry=entry)
        self._note_ranking(ranked)
        offers: dict[str, Offer] = {}
        for r in ranked:
            # The node shows every offer in its book to the choice; only ranked hosts can
            # matter to it, and a newer nonce seen later has the same effect.
            choice.see_offer(r.offer.host, r.offer.nonce, now=now)
            if (r.offer.host, r.offer.offer_id, r.offer.nonce) not in tried:
                offers.setdefault(r.offer.host, r.offer)
        entries = {h: entry(o) for h, o in offers.items()} if entry else {}
        return offers, entries

    def _note_ranking(self, ranked: list[RankedOffer]) -> None:
        self.count.looks += 1
        if ranked:
            best = self.attackers.get(ranked[0].offer.host)
            self.count.junk_low_first += best is not None and best.junk_low

    def _propose(self, key: NodeIdentity, bid: Bid, offers: list[Offer], choice, tried) -> Iterator:
        """``Consumer._propose_batch``: propose to every host at once; the best grant wins
        once every better host has answered (an attacker: after ``PROPOSE_TIMEOUT_S``)."""
        started, peer = self.now(), bid.consumer
        answers = []  # (seconds to the answer, the host or None, the lease id, refusal)
        for offer in offers:
            self.count.proposals += 1
            host = self.hosts.get(offer.host)
            if host is None:
                self.count.proposals_to_attackers += 1
                answers.append((PROPOSE_TIMEOUT_S, None, None, None))
                continue
            lease_id = f"L{next(self._ids)}"
            proposal = LeaseProposal(
                lease_id, peer, offer.host, offer.offer_id, offer.nonce, bid.shares,
                offer.price, started, bid.duration_s, bid.priority, started + 60, next(self._ids),
            )  # fmt: skip
            raw = seal_message(key, proposal, now=started).to_bytes()
            answer = host.lease_book.propose(raw, now=started, sender=peer)
            if isinstance(answer, Refusal):
                answers.append((RTT_S, host, None, answer))
            else:
                self.announce(host)  # fewer shares free now
                answers.append((RTT_S, host, lease_id, None))
        winner_at = next((i for i, a in enumerate(answers) if a[2] is not None), None)
        decided = answers if winner_at is None else answers[: winner_at + 1]
        decided_after = max(a[0] for a in decided)
        yield self.env.timeout(decided_after)
        now = self.now()
        for i, (_, host, lease_id, refusal) in enumerate(answers):
            offer = offers[i]
            if lease_id is not None and i != winner_at:
                host.lease_book.release(lease_id)  # a grant that lost: closed
                self.announce(host)
            failed = host is None or (refusal is not None and refusal.reason not in _STALE_OFFER)
            if not failed or answers[i][0] > decided_after:
                continue  # answered after the match was decided: too late for this job
            if self.defences.set_aside_host:
                why = "ignored a proposal" if host is None else "refused a lease"
                choice.failed(offer.host, now=now, nonce=offer.nonce, reason=why)
            else:
                tried.add((offer.host, offer.offer_id, offer.nonce))
        if winner_at is None:
            return None
        winner = answers[winner_at][1]
        winner.leases += 1
        return winner

    # --- the run --------------------------------------------------------------------

    def run(self) -> None:
        for host in self.hosts.values():
            self.announce(host)
            self.env.process(self._keep_announcing(host))
        self.env.process(self._flood())
        self.env.process(self._upkeep())
        if self.defences.probe:
            self.env.process(self._prober())
        self.env.process(self._arrivals())
        self.env.run(until=self.size.horizon_s)


def simulate(
    seed: int,
    identities: int,
    defences: Defences = ON,
    size: Size = QUICK,
    *,
    near_market: bool = True,
    label: str | None = None,
) -> dict:
    """One flood of ``identities`` junk identities on ``size``'s world; the row.

    ``near_market``: half the identities ask 90% of the market (else all junk-low).
    """
    market = Market(seed, identities, defences, size, near_market=near_market)
    market.run()
    c = market.count
    rows = c.consumers
    leased = [r for r in rows if r["leased_s"] is not None]
    waits = sorted(r["leased_s"] for r in leased)
    newcomer_leases = sum(h.leases for h in market.hosts.values() if not h.record)
    stats = market.book.statistics()
    return {
        "identities": identities,
        "defences": label or ("on" if defences == ON else "off" if defences == OFF else "custom"),
        "attackers": "half junk-low, half near the market" if near_market else "all junk-low",
        "max_book_orders": None
        if defences.book_limits in (None, UNBOUNDED)
        else defences.book_limits.max_orders,
        "max_offers_per_author_cap": None
        if defences.book_limits in (None, UNBOUNDED)
        else defences.book_limits.max_orders_per_author,
        "consumers": len(rows),
        "leased_share": round(len(leased) / len(rows), 4) if rows else None,
        "lease_s_median": round(statistics.median(waits), 3) if waits else None,
        "lease_s_p90": round(waits[int(0.9 * (len(waits) - 1))], 3) if waits else None,
        "lease_s_max": round(waits[-1], 3) if waits else None,
        "proposals_per_consumer": round(c.proposals / len(rows), 2) if rows else None,
        "attacker_proposal_share": round(c.proposals_to_attackers / c.proposals, 4)
        if c.proposals
        else 0.0,
        "junk_low_first_share": round(c.junk_low_first / c.looks, 4) if c.looks else 0.0,
        "newcomer_leases": newcomer_leases,
        "newcomer_leased": newcomer_leases > 0,
        "newcomers_leased": sum(h.leases > 0 for h in market.hosts.values() if not h.record),
        "newcomers": sum(not h.record for h in market.hosts.values()),
        "newcomer_last_proven_s": max(c.newcomer_proven_s.values(), default=None),
        "probes": c.probes,
        "probes_to_attackers": c.probes_to_attackers,
        "probes_per_attacker": round(c.probes_to_attackers / identities, 2) if identities else 0,
        "peak_book_offers": c.peak_offers,
        "peak_junk_offers": c.peak_junk_offers,
        "max_offers_per_author": c.peak_per_author,
        "evicted": stats.evicted,
        "junk_sent": c.sent,
        "junk_gate_refused": c.gate_refused,
        "junk_book_added": c.book_added,
        "junk_book_refused": dict(sorted(c.book_refused.items())),
    }


def run(seed: int, *, quick: bool, identities: tuple[int, ...] = IDENTITIES) -> dict:
    """Every flood size with the defences on and off, and the book bound at work."""
    size = QUICK if quick else FULL
    rows = []
    for n in identities:
        for defences in (ON, OFF):
            rows.append(simulate(seed, n, defences, size))
    largest = max(identities)
    for label, defences in ABLATIONS.items():
        rows.append(simulate(seed, largest, defences, size, label=label))
    rows.append(simulate(seed, largest, ON, size, near_market=False))
    return {
        "scenario": "spam",
        "seed": seed,
        "quick": quick,
        "size": asdict(size),
        "defaults": {
            "max_offers_per_author": BookLimits().max_orders_per_author,
            "max_book_orders": BookLimits().max_orders,
            "peer_limit_per_s": GossipConfig().peer_limit.rate,
            "author_limit_per_s": GossipConfig().author_limit.rate,
            "author_burst": GossipConfig().author_limit.burst,
            "proposals_at_once": PROPOSALS_AT_ONCE,
            "propose_timeout_s": PROPOSE_TIMEOUT_S,
            "newcomer_share": NEWCOMER_SHARE,
            "probes_at_once": LivenessPolicy().at_once,
            "probe_timeout_s": LivenessPolicy().timeout_s,
            "probe_backoff_s": LivenessPolicy().backoff_s,
            "match_timeout_s": MATCH_TIMEOUT_S,
        },
        "rows": rows,
    }


def report(result: dict) -> str:
    """The rows as a markdown table."""
    header = (
        "| identities | attackers | defences | leased | time to lease, median / p90 / max (s) "
        "| proposals to attackers | junk-low ranked first | peak book (junk) "
        "| max per author | evicted | newcomer leases | probes per attacker |"
    )
    lines = [
        f"# Spam on the market, seed {result['seed']}, "
        f"{'quick' if result['quick'] else 'full'} run",
        "",
        header,
        "|" + " --- |" * 12,
    ]
    for r in result["rows"]:
        times = " / ".join(
            "–" if r[k] is None else f"{r[k]:g}"
            for k in ("lease_s_median", "lease_s_p90", "lease_s_max")
        )
        lines.append(
            f"| {r['identities']} | {r['attackers']} | {r['defences']} "
            f"| {r['leased_share']:.0%} of {r['consumers']} | {times} "
            f"| {r['attacker_proposal_share']:.0%} | {r['junk_low_first_share']:.0%} "
            f"| {r['peak_book_offers']:,} ({r['peak_junk_offers']:,}) "
            f"| {r['max_offers_per_author']:,} | {r['evicted']:,} "
            f"| {r['newcomer_leases']} ({r['newcomers_leased']} of {r['newcomers']} hosts) "
            f"| {r['probes_per_attacker']:g} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = scenario_parser(__doc__)
    parser.add_argument(
        "--identities",
        type=lambda text: tuple(int(n) for n in text.split(",")),
        default=IDENTITIES,
        help="flood sizes, comma-separated (default %(default)s)",
    )
    args = parser.parse_args(argv)
    return run_and_save(
        "spam", args, lambda: run(args.seed, quick=args.quick, identities=args.identities), report
    )


if __name__ == "__main__":
    main()
