"""The consumer's local matcher: rank offers for a bid by effective price. Sans-IO.

The book orders offers by their asking price alone. A consumer cares about more: an
unreliable host or a distant one costs more than its price says. The matcher ranks
the offers that meet a bid by what the bid pays there (``pricing.price_for``: the ask, or
for a contending bid the offer's contend price)

    effective = paid * (1 + reliability_weight * (neutral_reliability - reliability))
                      * (1 + latency_ms / latency_scale_ms)
                      * (1 + overcommit_weight * (overcommit_pct - 100) / 100)

``reliability`` is the host's score in [0, 1] from the reputation room (unknown hosts
get ``neutral_reliability``, so a newcomer is neither favoured nor punished), and
``latency_ms`` the consumer's measured round trip to it (unknown: ``default_latency_ms``).
Both are inputs: the matcher does no I/O. ``overcommit_pct`` is the offer's own: a host
that sells more memory than it has (``Offer.overcommit_pct``, 100-200) pages idle
tenants out, and a tenant paged out pays the copies back in on the device, so a
share-hour there buys less work. The pooling simulation measured 1.26-1.66x the
slowdown at 1.5x and 1.67-2.23x at 2x (inference to the mix, ``simulations/README.md``);
the default weight, 0.5, counts the lower end: a 2x offer ranks as 1.5 times its price.

Walking every offer under the bid's limit would cost O(n). Instead offers are read
from the book cheapest first, and the walk stops once even the best possible
adjustment (perfect reliability, zero latency) cannot bring the next price into the
current top ``limit``.

Cost of entry
-------------
Price alone lets junk win: a signed offer at a millionth of the market costs a flooder
nothing, and no reliability adjustment (at most 1.5x) outweighs it. So a consumer may
rank by *entry* first (``Entry``, from ``entry_of``): hosts with a record (evidence of
paid leases) before newcomers, and newcomers priced like the market before newcomers
priced far below it (``EntryPolicy``: under a fraction of the median recorded price of
their resource class, or with no recorded offer in the class, of the bid's own limit).
Within an entry tier, the effective price decides as before. Ranking by entry walks
every candidate (O(n), n bounded by the book's ``BookLimits``).

A newcomer's offer counts for matching only once its host has answered a liveness probe
(``market.liveness``): given ``alive``, ``entry_of`` puts a newcomer that has not
(``Entry.UNPROVEN``) after every other, and ``proposal_batch`` never proposes to it. The
consumer's batch of proposals (``proposal_batch``) keeps one slot for the best proven
newcomer, and a share of matches try proven newcomers first, so the market stays open to
hosts with no record while a flood of hosts that answer nothing takes no slot at all.
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .._errors import InvalidMessageError
from .book import OrderBook
from .messages import MAX_PRICE, Bid, Offer
from .pricing import least_price, paid_on

__all__ = [
    "Entry",
    "EntryPolicy",
    "RankedOffer",
    "RankingPolicy",
    "Standing",
    "effective_price",
    "entry_of",
    "near_first",
    "proposal_batch",
    "rank_offers",
    "standing",
]


@dataclass(frozen=True, slots=True)
class RankingPolicy:
    """How reliability and latency adjust prices.

    Attributes:
        neutral_reliability: The score of an unknown host; its price is unadjusted.
        reliability_weight: How strongly reliability moves the price; with the
            defaults, a perfect host's price counts half, a worthless one's 1.5 times.
        latency_scale_ms: The latency that doubles the effective price.
        default_latency_ms: The latency assumed for an unmeasured host.
        overcommit_weight: How much an overcommitted offer's price counts extra, per 100
            points of overcommit (a 2x offer: 1 + the weight).
    """

    neutral_reliability: float = 0.5
    reliability_weight: float = 1.0
    latency_scale_ms: float = 100.0
    default_latency_ms: float = 50.0
    overcommit_weight: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.neutral_reliability <= 1.0:
            raise InvalidMessageError("neutral_reliability must be in [0, 1]")
        if not 0.0 <= self.reliability_weight or self.best_multiplier <= 0.0:
            raise InvalidMessageError("reliability_weight must keep every multiplier positive")
        if not self.latency_scale_ms > 0.0 or not self.default_latency_ms >= 0.0:
            raise InvalidMessageError("latency_scale_ms must be positive, default latency >= 0")
        if not self.overcommit_weight >= 0.0:
            raise InvalidMessageError("overcommit_weight must not be negative")

    @property
    def best_multiplier(self) -> float:
        """The smallest factor any host's price can get (perfect, zero latency)."""
        return 1.0 + self.reliability_weight * (self.neutral_reliability - 1.0)


def effective_price(
    price: int,
    *,
    reliability: float,
    latency_ms: float,
    policy: RankingPolicy,
    overcommit_pct: int = 100,
) -> float:
    """Return ``price`` adjusted for the host's reliability, latency and overcommit.

    Args:
        price: Asking price, micro-credits per share-hour.
        reliability: Host score; clamped to [0, 1].
        latency_ms: Measured round trip; negatives count as 0.
        policy: The weights.
        overcommit_pct: The offer's memory sold over memory held, in percent (100: none).
    """
    reliability = min(1.0, max(0.0, reliability))
    factor = 1.0 + policy.reliability_weight * (policy.neutral_reliability - reliability)
    factor *= 1.0 + policy.overcommit_weight * max(0, overcommit_pct - 100) / 100
    return price * factor * (1.0 + max(0.0, latency_ms) / policy.latency_scale_ms)


class Entry(enum.IntEnum):
    """How far a host has paid its cost of entry, best first (see the module docstring)."""

    #: Evidence of paid leases (or a lease with this consumer).
    RECORD = 0
    #: No record, priced like the market.
    NEWCOMER = 1
    #: No record, priced far below the market for its class.
    SUSPECT = 2
    #: No record, and no answer to a liveness probe yet: it does not count for matching.
    UNPROVEN = 3


@dataclass(frozen=True, slots=True)
class EntryPolicy:
    """When a newcomer's price is too good to be true.

    Attributes:
        below_market: A newcomer's price under this fraction of the median price that
            hosts with a record ask for the same resource class is suspect.
        below_limit: With no recorded offer in the class, a price under this fraction
            of the bid's limit is suspect (a consumer willing to pay 1 credit is not
            offered an H100 for a millionth of one).
    """

    below_market: float = 0.25
    below_limit: float = 0.001


def entry_of(
    book: OrderBook,
    bid: Bid,
    has_record: Callable[[str], bool],
    policy: EntryPolicy | None = None,
    *,
    alive: Callable[[str], bool] | None = None,
) -> Callable[[Offer], Entry]:
    """Return ``entry(offer)`` for the offers that meet ``bid``.

    Args:
        book: The consumer's order book.
        bid: The bid being matched.
        has_record: Whether a host has a record (evidence of paid leases).
        policy: The thresholds; the defaults if omitted.
        alive: Whether a host with no record has answered a liveness probe; a newcomer
            that has not is ``Entry.UNPROVEN``. Omitted: every newcomer counts.
    """
    policy = policy or EntryPolicy()
    recorded: dict[tuple[str, int], list[int]] = {}
    for resting in book.candidates(bid):
        if has_record(resting.order.host):
            recorded.setdefault(resting.order.resource_class, []).append(resting.order.price)
    floors = {c: policy.below_market * statistics.median(p) for c, p in recorded.items()}
    floor_without = policy.below_limit * bid.max_price

    def entry(offer: Offer) -> Entry:
        if has_record(offer.host):
            return Entry.RECORD
        if alive is not None and not alive(offer.host):
            return Entry.UNPROVEN
        floor = floors.get(offer.resource_class, floor_without)
        return Entry.SUSPECT if offer.price < floor else Entry.NEWCOMER

    return entry


def proposal_batch(
    hosts: Sequence[str],
    entries: Mapping[str, Entry],
    *,
    at_once: int,
    newcomers_first: bool = False,
) -> list[str]:
    """The hosts to propose to at once, best first.

    The first ``at_once`` of ``hosts`` (usable, best first) that count for matching, with
    the best proven newcomer in the last slot if none is among them. Unproven hosts never
    enter a batch, so they never take the newcomer slot.

    Args:
        hosts: Usable hosts, best first (``HostChoice``'s ``Propose``).
        entries: Each host's entry tier; a host missing counts as ``Entry.NEWCOMER``.
        at_once: Proposals in flight at once.
        newcomers_first: This match is one of the newcomers' share: hosts priced like the
            market with no record (``Entry.NEWCOMER``) come first.
    """

    def tier(host: str) -> Entry:
        return entries.get(host, Entry.NEWCOMER)

    ordered = [h for h in hosts if tier(h) is not Entry.UNPROVEN]
    if newcomers_first:
        ordered.sort(key=lambda h: tier(h) is not Entry.NEWCOMER)
    batch = ordered[:at_once]
    if all(tier(h) is Entry.RECORD for h in batch):
        newcomer = next((h for h in ordered if tier(h) is not Entry.RECORD), None)
        if newcomer is not None:
            batch = [*batch[: at_once - 1], newcomer]
    return batch


def near_first(
    hosts: Sequence[str],
    entries: Mapping[str, Entry],
    regions: Mapping[str, str],
    region: str,
    *,
    rig: str = "",
    devices: Mapping[str, int] | None = None,
    wanted: int = 1,
) -> list[str]:
    """``hosts`` (best first, by entry tier) with the closest ahead of the others of their
    tier, each group in its order. The ranks of a job of several GPUs exchange gradients,
    so they had better be close: on one rig closest of all, else in one region (an
    offer's region is the hint of where a host is). So within a tier come first ``rig``
    (the host the job's first rank holds), then hosts offering ``devices`` enough for
    ``wanted`` ranks, then hosts in ``region``. Trust comes first: a nearby newcomer does
    not pass a host with a record. Without hints (a job of one GPU) the ranking stands."""
    if not (region or rig or wanted > 1):
        return list(hosts)
    offered = devices or {}

    def closeness(host: str) -> tuple:
        return (
            entries.get(host, Entry.NEWCOMER),
            host != rig,
            offered.get(host, 1) < wanted,
            bool(region) and regions.get(host) != region,
        )

    return sorted(hosts, key=closeness)


@dataclass(frozen=True, slots=True)
class RankedOffer:
    """An offer that meets a bid, with the numbers it was ranked by."""

    offer: Offer
    remaining: int
    effective_price: float
    reliability: float
    latency_ms: float


def rank_offers(
    book: OrderBook,
    bid: Bid,
    *,
    reliability: Mapping[str, float] | None = None,
    latency_ms: Mapping[str, float] | None = None,
    limit: int = 10,
    policy: RankingPolicy | None = None,
    entry: Callable[[Offer], int] | None = None,
) -> list[RankedOffer]:
    """Return the best ``limit`` offers for ``bid``, lowest effective price first.

    Only offers with at least ``bid.shares`` free are ranked: a lease takes all its shares
    from one offer, so a host with fewer left would refuse it.

    Ties break on the book's canonical key (price, created_at, host, offer_id), so the
    ranking is deterministic.

    Args:
        book: The consumer's order book.
        bid: What the consumer wants; only offers meeting it and its limit are ranked.
        reliability: Host peer ID to score in [0, 1]; missing hosts are neutral.
        latency_ms: Host peer ID to measured latency; missing hosts get the default.
        limit: How many offers to return.
        policy: The weights; the defaults if omitted.
        entry: Ranks before the effective price when given (``entry_of``): lower first.
    """
    policy = policy or RankingPolicy()
    reliability = reliability or {}
    latency_ms = latency_ms or {}
    if entry is not None:
        return _rank_by_entry(book, bid, reliability, latency_ms, limit, policy, entry)
    best = policy.best_multiplier
    # Max-heap (negated) of the current top `limit`, so the worst is at the front. Ties
    # break on the canonical key (paid, created_at, host, offer_id), the order in which
    # candidates() yields the offers: so an offer's place in the walk stands for its key,
    # and (-price, -place) orders the heap as (price, key) reversed would.
    top: list[tuple[float, int, RankedOffer]] = []
    for place, resting in enumerate(book.candidates(bid)):
        offer = resting.order
        paid = paid_on(offer, bid)  # never falls along candidates(): the early end holds
        if len(top) == limit and paid * best > -top[0][0]:
            break
        if resting.remaining < bid.shares:
            continue  # a lease takes its shares from one offer: this one cannot serve it
        ranked = _ranked(offer, resting.remaining, paid, reliability, latency_ms, policy)
        item = (-ranked.effective_price, -place, ranked)
        if len(top) < limit:
            heapq.heappush(top, item)
        elif item > top[0]:
            heapq.heapreplace(top, item)
    # Places differ, so the sort never compares the offers themselves.
    return [ranked for _, _, ranked in sorted(top, reverse=True)]


def _rank_by_entry(
    book: OrderBook,
    bid: Bid,
    reliability: Mapping[str, float],
    latency_ms: Mapping[str, float],
    limit: int,
    policy: RankingPolicy,
    entry: Callable[[Offer], int],
) -> list[RankedOffer]:
    rows = []
    for resting in book.candidates(bid):
        offer = resting.order
        if resting.remaining < bid.shares:
            continue
        paid = paid_on(offer, bid)
        ranked = _ranked(offer, resting.remaining, paid, reliability, latency_ms, policy)
        price = ranked.effective_price
        key = (entry(offer), price, paid, offer.created_at, offer.host, offer.offer_id)
        rows.append((key, ranked))
    return [ranked for _, ranked in heapq.nsmallest(limit, rows, key=lambda row: row[0])]


def _ranked(
    offer: Offer,
    remaining: int,
    paid: int,
    reliability: Mapping[str, float],
    latency_ms: Mapping[str, float],
    policy: RankingPolicy,
) -> RankedOffer:
    """``offer`` at the effective price of ``paid`` there."""
    score = reliability.get(offer.host, policy.neutral_reliability)
    latency = latency_ms.get(offer.host, policy.default_latency_ms)
    price = effective_price(
        paid,
        reliability=score,
        latency_ms=latency,
        policy=policy,
        overcommit_pct=offer.overcommit_pct,
    )
    return RankedOffer(offer, remaining, price, score, latency)


@dataclass(frozen=True, slots=True)
class Standing:
    """Where a bid that matches nothing stands in the book.

    Attributes:
        bids_ahead: Other consumers' bids before it in the book's bid order (a higher
            limit, or the same limit made earlier).
        run_now_price: The least it could pay per share-hour for a lease now: over the
            offers that meet its other needs with its shares free, the ask, or for a
            contending bid the contend price. None: no offer does.
    """

    bids_ahead: int
    run_now_price: int | None


def standing(book: OrderBook, bid: Bid) -> Standing:
    """Where ``bid`` stands: the bids ahead of it, and the price that would run it now."""
    ahead = sum(
        1
        for resting in book.bids()
        if resting.order.consumer != bid.consumer
        and (-resting.order.max_price, resting.order.created_at) < (-bid.max_price, bid.created_at)
    )
    any_price = dataclasses.replace(bid, max_price=MAX_PRICE)
    prices = (
        least_price(r.order, bid.priority) or r.order.price
        for r in book.candidates(any_price)
        if r.remaining >= bid.shares
    )
    return Standing(ahead, min(prices, default=None))
