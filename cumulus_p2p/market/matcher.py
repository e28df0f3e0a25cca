"""The consumer's local matcher: rank offers for a bid by effective price. Sans-IO.

The book orders offers by their asking price alone. A consumer cares about more: an
unreliable host or a distant one costs more than its price says. The matcher ranks
the offers that meet a bid by

    effective = price * (1 + reliability_weight * (neutral_reliability - reliability))
                      * (1 + latency_ms / latency_scale_ms)

``reliability`` is the host's score in [0, 1] from the reputation room (unknown hosts
get ``neutral_reliability``, so a newcomer is neither favoured nor punished), and
``latency_ms`` the consumer's measured round trip to it (unknown: ``default_latency_ms``).
Both are inputs: the matcher does no I/O.

Walking every offer under the bid's limit would cost O(n). Instead offers are read
from the book cheapest first, and the walk stops once even the best possible
adjustment (perfect reliability, zero latency) cannot bring the next price into the
current top ``limit``.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass

from .._errors import InvalidMessageError
from .book import OrderBook
from .messages import Bid, Offer

__all__ = ["RankedOffer", "RankingPolicy", "effective_price", "rank_offers"]


@dataclass(frozen=True, slots=True)
class RankingPolicy:
    """How reliability and latency adjust prices.

    Attributes:
        neutral_reliability: The score of an unknown host; its price is unadjusted.
        reliability_weight: How strongly reliability moves the price; with the
            defaults, a perfect host's price counts half, a worthless one's 1.5 times.
        latency_scale_ms: The latency that doubles the effective price.
        default_latency_ms: The latency assumed for an unmeasured host.
    """

    neutral_reliability: float = 0.5
    reliability_weight: float = 1.0
    latency_scale_ms: float = 100.0
    default_latency_ms: float = 50.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.neutral_reliability <= 1.0:
            raise InvalidMessageError("neutral_reliability must be in [0, 1]")
        if not 0.0 <= self.reliability_weight or self.best_multiplier <= 0.0:
            raise InvalidMessageError("reliability_weight must keep every multiplier positive")
        if not self.latency_scale_ms > 0.0 or not self.default_latency_ms >= 0.0:
            raise InvalidMessageError("latency_scale_ms must be positive, default latency >= 0")

    @property
    def best_multiplier(self) -> float:
        """The smallest factor any host's price can get (perfect, zero latency)."""
        return 1.0 + self.reliability_weight * (self.neutral_reliability - 1.0)


def effective_price(
    price: int, *, reliability: float, latency_ms: float, policy: RankingPolicy
) -> float:
    """Return ``price`` adjusted for the host's reliability and latency.

    Args:
        price: Asking price, micro-credits per share-hour.
        reliability: Host score; clamped to [0, 1].
        latency_ms: Measured round trip; negatives count as 0.
        policy: The weights.
    """
    reliability = min(1.0, max(0.0, reliability))
    factor = 1.0 + policy.reliability_weight * (policy.neutral_reliability - reliability)
    return price * factor * (1.0 + max(0.0, latency_ms) / policy.latency_scale_ms)


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
    """
    policy = policy or RankingPolicy()
    reliability = reliability or {}
    latency_ms = latency_ms or {}
    best = policy.best_multiplier
    # Max-heap (negated) of the current top `limit`, so the worst is at the front.
    top: list[tuple[float, tuple, RankedOffer]] = []
    for resting in book.candidates(bid):
        offer = resting.order
        if len(top) == limit and offer.price * best > -top[0][0]:
            break
        if resting.remaining < bid.shares:
            continue  # a lease takes its shares from one offer: this one cannot serve it
        score = reliability.get(offer.host, policy.neutral_reliability)
        latency = latency_ms.get(offer.host, policy.default_latency_ms)
        price = effective_price(offer.price, reliability=score, latency_ms=latency, policy=policy)
        key = (offer.price, offer.created_at, offer.host, offer.offer_id)
        ranked = RankedOffer(offer, resting.remaining, price, score, latency)
        entry = (-price, tuple(_Reversed(k) for k in key), ranked)
        if len(top) < limit:
            heapq.heappush(top, entry)
        elif entry > top[0]:
            heapq.heapreplace(top, entry)
    ordered = sorted(top, key=lambda e: (-e[0], tuple(r.value for r in e[1])))
    return [ranked for _, _, ranked in ordered]


@dataclass(frozen=True, slots=True)
class _Reversed:
    """Inverts comparison, so a max-heap on (price, key) keeps ties canonical."""

    value: object

    def __lt__(self, other: _Reversed) -> bool:
        return other.value < self.value  # type: ignore[operator]

    def __gt__(self, other: _Reversed) -> bool:
        return other.value > self.value  # type: ignore[operator]
