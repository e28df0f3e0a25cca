"""Who gets a host's free shares: the best waiting bid first, not the first proposal. Sans-IO.

Theory of operation
-------------------
A consumer's bid rests in every node's book while its job waits for a host, and leaves
it once the job is leased (the consumer cancels it; ``node/consumer.py``). When shares
free up at a host, every waiting consumer whose bid fits may propose, and without a rule
the first proposal to arrive takes them, however little its consumer bid. So the host
weighs each proposal against the bids waiting in its own book (``waiting_ahead``): when
other consumers' waiting bids fit the same offer, draw on the same shares and rank ahead
of the proposer, and this proposal would leave too few shares for them, it is refused as
``OUTBID``; the better bidder's own proposal follows within its next look at the book.

Rank is the class, then the limit: an on-demand bid ranks ahead of every interruptible
one (it would preempt them anyway), and within a class the higher ``max_price`` first,
the proposer's own waiting bid giving its limit (else the price it proposes). Contending
bids draw on the contending shares only and rank among themselves the same way: they all
pay one price (``pricing.py``), but the higher limit is served first, as in any
uniform-price auction. Equal limits are first come, first served.

A waiting bid holds shares back only while it rests (a consumer that leased elsewhere
cancels it; one that vanished stops re-announcing it, so it expires within the bid's time
to live), and only for ``HOLD_S`` from the first proposal it outbid on that offer: a better
bidder that never comes (it set this host aside, say, which the host cannot know) delays
the others by that much, not for as long as it waits.
"""

from __future__ import annotations

from collections.abc import Iterable

from .book import meets_terms
from .messages import Bid, LeaseProposal, Offer, PriorityClass
from .pricing import price_for

__all__ = ["HOLD_S", "fits", "waiting_ahead"]

#: How long free shares wait for a better bid, from the first proposal it outbid: several
#: of a waiting consumer's looks at the book.
HOLD_S = 10.0


def fits(offer: Offer, bid: Bid) -> bool:
    """Whether ``bid`` may lease ``offer``: its device, terms and price (shares aside)."""
    return (
        offer.vram_mib >= bid.min_vram_mib
        and (not bid.gpu_models or offer.gpu_model in bid.gpu_models)
        and meets_terms(offer, bid)
        and price_for(offer, bid) is not None
    )


def waiting_ahead(
    proposal: LeaseProposal, offer: Offer, free: int, waiting: Iterable[Bid]
) -> Bid | None:
    """The best bid waiting ahead of ``proposal`` for shares of ``offer`` that it would
    leave without enough of the ``free`` ones; None when the proposal may have them.

    Args:
        proposal: A compute lease proposal on ``offer`` that passed every other check.
        offer: The offer it leases, as the host holds it.
        free: The shares free to the proposal's class (its pool, before it takes any).
        waiting: The bids resting in the host's book, any order.
    """
    bids = list(waiting)
    own = [b.max_price for b in bids if b.consumer == proposal.consumer]
    mine = _rank(proposal.priority, max(own, default=proposal.price))
    contending = proposal.priority is PriorityClass.CONTEND
    ahead = [
        b
        for b in bids
        if b.consumer != proposal.consumer
        and (b.priority is PriorityClass.CONTEND) == contending
        and _rank(b.priority, b.max_price) < mine
        and fits(offer, b)
    ]
    if not ahead or free - proposal.shares >= sum(b.shares for b in ahead):
        return None
    return min(ahead, key=lambda b: (_rank(b.priority, b.max_price), b.created_at))


def _rank(priority: PriorityClass, limit: int) -> tuple[int, int]:
    """Lower ranks first: on-demand (and contending, within its own pool) before
    interruptible, then the higher limit."""
    return (1 if priority is PriorityClass.INTERRUPTIBLE else 0, -limit)
