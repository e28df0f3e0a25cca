"""Specs for cumulus_p2p.market.pricing: what a compute lease proposes to pay."""

import pytest

from cumulus_p2p.market.messages import Bid, Offer, PriorityClass
from cumulus_p2p.market.pricing import proposed_price

ASK, CONTEND = 500_000, 200_000
OFFER = Offer(
    "host", "gpu0", "A100", 40_960, 100, 2, ASK, 0, "", 0.0, 100.0, 1,
    contend_price=CONTEND, contend_shares=2,
)  # fmt: skip


def bid(max_price: int, priority=PriorityClass.ON_DEMAND) -> Bid:
    return Bid("consumer", "b", 0, (), 0, 1, max_price, priority, 60, 0.0, 100.0, 1)


@pytest.mark.parametrize("priority", [PriorityClass.ON_DEMAND, PriorityClass.INTERRUPTIBLE])
def test_a_lease_proposes_the_ask_unless_it_pays_its_bid_for_rank(priority):
    assert proposed_price(OFFER, bid(700_000, priority)) == ASK
    assert proposed_price(OFFER, bid(700_000, priority), pay_bid=True) == 700_000


def test_a_contending_lease_pays_the_contend_price_even_when_told_to_pay_its_bid():
    assert proposed_price(OFFER, bid(400_000, PriorityClass.CONTEND), pay_bid=True) == CONTEND


def test_a_bid_under_the_price_proposes_nothing_whatever_it_would_pay():
    assert proposed_price(OFFER, bid(ASK - 1), pay_bid=True) is None
    assert proposed_price(OFFER, bid(CONTEND - 1, PriorityClass.CONTEND)) is None
