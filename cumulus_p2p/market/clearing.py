"""What GPUs cost now: per GPU model, the ask, the contending floor and recent clearings.

Theory of operation
-------------------
A user choosing a bid wants three prices per GPU model: the cheapest on-demand ask with
shares free, the cheapest contending floor with contending shares free (both read from the
live offers in the book), and what leases actually cleared at lately. No node sees other
nodes' leases directly, but every node receives their *service records*: reputation
reports that carry a lease signed by both its consumer and its host (``reputation``
checks both signatures and the receipts before accepting one). Each accepted record's
lease is one clearing: its price, class and shares. A lease names its host's offer, so
the node resolves the GPU model from the offers it has seen.

A consumer reports its leases when its job ends, so a clearing is kept for ``window_s``
after the node first saw it (an hour by default), and a lease whose term ended before the
window began is not counted: a long job's price counts, an old one's does not. At most
``max_leases`` are kept, the oldest dropped first, and each lease counts once however
often it is reported. The price shown is the median of the window's leases, weighted by
shares: a few leases at odd prices (a host and consumer colluding) move it only as far as
their shares outnumber the honest ones. Standby leases buy disk, not GPU time, and are not
counted.

Nothing here does I/O or reads the clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from .book import RestingOrder
from .messages import LeaseKind, LeaseProposal, Offer, PriorityClass

#: How long a lease's price counts as recent, from its start.
DEFAULT_WINDOW_S = 3600.0
#: Most clearings kept; the oldest go first.
DEFAULT_MAX_LEASES = 4096
#: A lease that claims to start this far in the future is not counted (clock skew aside,
#: such a lease cannot have been served yet).
MAX_FUTURE_S = 300.0


@dataclass(frozen=True, slots=True)
class Clearing:
    """One lease as a price: which GPU model, which class, how many shares, and when this
    node saw it."""

    gpu_model: str
    priority: PriorityClass
    price: int
    shares: int
    seen_at: float


@dataclass(frozen=True, slots=True)
class PriceRow:
    """What one GPU model costs now (micro-credits per share-hour; None: nothing to show).

    Attributes:
        gpu_model: The GPU model.
        ask: The cheapest on-demand price among live offers with shares free.
        contend_floor: The cheapest contend price among live offers with contending
            shares free.
        on_demand_cleared: The share-weighted median price of recent on-demand and
            interruptible leases.
        contend_cleared: The same, of recent contending leases.
        on_demand_leases: How many recent on-demand and interruptible leases were seen.
        contend_leases: How many recent contending leases were seen.
    """

    gpu_model: str
    ask: int | None
    contend_floor: int | None
    on_demand_cleared: int | None
    contend_cleared: int | None
    on_demand_leases: int
    contend_leases: int


class ClearingPrices:
    """Recent leases' prices, by lease ID, as seen in accepted service records."""

    def __init__(
        self, window_s: float = DEFAULT_WINDOW_S, max_leases: int = DEFAULT_MAX_LEASES
    ) -> None:
        self.window_s = window_s
        self.max_leases = max_leases
        self._by_lease: OrderedDict[str, Clearing] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_lease)

    def record(self, proposal: LeaseProposal, gpu_model: str, *, now: float) -> bool:
        """Count a verified lease's price; False when it does not count (a standby lease,
        one already counted, one that ended before the window or starts in the future)."""
        if proposal.kind is not LeaseKind.COMPUTE or proposal.lease_id in self._by_lease:
            return False
        if proposal.end_at <= now - self.window_s or proposal.start_at > now + MAX_FUTURE_S:
            return False
        self._by_lease[proposal.lease_id] = Clearing(
            gpu_model, proposal.priority, proposal.price, proposal.shares, now
        )
        while len(self._by_lease) > self.max_leases:
            self._by_lease.popitem(last=False)
        return True

    def expire(self, now: float) -> None:
        """Forget leases seen more than ``window_s`` ago."""
        stale = [k for k, c in self._by_lease.items() if c.seen_at <= now - self.window_s]
        for key in stale:
            del self._by_lease[key]

    def recent(self, now: float) -> list[Clearing]:
        """The leases within the window at ``now``."""
        return [c for c in self._by_lease.values() if c.seen_at > now - self.window_s]


def price_rows(
    offers: Iterable[RestingOrder[Offer]], clearings: Iterable[Clearing]
) -> list[PriceRow]:
    """One row per GPU model that has a live offer or a recent clearing, by name."""
    asks: dict[str, list[int]] = {}
    floors: dict[str, list[int]] = {}
    for resting in offers:
        offer = resting.order
        asks.setdefault(offer.gpu_model, [])
        floors.setdefault(offer.gpu_model, [])
        if resting.remaining > 0:
            asks[offer.gpu_model].append(offer.price)
        if resting.contend_remaining > 0 and offer.contend_price:
            floors[offer.gpu_model].append(offer.contend_price)
    on_demand: dict[str, list[Clearing]] = {}
    contending: dict[str, list[Clearing]] = {}
    for clearing in clearings:
        side = contending if clearing.priority is PriorityClass.CONTEND else on_demand
        side.setdefault(clearing.gpu_model, []).append(clearing)
    models = sorted(set(asks) | set(on_demand) | set(contending))
    return [
        PriceRow(
            model,
            min(asks.get(model, []), default=None),
            min(floors.get(model, []), default=None),
            weighted_median(on_demand.get(model, [])),
            weighted_median(contending.get(model, [])),
            len(on_demand.get(model, [])),
            len(contending.get(model, [])),
        )
        for model in models
    ]


def weighted_median(clearings: list[Clearing]) -> int | None:
    """The price at which half the shares leased paid at most it; None for no leases."""
    if not clearings:
        return None
    ordered = sorted(clearings, key=lambda c: c.price)
    half = sum(c.shares for c in ordered) / 2
    counted = 0
    for clearing in ordered:
        counted += clearing.shares
        if counted >= half:
            return clearing.price
    return ordered[-1].price
