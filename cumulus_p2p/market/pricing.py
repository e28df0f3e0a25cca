"""What a compute lease pays: the ask, or for a contending lease its own bid. Sans-IO.

Theory of operation
-------------------
An offer has two prices per share-hour: the ask (``Offer.price``), which an on-demand or
interruptible lease pays at least, and a floor for contending use
(``Offer.contend_price``; 0 when the host sells none). A contending lease
(``PriorityClass.CONTEND``) shares the device at a lower rank than on-demand tenants, so
it is worth less to its holder; a bid anywhere between the floor and the ask gets one.

Pricing is pay-your-bid: a contending lease pays its bid's limit, never the floor (no
other bidder's price is known to a consumer, and a host sees one proposal at a time), and
never more than the ask (above it, the same shares are on sale at the ask). Every tenant
in a class pays what it said the lease was worth; a uniform clearing price would need an
auctioneer the mesh does not have.
"""

from __future__ import annotations

from .messages import Bid, Offer, PriorityClass

__all__ = ["least_price", "paid_on", "price_for"]


def least_price(offer: Offer, priority: PriorityClass) -> int | None:
    """The least a compute lease of ``priority`` may pay per share-hour on ``offer``;
    None when the offer sells no such lease (a contending one, without a floor)."""
    if priority is not PriorityClass.CONTEND:
        return offer.price
    return offer.contend_price or None


def price_for(offer: Offer, bid: Bid) -> int | None:
    """What ``bid`` pays per share-hour on ``offer``: the ask when its limit reaches it,
    else for a contending bid its limit, if that reaches the floor; None when it cannot
    lease there."""
    if offer.price <= bid.max_price:
        return offer.price
    least = least_price(offer, bid.priority)
    if least is None or least > bid.max_price:
        return None
    return bid.max_price


def paid_on(offer: Offer, bid: Bid) -> int:
    """What ``bid`` pays on an offer it may lease (``OrderBook.candidates`` gave it)."""
    price = price_for(offer, bid)
    assert price is not None, "not an offer this bid may lease"
    return price
