"""Specs for cumulus_p2p.market.standby: the consumer's choice of a standby host."""

import pytest

from cumulus_p2p.identity import NodeIdentity
from cumulus_p2p.market.lease import LeaseBook
from cumulus_p2p.market.messages import (
    Lease,
    LeaseKind,
    Offer,
    decode_message,
    encode_message,
    seal_message,
)
from cumulus_p2p.market.standby import choose_standby, standby_proposal

NOW = 1_700_000_000.0


def offer(host, storage_price=10, storage_gib=100, *, offer_id="gpu0", min_lease=0, ttl=600.0):
    return Offer(
        host, offer_id, "RTX 4090", 24576, 100, 4, 1000, min_lease, "", NOW, NOW + ttl, 1,
        storage_price, storage_gib,
    )  # fmt: skip


def hosts(ranked):
    return [o.host for o in ranked]


def choose(offers, **kwargs):
    terms = {"exclude": "session-host", "gib": 10, "max_price": 1000, "now": NOW} | kwargs
    return choose_standby(offers, **terms)


def test_the_cheapest_storage_comes_first():
    ranked = choose([offer("b", 30), offer("a", 10), offer("c", 20)])
    assert hosts(ranked) == ["a", "c", "b"]


def test_the_sessions_own_host_is_never_its_standby():
    ranked = choose([offer("session-host", 1), offer("a", 10)])
    assert hosts(ranked) == ["a"]


def test_hosts_that_cannot_hold_the_gib_or_keep_no_standbys_are_skipped():
    ranked = choose([offer("small", 1, 9), offer("none", 0, 0), offer("fits", 50, 10)])
    assert hosts(ranked) == ["fits"]


def test_storage_above_the_limit_expired_offers_and_long_minimums_are_skipped():
    offers = [
        offer("dear", 1001),
        offer("expired", 1, ttl=0.0),
        offer("long", 1, min_lease=7200),
        offer("ok", 500),
    ]
    assert hosts(choose(offers, duration_s=3600)) == ["ok"]
    assert hosts(choose(offers)) == ["long", "ok"]  # no duration given: not checked


def test_reliability_moves_a_host_ahead_of_a_cheaper_unknown_one():
    offers = [offer("unknown", 10), offer("reliable", 12)]
    assert hosts(choose(offers)) == ["unknown", "reliable"]
    assert hosts(choose(offers, scores={"reliable": 0.9})) == ["reliable", "unknown"]


def test_free_storage_ties_go_to_the_more_reliable_host():
    offers = [offer("a", 0), offer("b", 0)]
    assert hosts(choose(offers, scores={"a": 0.2, "b": 0.8})) == ["b", "a"]


def test_one_offer_per_host_and_hosts_set_aside_are_skipped():
    offers = [offer("a", 10, offer_id="gpu0"), offer("a", 10, offer_id="gpu1"), offer("b", 20)]
    assert [(o.host, o.offer_id) for o in choose(offers)] == [("a", "gpu0"), ("b", "gpu0")]
    assert hosts(choose(offers, usable=lambda h: h != "a")) == ["b"]
    assert len(choose(offers, limit=1)) == 1


def test_a_standby_keeps_at_least_one_gib():
    with pytest.raises(ValueError, match="at least 1 GiB"):
        choose([offer("a")], gib=0)


def test_the_chosen_standby_grants_the_proposal_built_for_it():
    host, consumer = NodeIdentity.generate(), NodeIdentity.generate()
    book = LeaseBook(host)
    chosen = offer(host.peer_id.to_base58(), 25, 64)
    book.publish(chosen)
    (best,) = choose([chosen], gib=64)
    proposal = standby_proposal(
        best,
        consumer=consumer.peer_id.to_base58(),
        lease_id="S1",
        gib=64,
        start_at=NOW,
        duration_s=3600,
        expires_at=NOW + 30,
        nonce=1,
    )
    assert (proposal.kind, proposal.shares, proposal.storage_gib) == (LeaseKind.STANDBY, 0, 64)
    assert proposal.price == 25
    assert decode_message(proposal.KIND, encode_message(proposal)) == proposal
    lease = book.propose(seal_message(consumer, proposal, now=NOW).to_bytes(), now=NOW)
    assert isinstance(lease, Lease) and book.free_storage() == 0
