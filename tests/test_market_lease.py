"""Specs for cumulus_p2p.market.lease: the host's sans-IO reservation core."""

import dataclasses
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cumulus_p2p.envelope import Envelope, seal
from cumulus_p2p.identity import NodeIdentity
from cumulus_p2p.market.lease import LeaseBook, Refusal, RefusalReason
from cumulus_p2p.market.messages import (
    Lease,
    LeaseProposal,
    Offer,
    PriorityClass,
    encode_message,
    seal_message,
)
from cumulus_p2p.testing.market import lease_proposal

NOW = 1_700_000_000.0
HOST = NodeIdentity.generate()
ALICE = NodeIdentity.generate()
MALLORY = NodeIdentity.generate()


def offer(
    shares=4,
    *,
    price=1000,
    min_lease=60,
    expires=NOW + 600,
    nonce=1,
    offer_id="gpu0",
    storage_price=0,
    storage_gib=0,
    contend_price=0,
    contend_shares=None,
):
    if contend_shares is None:  # an offer selling contending use sells as many shares so
        contend_shares = shares if contend_price else 0
    return Offer(
        HOST.peer_id.to_base58(),
        offer_id,
        "RTX 4090",
        24576,
        100,
        shares,
        price,
        min_lease,
        "",
        NOW,
        expires,
        nonce,
        storage_price,
        storage_gib,
        contend_price,
        contend_shares,
    )


def proposal(
    lease_id="L1",
    *,
    duration=3600,
    start=NOW,
    host=HOST,
    consumer=ALICE,
    ttl=30.0,
    **terms,
):
    """Alice's proposal of one share of ``gpu0`` at 1000 for an hour (``terms`` add
    ``shares``, ``price``, ``nonce`` or ``offer_id``), expiring ``ttl`` after NOW."""
    return lease_proposal(
        consumer,
        host,
        start_at=start,
        duration_s=duration,
        lease_id=lease_id,
        expires_at=NOW + ttl,
        **terms,
    )


def sealed(p, signer=ALICE):
    return seal_message(signer, p, now=NOW).to_bytes()


def book_with(shares=4, **kwargs):
    book = LeaseBook(HOST)
    book.publish(offer(shares, **kwargs))
    return book


def refusal_of(result):
    assert isinstance(result, Refusal), result
    return result.reason


def test_a_valid_proposal_is_countersigned_and_reserves_shares():
    book = book_with(4)
    lease = book.propose(sealed(proposal(shares=3)), now=NOW)
    assert isinstance(lease, Lease)
    assert lease.verify(HOST.public_key).shares == 3
    assert book.free_shares("gpu0") == 1
    assert Lease.from_bytes(lease.to_bytes()) == lease


def test_a_granted_lease_can_be_looked_up_until_it_is_released():
    book = book_with(4)
    lease = book.propose(sealed(proposal(shares=1)), now=NOW)
    lease_id = lease.proposal.lease_id
    assert book.get(lease_id).lease == lease
    assert book.release(lease_id)
    assert book.get(lease_id) is None


def forged_signature(raw_proposal):
    envelope = Envelope.from_bytes(raw_proposal)
    return dataclasses.replace(envelope, signature=MALLORY.sign(envelope.signing_bytes()))


@pytest.mark.parametrize(
    ("make_raw", "reason", "now"),
    [
        (lambda: b"\x93garbage", RefusalReason.MALFORMED, NOW),
        (lambda: sealed(proposal())[:-3], RefusalReason.MALFORMED, NOW),
        (lambda: forged_signature(sealed(proposal())).to_bytes(), RefusalReason.BAD_SIGNATURE, NOW),
        (
            lambda: dataclasses.replace(
                forged_signature(sealed(proposal())), signature=b"\0" * 64
            ).to_bytes(),
            RefusalReason.BAD_SIGNATURE,
            NOW,
        ),
        (lambda: sealed(proposal()), RefusalReason.EXPIRED, NOW + 31),
        (lambda: sealed(proposal(host=MALLORY)), RefusalReason.WRONG_HOST, NOW),
        (lambda: sealed(proposal(offer_id="nope")), RefusalReason.UNKNOWN_OFFER, NOW),
        (lambda: sealed(proposal(price=999)), RefusalReason.PRICE_MISMATCH, NOW),
        (lambda: sealed(proposal(duration=59)), RefusalReason.TOO_SHORT, NOW),
        (lambda: sealed(proposal(start=NOW + 3600)), RefusalReason.BAD_START, NOW),
        (lambda: sealed(proposal(shares=5)), RefusalReason.NO_CAPACITY, NOW),
    ],
)
def test_bad_proposals_are_refused_with_a_reason_and_nothing_changes(make_raw, reason, now):
    book = book_with(4)
    assert refusal_of(book.propose(make_raw(), now=now)) is reason
    assert book.free_shares("gpu0") == 4
    assert book.leases() == []


def test_a_proposal_whose_body_names_another_signer_is_malformed():
    raw = sealed(proposal(consumer=ALICE))
    relabelled = seal(
        MALLORY,
        LeaseProposal.KIND,
        encode_message(proposal(consumer=ALICE)),
        now=NOW,
        ttl=30.0,
        nonce=1,
    )
    book = book_with(4)
    assert refusal_of(book.propose(relabelled.to_bytes(), now=NOW)) is RefusalReason.MALFORMED
    assert isinstance(book.propose(raw, now=NOW), Lease)


def test_a_replayed_proposal_is_refused_and_reserves_nothing_more():
    book = book_with(4)
    raw = sealed(proposal())
    assert isinstance(book.propose(raw, now=NOW), Lease)
    assert refusal_of(book.propose(raw, now=NOW + 1)) is RefusalReason.REPLAYED
    assert book.free_shares("gpu0") == 3


def test_a_reused_lease_id_is_refused():
    book = book_with(4)
    assert isinstance(book.propose(sealed(proposal("L1", nonce=1)), now=NOW), Lease)
    result = book.propose(sealed(proposal("L1", nonce=2)), now=NOW)
    assert refusal_of(result) is RefusalReason.DUPLICATE_LEASE_ID
    assert book.free_shares("gpu0") == 3


def test_an_expired_offer_is_not_leased():
    book = book_with(4, expires=NOW + 10)
    assert refusal_of(book.propose(sealed(proposal()), now=NOW + 10)) is (
        RefusalReason.OFFER_EXPIRED
    )


def test_shares_return_when_the_lease_ends_or_is_released():
    book = book_with(4)
    book.propose(sealed(proposal("L1", shares=2, duration=60, nonce=1)), now=NOW)
    book.propose(sealed(proposal("L2", shares=2, duration=120, nonce=2)), now=NOW)
    assert [r.proposal.lease_id for r in book.expire(NOW + 60)] == ["L1"]
    assert book.free_shares("gpu0") == 2
    assert book.release("L2") and not book.release("L2")
    assert book.free_shares("gpu0") == 4


def test_a_sender_who_is_not_the_signer_is_refused():
    book = book_with(4)
    result = book.propose(sealed(proposal()), now=NOW, sender=MALLORY.peer_id.to_base58())
    assert refusal_of(result) is RefusalReason.WRONG_SENDER


def test_publishing_another_hosts_offer_is_an_error():
    other = dataclasses.replace(offer(), host=MALLORY.peer_id.to_base58())
    with pytest.raises(ValueError):
        LeaseBook(HOST).publish(other)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4), st.booleans()), max_size=30))
def test_shares_are_never_double_booked(requests):
    book = book_with(6)
    granted = {}
    for nonce, (shares, release_first) in enumerate(requests):
        if release_first and granted:
            lease_id = sorted(granted)[0]
            assert book.release(lease_id)
            del granted[lease_id]
        result = book.propose(sealed(proposal(f"L{nonce}", shares=shares, nonce=nonce)), now=NOW)
        if isinstance(result, Lease):
            granted[f"L{nonce}"] = shares
        else:
            assert result.reason is RefusalReason.NO_CAPACITY
            assert shares > 6 - sum(granted.values())
        assert book.free_shares("gpu0") == 6 - sum(granted.values()) >= 0


# --- standby leases: disk for another session's checkpoints, no shares ---------------


def standby(lease_id="S1", gib=10, price=50, **terms):
    return proposal(lease_id, storage_gib=gib, price=price, **terms)


def test_a_standby_lease_reserves_gib_and_never_shares():
    book = book_with(2, storage_price=50, storage_gib=100)
    lease = book.propose(sealed(standby(gib=60)), now=NOW)
    assert isinstance(lease, Lease)
    granted = lease.verify(HOST.public_key)
    assert (granted.shares, granted.storage_gib) == (0, 60)
    assert (book.free_shares("gpu0"), book.free_storage()) == (2, 40)
    # All the shares go to compute leases, and the standby is still held.
    assert isinstance(book.propose(sealed(proposal("L1", shares=2, nonce=2)), now=NOW), Lease)
    assert book.free_shares("gpu0") == 0
    assert isinstance(book.propose(sealed(standby("S2", gib=40, nonce=3)), now=NOW), Lease)
    assert book.free_storage() == 0


def test_a_standby_is_refused_by_a_host_that_lends_no_storage():
    book = book_with(4, storage_price=0, storage_gib=0)
    assert refusal_of(book.propose(sealed(standby(price=10**6)), now=NOW)) is (
        RefusalReason.NO_STORAGE
    )
    assert book.leases() == []


def test_a_standby_below_the_storage_price_is_refused():
    # The share price is no floor for storage, nor the storage price for shares.
    book = book_with(4, price=10, storage_price=50, storage_gib=100)
    assert refusal_of(book.propose(sealed(standby(price=49)), now=NOW)) is (
        RefusalReason.PRICE_MISMATCH
    )
    assert isinstance(book.propose(sealed(standby(price=50, nonce=2)), now=NOW), Lease)
    assert isinstance(book.propose(sealed(proposal("L1", price=10, nonce=3)), now=NOW), Lease)


def test_a_standby_larger_than_the_storage_left_is_refused_and_reserves_nothing():
    book = book_with(4, storage_price=50, storage_gib=100)
    assert isinstance(book.propose(sealed(standby("S1", gib=70)), now=NOW), Lease)
    result = book.propose(sealed(standby("S2", gib=31, nonce=2)), now=NOW)
    assert refusal_of(result) is RefusalReason.NO_STORAGE_CAPACITY
    assert "31 GiB wanted, 30 GiB free" in result.detail
    assert book.free_storage() == 30 and len(book.leases()) == 1


def test_storage_is_one_pool_across_a_hosts_offers():
    book = LeaseBook(HOST)
    book.publish(offer(offer_id="gpu0", storage_price=50, storage_gib=100))
    book.publish(offer(offer_id="gpu1", storage_price=50, storage_gib=100))
    assert isinstance(book.propose(sealed(standby("S1", gib=80)), now=NOW), Lease)
    other = standby("S2", gib=30, nonce=2, offer_id="gpu1")
    assert refusal_of(book.propose(sealed(other), now=NOW)) is RefusalReason.NO_STORAGE_CAPACITY


def test_storage_returns_when_a_standby_ends_or_is_released():
    book = book_with(4, storage_price=50, storage_gib=100)
    book.propose(sealed(standby("S1", gib=30, duration=60)), now=NOW)
    book.propose(sealed(standby("S2", gib=30, duration=3600, nonce=2)), now=NOW)
    assert book.free_storage() == 40
    assert [r.proposal.lease_id for r in book.expire(NOW + 60)] == ["S1"]
    assert book.free_storage() == 70
    assert book.release("S2") and book.free_storage() == 100


def test_a_standby_is_held_to_the_offers_minimum_lease():
    book = book_with(4, min_lease=600, storage_price=50, storage_gib=100)
    assert refusal_of(book.propose(sealed(standby(duration=60)), now=NOW)) is (
        RefusalReason.TOO_SHORT
    )


def test_a_contending_proposal_between_the_floor_and_the_ask_is_granted_at_its_price():
    book = book_with(4, price=1000, contend_price=400)
    lease = book.propose(sealed(proposal(price=600, priority=PriorityClass.CONTEND)), now=NOW)
    assert isinstance(lease, Lease)
    assert lease.verify(HOST.public_key).price == 600


def test_a_contending_proposal_under_the_floor_is_refused_naming_the_floor():
    book = book_with(4, price=1000, contend_price=400)
    refused = book.propose(sealed(proposal(price=399, priority=PriorityClass.CONTEND)), now=NOW)
    assert refusal_of(refused) is RefusalReason.PRICE_MISMATCH
    assert "asking 400 (its contend price)" in refused.detail
    assert book.free_shares("gpu0") == 4


def test_a_contending_proposal_to_an_offer_without_a_floor_is_refused():
    book = book_with(4, price=1000)
    refused = book.propose(sealed(proposal(price=600, priority=PriorityClass.CONTEND)), now=NOW)
    assert refusal_of(refused) is RefusalReason.PRICE_MISMATCH
    assert "sells no contending leases" in refused.detail


def test_an_on_demand_proposal_below_the_ask_is_refused_whatever_the_floor():
    book = book_with(4, price=1000, contend_price=400)
    refused = book.propose(sealed(proposal(price=600)), now=NOW)
    assert refusal_of(refused) is RefusalReason.PRICE_MISMATCH


CONTEND, INTERRUPTIBLE = PriorityClass.CONTEND, PriorityClass.INTERRUPTIBLE
NONCES = itertools.count(100)


def proposed(book, lease_id, *, price=1000, priority=PriorityClass.ON_DEMAND, shares=1):
    """Alice's proposal ``lease_id`` to ``book``, with a nonce of its own: the answer."""
    terms = {"price": price, "priority": priority, "shares": shares, "nonce": next(NONCES)}
    return book.propose(sealed(proposal(lease_id, **terms)), now=NOW)


def granted(book, lease_id, **terms):
    lease = proposed(book, lease_id, **terms)
    assert isinstance(lease, Lease), lease
    return lease


def test_an_on_demand_lease_preempts_the_cheapest_interruptible_one_on_a_full_offer():
    book = book_with(2, price=1000)
    granted(book, "dear", price=1200, priority=INTERRUPTIBLE)
    granted(book, "cheap", price=1000, priority=INTERRUPTIBLE)
    assert book.free_shares("gpu0") == 0
    granted(book, "on-demand")
    (preempted,) = book.take_preempted()
    assert preempted.proposal.lease_id == "cheap"
    assert book.get("cheap") is None and book.get("dear") is not None
    assert book.take_preempted() == []  # handed over once
    assert book.free_shares("gpu0") == 0


def test_without_enough_preemptible_shares_nothing_is_preempted_and_the_lease_is_refused():
    book = book_with(2, price=1000)
    granted(book, "interruptible", priority=INTERRUPTIBLE)
    granted(book, "on-demand")
    assert refusal_of(proposed(book, "two", shares=2)) is RefusalReason.NO_CAPACITY
    assert book.take_preempted() == [] and book.get("interruptible") is not None


def test_only_an_on_demand_lease_preempts_and_none_is_ever_preempted():
    book = book_with(1, price=1000)
    granted(book, "first")
    dearer = proposed(book, "dearer", price=1200, priority=INTERRUPTIBLE)
    assert refusal_of(dearer) is RefusalReason.NO_CAPACITY
    assert refusal_of(proposed(book, "second")) is RefusalReason.NO_CAPACITY
    assert book.take_preempted() == []


def test_a_contending_lease_draws_on_the_contending_pool_and_leaves_on_demand_shares():
    book = book_with(2, price=1000, contend_price=200, contend_shares=3)
    granted(book, "contending", shares=2, price=200, priority=CONTEND)
    assert book.free_contend_shares("gpu0") == 1
    assert book.free_shares("gpu0") == 2
    granted(book, "on-demand", shares=2)  # on a full offer, the contending lease stays
    assert book.take_preempted() == [] and book.get("contending") is not None


def test_a_contending_proposal_beyond_the_contending_pool_is_refused_and_preempts_nothing():
    book = book_with(4, price=1000, contend_price=200, contend_shares=1)
    refused = proposed(book, "two", shares=2, price=200, priority=CONTEND)
    assert refusal_of(refused) is RefusalReason.NO_CAPACITY
    assert "1 contending free" in refused.detail
    assert book.free_shares("gpu0") == 4


def test_a_released_contending_lease_returns_its_shares_to_the_contending_pool():
    book = book_with(2, price=1000, contend_price=200, contend_shares=2)
    granted(book, "contending", shares=2, price=200, priority=CONTEND)
    assert book.release("contending")
    assert (book.free_contend_shares("gpu0"), book.free_shares("gpu0")) == (2, 2)


def test_a_standby_lease_is_never_preempted():
    book = book_with(1, price=1000, contend_price=200, storage_price=10, storage_gib=8)
    standby = proposal("standby", price=10, storage_gib=2, priority=INTERRUPTIBLE, nonce=7)
    assert isinstance(book.propose(sealed(standby), now=NOW), Lease)
    granted(book, "first")
    assert refusal_of(proposed(book, "second")) is RefusalReason.NO_CAPACITY
    assert book.take_preempted() == [] and book.get("standby") is not None
