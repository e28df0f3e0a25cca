"""What a compute lease pays: the ask, or for a contending lease the contend price. Sans-IO.

Theory of operation
-------------------
An offer has two prices per share-hour: the ask (``Offer.price``), which an on-demand or
interruptible lease pays at least, and the price of contending use
(``Offer.contend_price``; 0 when the host sells none). A contending lease
(``PriorityClass.CONTEND``) shares the device at a lower rank than on-demand tenants: it
runs in their idle gaps, so it is worth less to its holder, and costs the host little.

Contending use clears at one price per offer: every contending tenant of an offer pays
its ``contend_price``, whatever its bid above it. Pay-your-bid was the first design; the
priority simulation (``simulations/priority.py``, seed 1, full run) compared them at the
same demand, with contend prices at 0.4 of the ask:

- paying their bids (at most the ask), contending tenants paid 17% less than on-demand
  ones on the same GPU model: bids spread around the market price whatever the class,
  and a bid is what its holder would pay at most, not what idle gaps are worth;
- at one price, they paid 47% less, and hosts earned 1.46 times what renting whole GPUs
  earned them, since contending shares are sold beyond the on-demand ones.

A uniform price also asks nothing of the bidder: bidding one's true limit costs nothing,
where pay-your-bid rewards guessing the floor. The host sets the price; a consumer sees
it in the offer before it proposes. An offer without a contend price sells no
contending lease at any price: its host has not agreed to share at a lower rank.

Paying for priority is the other way round. On a shared device the host ranks tenants by
class, then by the price their lease pays (``host/scheduler.py``'s ``lease_rank``). An
on-demand or interruptible consumer may propose its whole limit instead of the ask
(``proposed_price`` with ``pay_bid``): it pays more, and its session runs ahead of the
other tenants of its class. Contending tenants all pay one price, so among them no one
buys rank.
"""

from __future__ import annotations

from .messages import Bid, Offer, PriorityClass

__all__ = ["least_price", "paid_on", "price_for", "proposed_price"]


def least_price(offer: Offer, priority: PriorityClass) -> int | None:
    """The least a compute lease of ``priority`` may pay per share-hour on ``offer``;
    None when the offer sells no such lease (a contending one, without a contend price)."""
    if priority is not PriorityClass.CONTEND:
        return offer.price
    return offer.contend_price or None


def price_for(offer: Offer, bid: Bid) -> int | None:
    """What ``bid`` pays per share-hour on ``offer`` (for a contending bid the offer's
    contend price, else its ask) when its limit reaches it; None when it cannot lease
    there."""
    price = least_price(offer, bid.priority)
    return price if price is not None and price <= bid.max_price else None


def paid_on(offer: Offer, bid: Bid) -> int:
    """What ``bid`` pays on an offer it may lease (``OrderBook.candidates`` gave it)."""
    price = price_for(offer, bid)
    assert price is not None, "not an offer this bid may lease"
    return price


def proposed_price(offer: Offer, bid: Bid, *, pay_bid: bool = False) -> int | None:
    """What ``bid``'s lease proposes to pay on ``offer``: the least it may pay there, or,
    to rank ahead of its class on the device (``pay_bid``, not for contending use), its
    whole limit; None when it cannot lease there."""
    price = price_for(offer, bid)
    if price is None or not pay_bid or bid.priority is PriorityClass.CONTEND:
        return price
    return bid.max_price
