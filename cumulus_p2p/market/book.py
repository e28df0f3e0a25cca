"""The order book: live offers and bids, price-time priority, partial fills. Sans-IO.

Theory of operation
-------------------
Offers rest in one sorted list per resource class (GPU model, VRAM), keyed by
``(price, created_at, host, offer_id)``: cheapest first, then oldest, then a canonical
tie-break on the author's peer ID and order id. Bids rest in one sorted list keyed by
``(-max_price, created_at, consumer, bid_id)``: highest limit first. Keys never
involve arrival order, so every node that holds the same messages holds the same
book and computes the same matches.

Each ``(side, author, order_id)`` has a *version*: the highest nonce seen for it and
how long that knowledge must be kept. A message with a higher nonce replaces the
order (amendment), a ``Cancel`` with a higher nonce removes it and stays as a
tombstone, and a message with a lower nonce is ignored. If an author signs two
different messages with the same nonce, the one with the smaller canonical encoding
wins, so even equivocation cannot make two books differ. Versions are kept until the
latest expiry of any message seen for the key; past that, the envelope validator
refuses the old messages as expired, so forgetting is safe.

Inserting never matches: matching is a separate, deterministic step. ``match_bid``
fills one incoming bid against resting offers; ``match`` clears resting bids in bid
priority order, each against the best offers. A fill takes
``min(bid shares left, offer shares left)`` at the price the bid pays there
(``pricing.price_for``: the ask, or for a contending bid the offer's contend price; a
contending fill takes the offer's contending shares), so an offer is never over-filled
and leftovers stay for later bids.

Scale: an insert is a dict update plus a sorted-list insertion (O(log n)); a match
walks offers from the best price (for a contending bid, the best contend price) and
stops at the bid's limit or when it is filled.

Bounds (``BookLimits``)
-----------------------
Signed messages cost an attacker nothing but a key, so a book that took every valid
order would grow without bound under a flood of fresh offer ids. A bounded book caps:

- the live orders of one author on each side (a rig has a handful of GPUs): a new
  order over the cap is refused (``OVER_AUTHOR_CAP``); amending or cancelling one the
  author already has is always allowed, so an honest host re-announcing is unaffected;
- the versions one author may make the book remember (tombstones included), so a flood
  of cancels for orders never seen cannot grow it either;
- the whole book: at ``max_orders`` a new order evicts one from the author that holds
  the most, preferring authors with no evidence behind them (``vouch``). A newcomer
  never evicts a vouched author's order, and never one from an author that holds fewer
  orders than it would: the flood evicts itself first (``BOOK_FULL``).

Bounds depend on arrival order, so two bounded books that were flooded differently may
differ; every honest author stays under its cap and is held the same everywhere.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from sortedcontainers import SortedList

from .messages import Bid, Cancel, Offer, PriorityClass, Side, encode_message
from .pricing import paid_on

__all__ = ["BookLimits", "BookStatistics", "Fill", "InsertStatus", "OrderBook", "RestingOrder"]

#: An offer or a bid: what a ``RestingOrder`` holds says which side it rests on.
OrderT = TypeVar("OrderT", Offer, Bid)


class InsertStatus(enum.Enum):
    """What ``OrderBook.insert`` did with a message."""

    ADDED = "added"
    REPLACED = "replaced an older version"
    CANCELLED = "cancelled"
    DUPLICATE = "duplicate"
    SUPERSEDED = "superseded by a newer nonce"
    EQUIVOCATION = "another message with the same nonce exists"
    EXPIRED = "expired"
    OVER_AUTHOR_CAP = "the author already has as many orders as it may"
    BOOK_FULL = "the book is full of orders from authors with more evidence or fewer orders"

    @property
    def changed_book(self) -> bool:
        """Whether the book's live orders changed."""
        return self in (InsertStatus.ADDED, InsertStatus.REPLACED, InsertStatus.CANCELLED)


@dataclass(frozen=True, slots=True)
class Fill:
    """Shares of one offer matched to one bid, at the price the bid pays there."""

    consumer: str
    bid_id: str
    host: str
    offer_id: str
    offer_nonce: int
    shares: int
    price: int
    priority: PriorityClass


@dataclass(frozen=True, slots=True)
class RestingOrder(Generic[OrderT]):
    """A live order and the shares it has left (``RestingOrder[Offer]`` for an offer);
    an offer's contending shares left beside its on-demand ones."""

    order: OrderT
    remaining: int
    contend_remaining: int = 0


@dataclass(frozen=True, slots=True)
class BookStatistics:
    """Counts of what the book holds."""

    offers: int
    bids: int
    resource_classes: int
    versions: int
    #: The most live orders any one author has on one side.
    most_per_author: int = 0
    #: Orders evicted so far to make room in a full book.
    evicted: int = 0


@dataclass(frozen=True, slots=True)
class BookLimits:
    """Bounds on what one author, and everyone together, may make a book hold.

    Attributes:
        max_orders_per_author: Live orders one author may have on each side. A rig
            offers one order per device; 8 covers an 8-GPU server (``--max-offers-per-
            author``).
        max_versions_per_author: Order ids one author may make the book remember,
            live, cancelled or filled, until they expire.
        max_orders: Live orders in the whole book.
    """

    max_orders_per_author: int = 8
    max_versions_per_author: int = 64
    max_orders: int = 20_000

    def __post_init__(self) -> None:
        if not 1 <= self.max_orders_per_author <= self.max_versions_per_author:
            raise ValueError("need 1 <= max_orders_per_author <= max_versions_per_author")
        if self.max_orders < self.max_orders_per_author:
            raise ValueError("max_orders must hold at least one author's orders")


#: No bounds: for books built from messages already bounded elsewhere (simulations).
UNBOUNDED = BookLimits(2**62, 2**62, 2**62)


@dataclass(slots=True)
class _Version:
    nonce: int
    retain_until: float
    # The winning message for this nonce (an order, or the cancel's tombstone).
    message: Offer | Bid | Cancel


@dataclass(slots=True)
class _Live(Generic[OrderT]):
    order: OrderT
    key: tuple
    remaining: int
    #: An offer's contending shares left (``Offer.contend_shares``); 0 for a bid.
    contend_remaining: int = 0

    def left_for(self, bid: Bid) -> int:
        """The shares of this offer left to ``bid``: contending ones to a contending bid."""
        return self.contend_remaining if bid.priority is PriorityClass.CONTEND else self.remaining

    def take_for(self, bid: Bid, shares: int) -> None:
        """Take ``shares`` from the ones ``left_for(bid)`` counts."""
        if bid.priority is PriorityClass.CONTEND:
            self.contend_remaining -= shares
        else:
            self.remaining -= shares


@dataclass(slots=True)
class _ClassIndex:
    gpu_model: str
    vram_mib: int
    keys: SortedList = field(default_factory=SortedList)
    #: Offers that sell contending leases, by ``_contend_key``.
    contend_keys: SortedList = field(default_factory=SortedList)


def _contend_key(offer: Offer) -> tuple:
    return (offer.contend_price, offer.created_at, offer.host, offer.offer_id)


def _offer_key(offer: Offer) -> tuple:
    return (offer.price, offer.created_at, offer.host, offer.offer_id)


def _bid_key(bid: Bid) -> tuple:
    return (-bid.max_price, bid.created_at, bid.consumer, bid.bid_id)


def meets_terms(offer: Offer, bid: Bid) -> bool:
    """Whether ``offer`` meets ``bid``'s terms beyond its device class and price: the
    performance it needs, a minimum lease within its duration, no more overcommitted
    memory than it accepts, and another author."""
    return (
        offer.perf_units >= bid.min_perf_units
        and offer.min_lease_s <= bid.duration_s
        and offer.overcommit_pct <= bid.max_overcommit_pct
        and offer.host != bid.consumer
    )


class OrderBook:
    """Every live offer and bid this node knows, for all resource classes.

    Feed it messages that passed the envelope validator and ``open_message``; it
    trusts that their authors signed them. All methods take ``now`` where time matters
    and never read a clock.

    Args:
        limits: Bounds per author and on the whole book (see the module docstring);
            unbounded if omitted.
    """

    def __init__(self, limits: BookLimits = UNBOUNDED) -> None:
        self.limits = limits
        # Live orders per (side, author), versions per author, authors with evidence.
        self._live_counts: dict[tuple[Side, str], int] = {}
        self._version_counts: dict[str, int] = {}
        self._vouched: set[str] = set()
        self.evicted = 0
        #: Bumped whenever the live orders change (added, replaced, removed or filled):
        #: whatever a reader computed from them holds until it moves, so it may be kept.
        self.changes = 0
        self._classes: dict[tuple[str, int], _ClassIndex] = {}
        self._offers: dict[tuple[str, str], _Live[Offer]] = {}
        self._bids: dict[tuple[str, str], _Live[Bid]] = {}
        self._bid_keys = SortedList()
        self._versions: dict[tuple[Side, str, str], _Version] = {}
        # (time, tie, side, author, order_id, nonce): nonce -1 marks a version deadline.
        self._deadlines: list[tuple[float, int, Side, str, str, int]] = []
        self._tie = itertools.count()

    # -- inserting ----------------------------------------------------------------------

    def insert(self, message: Offer | Bid | Cancel, *, now: float) -> InsertStatus:
        """Add, replace or cancel an order.

        Args:
            message: An authenticated offer, bid or cancel.
            now: The current Unix time.

        Returns:
            What happened. Only ``ADDED``, ``REPLACED`` and ``CANCELLED`` change the
            live orders; the other statuses leave the book as it was.
        """
        if message.expires_at <= now:
            return InsertStatus.EXPIRED
        if isinstance(message, Offer):
            side, author, order_id = Side.OFFER, message.host, message.offer_id
        elif isinstance(message, Bid):
            side, author, order_id = Side.BID, message.consumer, message.bid_id
        else:
            side, author, order_id = message.side, message.author, message.order_id
        vkey = (side, author, order_id)
        version = self._versions.get(vkey)
        if version is not None:
            if message.expires_at > version.retain_until:
                version.retain_until = message.expires_at
                self._push_deadline(message.expires_at, side, author, order_id, -1)
            if message.nonce < version.nonce:
                return InsertStatus.SUPERSEDED
            if message.nonce == version.nonce:
                if message == version.message:
                    return InsertStatus.DUPLICATE
                if encode_message(message) >= encode_message(version.message):
                    return InsertStatus.EQUIVOCATION
            refused = self._refusal(message, side, author, order_id)
            if refused is not None:
                return refused
            version.nonce = message.nonce
            version.message = message
            replaced = self._remove_live(side, author, order_id)
        else:
            if self._version_counts.get(author, 0) >= self.limits.max_versions_per_author:
                return InsertStatus.OVER_AUTHOR_CAP
            refused = self._refusal(message, side, author, order_id)
            if refused is not None:
                return refused
            self._version_counts[author] = self._version_counts.get(author, 0) + 1
            self._versions[vkey] = _Version(message.nonce, message.expires_at, message)
            self._push_deadline(message.expires_at, side, author, order_id, -1)
            replaced = False
        if isinstance(message, Cancel):
            return InsertStatus.CANCELLED
        self._add_live(message, author, order_id)
        if message.expires_at < self._versions[vkey].retain_until:
            # Otherwise the version's own deadline drops the order, with one heap entry.
            self._push_deadline(message.expires_at, side, author, order_id, message.nonce)
        return InsertStatus.REPLACED if replaced else InsertStatus.ADDED

    def _refusal(
        self, message: Offer | Bid | Cancel, side: Side, author: str, order_id: str
    ) -> InsertStatus | None:
        """Why a message that would add a live order may not, after making room for it
        if the book is full; ``None`` when it may (an amendment or a cancel always may)."""
        table = self._offers if side is Side.OFFER else self._bids
        if isinstance(message, Cancel) or (author, order_id) in table:
            return None
        if self._live_counts.get((side, author), 0) >= self.limits.max_orders_per_author:
            return InsertStatus.OVER_AUTHOR_CAP
        if len(self._offers) + len(self._bids) < self.limits.max_orders:
            return None
        victim = self._eviction_victim(author)
        if victim is None:
            return InsertStatus.BOOK_FULL
        victim_side, victim_author = victim
        victims = self._offers if victim_side is Side.OFFER else self._bids
        # The victim's order with the greatest id: which one goes is deterministic.
        victim_id = max(oid for (a, oid) in victims if a == victim_author)
        self._remove_live(victim_side, victim_author, victim_id)
        self.evicted += 1
        return None

    def _eviction_victim(self, author: str) -> tuple[Side, str] | None:
        """The (side, author) to evict an order from for ``author``'s new one, or None.

        O(authors) per eviction, which happens only while the book is full.
        """
        newcomer = author not in self._vouched
        own = max(
            self._live_counts.get((Side.OFFER, author), 0),
            self._live_counts.get((Side.BID, author), 0),
        )
        best: tuple[bool, int, str, str] | None = None
        victim: tuple[Side, str] | None = None
        for (side, other), count in self._live_counts.items():
            vouched = other in self._vouched
            if vouched and newcomer:
                continue  # a newcomer never pushes out an author with evidence
            # Among equals, only an author holding more than the newcomer would after
            # inserting; a vouched author pushes out any newcomer.
            if (newcomer or vouched) and count <= own + 1:
                continue
            candidate = (not vouched, count, other, str(side.value))
            if best is None or candidate > best:
                best, victim = candidate, (side, other)
        return victim

    # -- evidence -----------------------------------------------------------------------

    def vouch(self, author: str) -> None:
        """``author`` has evidence behind it (paid leases, a probe answered): a full book
        evicts newcomers' orders before its own."""
        self._vouched.add(author)

    def vouched(self, author: str) -> bool:
        """Whether ``author`` was vouched for."""
        return author in self._vouched

    def live_orders_of(self, author: str, side: Side = Side.OFFER) -> int:
        """How many live orders ``author`` has on ``side``."""
        return self._live_counts.get((side, author), 0)

    def _add_live(self, order: Offer | Bid, author: str, order_id: str) -> None:
        self.changes += 1
        if isinstance(order, Offer):
            key = _offer_key(order)
            resource_class = (order.gpu_model, order.vram_mib)
            index = self._classes.get(resource_class)
            if index is None:
                index = self._classes[resource_class] = _ClassIndex(*resource_class)
            index.keys.add(key)
            if order.contend_price:
                index.contend_keys.add(_contend_key(order))
            live = _Live(order, key, order.shares_free, order.contend_shares)
            self._offers[(author, order_id)] = live
            count_key = (Side.OFFER, author)
        else:
            key = _bid_key(order)
            self._bid_keys.add(key)
            self._bids[(author, order_id)] = _Live(order, key, order.shares * order.gpus)
            count_key = (Side.BID, author)
        self._live_counts[count_key] = self._live_counts.get(count_key, 0) + 1

    def _remove_live(self, side: Side, author: str, order_id: str) -> bool:
        if side is Side.OFFER:
            offer = self._offers.pop((author, order_id), None)
            if offer is None:
                return False
            index = self._classes[offer.order.resource_class]
            index.keys.remove(offer.key)
            if offer.order.contend_price:
                index.contend_keys.remove(_contend_key(offer.order))
            if not index.keys:
                del self._classes[offer.order.resource_class]
        else:
            bid = self._bids.pop((author, order_id), None)
            if bid is None:
                return False
            self._bid_keys.remove(bid.key)
        self.changes += 1
        left = self._live_counts[(side, author)] - 1
        if left:
            self._live_counts[(side, author)] = left
        else:
            del self._live_counts[(side, author)]
        return True

    def _push_deadline(self, at: float, side: Side, author: str, order_id: str, nonce: int) -> None:
        heapq.heappush(self._deadlines, (at, next(self._tie), side, author, order_id, nonce))

    # -- expiry -------------------------------------------------------------------------

    def expire(self, now: float) -> int:
        """Drop orders (and forget versions) that have expired by ``now``.

        Returns:
            How many live orders were dropped.
        """
        dropped = 0
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            _, _, side, author, order_id, nonce = heapq.heappop(deadlines)
            if nonce < 0:
                version = self._versions.get((side, author, order_id))
                if version is not None and version.retain_until <= now:
                    del self._versions[(side, author, order_id)]
                    left = self._version_counts[author] - 1
                    if left:
                        self._version_counts[author] = left
                    else:
                        del self._version_counts[author]
            # A version deadline also stands for an order that expires with it (no entry
            # of its own was pushed), even if the version itself was since extended.
            live = (self._offers if side is Side.OFFER else self._bids).get((author, order_id))
            if live is not None and live.order.expires_at <= now:
                dropped += self._remove_live(side, author, order_id)
        return dropped

    # -- matching -----------------------------------------------------------------------

    def candidates(self, bid: Bid) -> Iterator[RestingOrder[Offer]]:
        """Offers that meet ``bid``'s requirements and limit, best first.

        Best means price-time priority: lowest price, then earliest ``created_at``,
        then the canonical tie-break. A contending bid pays the contend price
        (``pricing.price_for``), so it gets the offers that sell contending leases, by
        that price. Offers from the bid's own author, and those with no shares left to
        the bid, are skipped. Do not change the book while iterating.
        """
        ceiling = (bid.max_price, math.inf)
        classes = [
            index
            for index in self._classes.values()
            if index.vram_mib >= bid.min_vram_mib
            and (not bid.gpu_models or index.gpu_model in bid.gpu_models)
        ]
        contending = bid.priority is PriorityClass.CONTEND
        keys = [(c.contend_keys if contending else c.keys) for c in classes]
        yield from self._meeting(bid, _merged([k.irange(maximum=ceiling) for k in keys]))

    def _meeting(self, bid: Bid, keys: Iterable[tuple]) -> Iterator[RestingOrder[Offer]]:
        """The offers under ``keys`` (host and offer id last) that meet ``bid``'s needs."""
        offers = self._offers
        for key in keys:
            live = offers[(key[2], key[3])]
            order = live.order
            left = live.left_for(bid)
            if left > 0 and meets_terms(order, bid):
                yield RestingOrder(order, left)

    def match_bid(self, bid: Bid, *, now: float) -> list[Fill]:
        """Fill an incoming bid against resting offers and take the shares from them.

        The bid itself is not rested; insert it for that. An expired bid fills nothing.

        Args:
            bid: The bid to fill.
            now: The current Unix time; expired orders are dropped first.

        Returns:
            The fills, best offer first; their shares sum to at most ``bid.shares``. A bid
            for several GPUs fills whole or not at all: ``bid.shares`` from each of
            ``bid.gpus`` offers.
        """
        self.expire(now)
        if bid.expires_at <= now:
            return []
        return self._fill(bid, bid.shares * bid.gpus)

    def match(self, *, now: float) -> list[Fill]:
        """Clear resting bids against resting offers, best bid first.

        Filled shares are taken from both sides; fully filled orders leave the book,
        partly filled ones stay with what is left. The result depends only on the set
        of live orders, never on the order in which they arrived.

        Returns:
            All fills, in the order they were made.
        """
        self.expire(now)
        fills: list[Fill] = []
        for key in list(self._bid_keys):
            live = self._bids[(key[2], key[3])]
            made = self._fill(live.order, live.remaining)
            if not made:
                continue
            fills.extend(made)
            self.changes += 1
            live.remaining -= sum(f.shares for f in made)
            if live.remaining == 0:
                self._remove_live(Side.BID, key[2], key[3])
        return fills

    def _fill(self, bid: Bid, wanted: int) -> list[Fill]:
        taken = self._gang(bid) if bid.gpus > 1 else self._spread(bid, wanted)
        fills = []
        for offer, shares in taken:
            live = self._offers[(offer.host, offer.offer_id)]
            self.changes += 1
            live.take_for(bid, shares)
            if live.remaining == 0 and live.contend_remaining == 0:
                self._remove_live(Side.OFFER, offer.host, offer.offer_id)
            fills.append(
                Fill(
                    bid.consumer,
                    bid.bid_id,
                    offer.host,
                    offer.offer_id,
                    offer.nonce,
                    shares,
                    paid_on(offer, bid),
                    bid.priority,
                )
            )
        return fills

    def _spread(self, bid: Bid, wanted: int) -> list[tuple[Offer, int]]:
        """Up to ``wanted`` shares, from the best offers on."""
        taken: list[tuple[Offer, int]] = []
        for resting in self.candidates(bid):
            shares = min(wanted, resting.remaining)
            taken.append((resting.order, shares))
            wanted -= shares
            if wanted == 0:
                break
        return taken

    def _gang(self, bid: Bid) -> list[tuple[Offer, int]]:
        """``bid.shares`` from each of the ``bid.gpus`` best offers that have them, or
        nothing: a job of N GPUs cannot start on fewer. (The book knows no distances:
        the consumer's own choice among hosts is ``market.gang``.)"""
        taken: list[tuple[Offer, int]] = []
        for resting in self.candidates(bid):
            if resting.remaining >= bid.shares:
                taken.append((resting.order, bid.shares))
                if len(taken) == bid.gpus:
                    return taken
        return []

    # -- inspection ---------------------------------------------------------------------

    def get(
        self, side: Side, author: str, order_id: str
    ) -> RestingOrder[Offer] | RestingOrder[Bid] | None:
        """The live order ``(side, author, order_id)``, or ``None``."""
        if side is Side.OFFER:
            offer = self._offers.get((author, order_id))
            if offer is None:
                return None
            return RestingOrder(offer.order, offer.remaining, offer.contend_remaining)
        bid = self._bids.get((author, order_id))
        return None if bid is None else RestingOrder(bid.order, bid.remaining)

    def offers(self) -> Iterator[RestingOrder[Offer]]:
        """Every live offer, in no particular order."""
        return (
            RestingOrder(live.order, live.remaining, live.contend_remaining)
            for live in self._offers.values()
        )

    def bids(self) -> Iterator[RestingOrder[Bid]]:
        """Every live bid, in priority order (highest limit, then oldest, then key)."""
        return (
            RestingOrder(live.order, live.remaining)
            for live in (self._bids[(k[2], k[3])] for k in self._bid_keys)
        )

    def snapshot(self) -> tuple[tuple[Side, str, str, int, int], ...]:
        """A canonical summary of the live orders: ``(side, author, id, nonce, left)``.

        Two books with equal snapshots hold the same live orders.
        """
        rows = [
            (side, author, order_id, live.order.nonce, live.remaining)
            for side, table in ((Side.OFFER, self._offers), (Side.BID, self._bids))
            for (author, order_id), live in table.items()
        ]
        return tuple(sorted(rows))

    def statistics(self) -> BookStatistics:
        """How much the book holds."""
        return BookStatistics(
            len(self._offers),
            len(self._bids),
            len(self._classes),
            len(self._versions),
            max(self._live_counts.values(), default=0),
            self.evicted,
        )


def _merged(lists: list) -> Iterable[tuple]:
    """Sorted key lists as one sorted stream."""
    return heapq.merge(*lists) if len(lists) != 1 else lists[0]
