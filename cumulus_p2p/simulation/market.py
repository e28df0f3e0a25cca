"""Hosts, consumers and the market between them, on the real market cores.

What is real: every offer is an ``Offer`` resting in a real ``OrderBook``; a consumer
ranks them with the real matcher (``rank_offers``) from its own region's latencies and
its reputation view; each lease is a ``LeaseProposal`` signed with a real ed25519 key,
granted or refused by the host's real ``LeaseBook``; at its end the host's real
``Meter`` signs a receipt that the consumer checks with ``check_receipt`` before it
pays what the receipt says.

What is simplified: every consumer reads one shared book, the view of a typical node,
in which an offer appears one gossip delay after its host published it (so consumers
do see stale offers, and hosts refuse them). Offers and bids in that book are not
signed: the book takes messages that were already authenticated, and checking 10,000
signatures would only measure the signature library.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import simpy

from ..identity import NodeIdentity
from ..market.book import OrderBook
from ..market.lease import LeaseBook, Refusal
from ..market.matcher import RankedOffer, RankingPolicy, rank_offers
from ..market.messages import (
    Bid,
    Cancel,
    Lease,
    LeaseProposal,
    Offer,
    PriorityClass,
    Side,
    seal_message,
)
from ..market.metering import Meter, check_receipt
from ..market.pricing import proposed_price
from .gpu import SimGpu
from .world import REGIONS, SHARES_PER_GPU, GpuModel, gossip_delay_s, page_s_per_share, rtt_ms

#: Simulated time zero, as Unix time (signatures and books want real timestamps).
EPOCH = 1_700_000_000.0
#: How long an offer lives before its host must refresh it.
OFFER_TTL_S = 3600.0
#: Longest lease a consumer proposes; it releases the lease when its job ends.
LEASE_S = 7 * 86_400
MICRO = 1_000_000


@dataclass(eq=False)
class SimHost:
    """A host: its key, its GPU and its real ``LeaseBook``."""

    name: str
    identity: NodeIdentity
    region: str
    model: GpuModel
    price: int  # micro-credits per share-hour
    lease_book: LeaseBook
    gpu: SimGpu
    online: bool = True
    nonce: int = 0
    earned: float = 0.0
    contend_price: int = 0  # what a contending lease pays (0: none sold)
    contend_shares: int = 0  # contending shares sold beyond the on-demand ones
    overcommit: float = 1.0  # memory sold over memory held (``--overcommit``)
    # The job processes running on it; a dict keeps them in order (runs must repeat).
    jobs: dict = field(default_factory=dict)

    @property
    def peer(self) -> str:
        return self.lease_book.peer_id

    @property
    def shares_sold(self) -> int:
        """On-demand shares its GPU is sold in: more than its memory holds if overcommitted."""
        return round(SHARES_PER_GPU * self.overcommit)

    def new_gpu(self, env: simpy.Environment) -> SimGpu:
        """A fresh GPU of its model, paging its tenants' memory when overcommitted."""
        if self.overcommit == 1.0:
            return SimGpu(env, self.model.perf_units)
        paging = page_s_per_share(self.model)
        return SimGpu(
            env, self.model.perf_units, memory_shares=SHARES_PER_GPU, page_s_per_share=paging
        )


@dataclass(frozen=True, slots=True)
class Granted:
    """A lease the consumer holds: what it signed, on which host, and its meter."""

    host: SimHost
    proposal: LeaseProposal
    meter: Meter


class Market:
    """The hosts, the shared book a consumer reads, and the lease, meter and pay cycle."""

    def __init__(
        self,
        env: simpy.Environment,
        rng: random.Random,
        *,
        mesh_nodes: int,
        policy: RankingPolicy | None = None,
    ) -> None:
        self.env = env
        self.rng = rng
        self.mesh_nodes = mesh_nodes
        self.policy = policy or RankingPolicy()
        self.book = OrderBook()
        self.hosts: dict[str, SimHost] = {}
        self.reliability: dict[str, float] = {}
        self.refusals: dict[str, int] = {}
        self.active: dict[str, Granted] = {}  # lease id -> the lease, until settled
        #: Leases a host preempted for on-demand ones: their jobs stop at the next burst.
        self.preempted: set[str] = set()
        self._latency = {region: {} for region in REGIONS}
        # Rankings computed since the book last changed (``rank``), and at which change.
        self._ranked: dict[tuple, list[RankedOffer]] = {}
        self._ranked_at = -1
        self._nonces = itertools.count(1)
        self._lease_ids = itertools.count(1)

    def now(self) -> float:
        return EPOCH + self.env.now

    def identity(self) -> NodeIdentity:
        """A real key pair, drawn from the run's seed (so runs repeat exactly)."""
        return NodeIdentity.from_seed(self.rng.randbytes(32))

    # --- hosts ----------------------------------------------------------------------

    def add_host(
        self,
        name: str,
        model: GpuModel,
        region: str,
        price: int,
        *,
        contend_price: int = 0,
        contend_shares: int = 0,
        overcommit: float = 1.0,
    ) -> SimHost:
        identity = self.identity()
        host = SimHost(
            name,
            identity,
            region,
            model,
            price,
            LeaseBook(identity),
            SimGpu(self.env, model.perf_units),
            contend_price=contend_price,
            contend_shares=contend_shares,
            overcommit=overcommit,
        )
        host.gpu = host.new_gpu(self.env)
        self.hosts[host.peer] = host
        for other, table in self._latency.items():
            table[host.peer] = rtt_ms(other, region)
        self._ranked.clear()  # the latencies rankings were computed from changed
        self.publish(host, host.shares_sold, contend_shares)
        self.env.process(self._refresh(host))
        return host

    def _refresh(self, host: SimHost):
        """Re-announce the offer before it lapses, as ``keep_offer_current`` does."""
        while True:
            yield self.env.timeout(OFFER_TTL_S / 2)
            free = host.lease_book.free_shares("gpu0")
            contend_free = host.lease_book.free_contend_shares("gpu0")
            if host.online and free + contend_free > 0:
                self.publish(host, free)

    def publish(self, host: SimHost, free: int, contend_free: int | None = None) -> None:
        """Re-announce ``host``'s offer with ``free`` shares and ``contend_free`` contending
        ones (what its ``LeaseBook`` has free, when None), or cancel it when no share is
        to be had: its ``LeaseBook`` knows at once, the book a gossip delay later. As
        ``cumulus-node --provide`` does, the book is told of the shares an on-demand
        lease could have, those free and those that preemptible leases hold."""
        host.nonce += 1
        now = self.now()
        if contend_free is None:
            contend_free = host.lease_book.free_contend_shares("gpu0")
        preemptible = host.lease_book.preemptible("gpu0")
        available = free + sum(r.proposal.shares for r in preemptible)
        if available + contend_free > 0:
            message: Offer | Cancel = Offer(
                host.peer,
                "gpu0",
                host.model.name,
                host.model.vram_mib,
                host.model.perf_units,
                available,
                host.price,
                0,
                host.region,
                now,
                now + OFFER_TTL_S,
                host.nonce,
                contend_price=host.contend_price,
                contend_shares=contend_free,
                overcommit_pct=round(100 * host.overcommit),
            )
            if free + contend_free > 0:
                host.lease_book.publish(dataclasses.replace(message, shares_free=free))
        else:  # the LeaseBook keeps the pool, at 0 free, for the shares coming back
            message = Cancel(host.peer, Side.OFFER, "gpu0", now + OFFER_TTL_S, host.nonce)
        delay = gossip_delay_s(self.mesh_nodes, self.rng)
        self.env.process(self._arrive(message, delay))

    def _arrive(self, message: Offer | Cancel, delay: float):
        yield self.env.timeout(delay)
        self.book.insert(message, now=self.now())

    def leave(self, host: SimHost) -> None:
        """``host`` vanishes: its GPU stops, its leases die with it, its offer is cancelled."""
        host.online = False
        host.gpu.fail()
        for job in list(host.jobs):
            if job.is_alive:
                job.interrupt("host gone")
        for reservation in host.lease_book.leases():
            host.lease_book.release(reservation.proposal.lease_id)
        host.lease_book.withdraw("gpu0")
        self.publish(host, 0)

    def rejoin(self, host: SimHost) -> None:
        """``host`` is back, with a fresh GPU and all its shares on offer."""
        host.online = True
        host.gpu = host.new_gpu(self.env)
        self.publish(host, host.shares_sold, host.contend_shares)

    # --- consumers ------------------------------------------------------------------

    def bid(
        self,
        consumer: str,
        *,
        shares: int,
        max_price: int,
        priority: PriorityClass = PriorityClass.ON_DEMAND,
        ids: tuple[str, int] | None = None,
    ) -> Bid:
        """A bid of ``consumer``'s made now, under new ids (``bid_ids``) or ``ids``."""
        now = self.now()
        bid_id, nonce = self.bid_ids() if ids is None else ids
        return Bid(
            consumer,
            bid_id,
            0,
            (),
            0,
            shares,
            max_price,
            priority,
            LEASE_S,
            now,
            now + 600.0,
            nonce,
        )

    def bid_ids(self) -> tuple[str, int]:
        """A new bid's id and nonce, drawn from the run's nonces."""
        return f"b{next(self._nonces)}", next(self._nonces)

    def rank(self, region: str, bid: Bid, *, limit: int = 8) -> list[RankedOffer]:
        """The best ``limit`` offers meeting ``bid``, best first, as a consumer in
        ``region`` ranks them.

        Consumers with nothing to lease bid again every ``RETRY_S``, most of the time
        against a book that has not changed since someone last ranked the same terms. A
        ranking depends only on the book's live orders, the region's latencies, the
        reliability scores and the bid's terms (not its id, nonce or times), so it is
        computed once per book change (``OrderBook.changes``) and reused: the same
        ``rank_offers`` on the same inputs, the same result.
        """
        if self._ranked_at != self.book.changes:
            self._ranked.clear()
            self._ranked_at = self.book.changes
        # The bid's author matters only if it has offers of its own (they are skipped).
        author = bid.consumer if self.book.live_orders_of(bid.consumer) else None
        key = (
            region,
            limit,
            author,
            tuple(self.reliability.items()),
            bid.min_vram_mib,
            bid.gpu_models,
            bid.min_perf_units,
            bid.shares,
            bid.max_price,
            bid.priority,
            bid.duration_s,
            bid.max_overcommit_pct,
            bid.gpus,
        )
        ranked = self._ranked.get(key)
        if ranked is None:
            ranked = self._ranked[key] = rank_offers(
                self.book,
                bid,
                reliability=self.reliability,
                latency_ms=self._latency[region],
                limit=limit,
                policy=self.policy,
            )
        return list(ranked)

    def lease(
        self,
        consumer: NodeIdentity,
        region: str,
        bid: Bid,
        offers: Sequence[Offer],
        *,
        pay_as_bid: bool = False,
        unreachable: Callable[[str], None] = lambda host: None,
    ):
        """Propose to the hosts of ``offers`` (ranked, and chosen by the consumer's
        ``HostChoice``), in order, until one grants (a generator: each proposal costs its
        round trip). Returns a ``Granted`` or None; ``unreachable(host)`` hears of each
        host that did not answer, as the node's shell tells its ``HostChoice``.

        The price proposed is what ``cumulus-node`` proposes (``pricing.proposed_price``:
        the offer's ask, or for a contending bid its contend price); with ``pay_as_bid``,
        the bid's limit, as ``--pay-bid`` proposes: a lease may pay more than the asking
        price, and the executor serves dearer leases first. A contending bid paying its
        limit pays at most the ask (the pricing ``pricing.py`` compares its own with).
        """
        for offer in offers:
            host = self.hosts[offer.host]
            yield self.env.timeout(rtt_ms(region, host.region) / 1000)
            if not host.online:
                self._refused("host unreachable")
                unreachable(offer.host)
                continue
            price = proposed_price(offer, bid, pay_bid=pay_as_bid) or offer.price
            if pay_as_bid and bid.priority is PriorityClass.CONTEND:
                price = min(bid.max_price, offer.price)
            granted = self._propose(consumer, host, offer, bid, price)
            if granted is not None:
                return granted
        return None

    def _propose(self, consumer, host, offer, bid, price) -> Granted | None:
        now = self.now()
        proposal = LeaseProposal(
            f"L{next(self._lease_ids)}",
            bid.consumer,
            host.peer,
            offer.offer_id,
            offer.nonce,
            bid.shares,
            price,
            now,
            LEASE_S,
            bid.priority,
            now + 30.0,
            next(self._nonces),
        )
        raw = seal_message(consumer, proposal, now=now).to_bytes()
        answer = host.lease_book.propose(raw, now=now, sender=bid.consumer)
        if isinstance(answer, Refusal):
            self._refused(answer.reason.value)
            return None
        assert isinstance(answer, Lease)
        self.preempted.update(r.proposal.lease_id for r in host.lease_book.take_preempted())
        self.publish(host, host.lease_book.free_shares("gpu0"))
        granted = Granted(host, proposal, Meter(host.identity, proposal, interval=LEASE_S))
        self.active[proposal.lease_id] = granted
        return granted

    def settle(self, granted: Granted) -> float:
        """End a lease: the host's meter signs a receipt for the time used, the consumer
        checks it, the host gets paid and its shares go back on offer. Returns the cost
        in credits (0 for a lease already settled)."""
        host, proposal = granted.host, granted.proposal
        if self.active.pop(proposal.lease_id, None) is None:
            return 0.0
        now = self.now()
        envelope = granted.meter.issue(now, nonce=next(self._nonces))
        _, receipt = check_receipt(envelope.to_bytes(), proposal, now=now)
        cost = receipt.share_seconds * proposal.price / 3600 / MICRO
        host.earned += cost
        if host.online and host.lease_book.release(proposal.lease_id):
            self.publish(host, host.lease_book.free_shares("gpu0"))
        return cost

    def _refused(self, reason: str) -> None:
        self.refusals[reason] = self.refusals.get(reason, 0) + 1
