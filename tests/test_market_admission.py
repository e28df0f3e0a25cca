"""Specs for cumulus_p2p.market.admission: a host's free shares go to the best waiting bid."""

import itertools

from cumulus_p2p.identity import NodeIdentity
from cumulus_p2p.market.admission import HOLD_S
from cumulus_p2p.market.lease import LeaseBook, RefusalReason
from cumulus_p2p.market.messages import Bid, Lease, Offer, PriorityClass, seal_message
from cumulus_p2p.testing.market import lease_proposal

NOW = 1_700_000_000.0
HOST, ALICE, BOB = (NodeIdentity.generate() for _ in range(3))
ASK = 1000
NONCES = itertools.count(1)


def book(shares=1, contend_shares=0):
    offer = Offer(
        HOST.peer_id.to_base58(), "gpu0", "RTX 4090", 24576, 100, shares, ASK, 60, "",
        NOW, NOW + 600, 1, contend_price=400 if contend_shares else 0,
        contend_shares=contend_shares,
    )  # fmt: skip
    lease_book = LeaseBook(HOST)
    lease_book.publish(offer)
    return lease_book


def waiting(who, max_price, priority=PriorityClass.ON_DEMAND, *, shares=1, models=()):
    return Bid(
        who.peer_id.to_base58(), "bid0", 0, models, 0, shares, max_price, priority, 3600,
        NOW - 10, NOW + 60, 1,
    )  # fmt: skip


def propose(
    lease_book, bids, priority=PriorityClass.ON_DEMAND, *, price=ASK, lease_id="L1", now=NOW
):
    proposal = lease_proposal(
        ALICE, HOST, start_at=now, duration_s=3600, price=price, priority=priority,
        lease_id=lease_id, expires_at=now + 30, nonce=next(NONCES),
    )  # fmt: skip
    raw = seal_message(ALICE, proposal, now=now).to_bytes()
    return lease_book.propose(raw, now=now, waiting=bids)


def test_a_better_bid_waiting_for_the_last_share_outbids_a_proposal():
    refused = propose(book(), [waiting(ALICE, 1200), waiting(BOB, 1500)])
    assert refused.reason is RefusalReason.OUTBID
    assert "a bid of 1500 per share-hour waits" in refused.detail


def test_a_better_bid_that_does_not_come_holds_the_share_back_for_a_while_only():
    lease_book, bids = book(), [waiting(BOB, 1500)]
    assert propose(lease_book, bids, lease_id="L1").reason is RefusalReason.OUTBID
    later = propose(lease_book, bids, lease_id="L2", now=NOW + HOLD_S - 1)
    assert later.reason is RefusalReason.OUTBID
    assert type(propose(lease_book, bids, lease_id="L3", now=NOW + HOLD_S)) is Lease


def test_a_proposal_from_the_best_waiting_bid_gets_the_share():
    granted = propose(book(), [waiting(ALICE, 1500), waiting(BOB, 1200)])
    assert type(granted) is Lease


def test_enough_free_shares_for_both_admit_the_lesser_bid_too():
    assert type(propose(book(shares=2), [waiting(ALICE, 1200), waiting(BOB, 1500)])) is Lease


def test_a_waiting_bid_the_offer_does_not_fit_holds_nothing_back():
    other_model = waiting(BOB, 1500, models=("H100",))
    assert type(propose(book(), [waiting(ALICE, 1200), other_model])) is Lease


def test_without_a_waiting_bid_of_its_own_a_proposal_ranks_by_the_price_it_pays():
    # Alice pays her bid of 1500 (--pay-bid): ahead of Bob's 1200.
    assert type(propose(book(), [waiting(BOB, 1200)], price=1500)) is Lease
    assert propose(book(), [waiting(BOB, 1200)]).reason is RefusalReason.OUTBID


def test_equal_limits_are_first_come_first_served():
    assert type(propose(book(), [waiting(ALICE, 1200), waiting(BOB, 1200)])) is Lease


def test_an_on_demand_bid_ranks_ahead_of_any_interruptible_one():
    bids = [waiting(ALICE, 5000, PriorityClass.INTERRUPTIBLE), waiting(BOB, ASK)]
    refused = propose(book(), bids, PriorityClass.INTERRUPTIBLE, price=5000)
    assert refused.reason is RefusalReason.OUTBID
    interruptible = [waiting(BOB, 5000, PriorityClass.INTERRUPTIBLE)]
    assert type(propose(book(), interruptible)) is Lease


def test_contending_bids_wait_only_for_contending_shares():
    contending_bob = waiting(BOB, 900, PriorityClass.CONTEND)
    assert type(propose(book(contend_shares=1), [contending_bob])) is Lease
    refused = propose(
        book(contend_shares=1), [waiting(ALICE, 500, PriorityClass.CONTEND), contending_bob],
        PriorityClass.CONTEND, price=400,
    )  # fmt: skip
    assert refused.reason is RefusalReason.OUTBID
