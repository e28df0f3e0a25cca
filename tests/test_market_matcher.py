"""Specs for cumulus_p2p.market.matcher: ranking offers by effective price."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cumulus_p2p._errors import InvalidMessageError
from cumulus_p2p.market.book import OrderBook
from cumulus_p2p.market.matcher import (
    Entry,
    RankingPolicy,
    Standing,
    effective_price,
    entry_of,
    near_first,
    proposal_batch,
    rank_offers,
    standing,
)
from cumulus_p2p.market.messages import Bid, Offer, PriorityClass


def offer(host, price, *, created=0.0, model="A100", shares=4, contend_price=0, overcommit=100):
    return Offer(
        host, "o", model, 40, 10, shares, price, 0, "", created, 100.0, 1,
        contend_price=contend_price, contend_shares=shares if contend_price else 0,
        overcommit_pct=overcommit,
    )  # fmt: skip


def bid(
    max_price=1000, models=(), shares=1, priority=PriorityClass.ON_DEMAND, consumer="me", at=0.0
):
    return Bid(consumer, "b", 0, models, 0, shares, max_price, priority, 60, at, 100.0, 1)


def book_of(*offers):
    book = OrderBook()
    for o in offers:
        book.insert(o, now=0.0)
    return book


def test_with_neutral_inputs_the_cheapest_offer_ranks_first():
    book = book_of(offer("h1", 30), offer("h2", 10), offer("h3", 20))
    assert [r.offer.host for r in rank_offers(book, bid())] == ["h2", "h3", "h1"]


def test_a_reliable_host_beats_a_slightly_cheaper_unknown_one():
    book = book_of(offer("cheap", 90), offer("reliable", 100))
    ranked = rank_offers(book, bid(), reliability={"reliable": 0.9})
    assert [r.offer.host for r in ranked] == ["reliable", "cheap"]
    assert ranked[1].reliability == 0.5


def test_a_distant_host_ranks_below_a_near_one_at_the_same_price():
    book = book_of(offer("far", 100), offer("near", 100))
    ranked = rank_offers(book, bid(), latency_ms={"far": 300.0, "near": 5.0})
    assert [r.offer.host for r in ranked] == ["near", "far"]


def test_offers_over_the_limit_or_of_another_model_are_not_ranked():
    book = book_of(offer("h1", 10, model="H100"), offer("h2", 2000), offer("h3", 50))
    assert [r.offer.host for r in rank_offers(book, bid(models=("A100",)))] == ["h3"]


def test_an_offer_with_fewer_free_shares_than_the_bid_wants_is_not_ranked():
    book = book_of(offer("fragment", 10, shares=2), offer("roomy", 50, shares=4))
    assert [r.offer.host for r in rank_offers(book, bid(shares=3))] == ["roomy"]


def test_effective_price_is_neutral_for_unknown_hosts_and_clamps_scores():
    policy = RankingPolicy(default_latency_ms=0.0)
    assert effective_price(100, reliability=0.5, latency_ms=0.0, policy=policy) == 100.0
    assert effective_price(100, reliability=7.0, latency_ms=-3.0, policy=policy) == 50.0


def test_an_overcommitted_offer_ranks_below_an_equal_price_that_keeps_its_memory():
    book = book_of(offer("pages", 100, overcommit=200), offer("keeps", 100))
    assert [r.offer.host for r in rank_offers(book, bid())] == ["keeps", "pages"]


def test_an_overcommitted_offer_cheap_enough_still_ranks_first():
    # Twice the memory sold counts 1.5 times the price: 60 ranks as 90, under 100.
    book = book_of(offer("pages", 60, overcommit=200), offer("keeps", 100))
    assert [r.offer.host for r in rank_offers(book, bid())] == ["pages", "keeps"]


def test_overcommit_counts_in_the_effective_price_by_its_weight():
    policy = RankingPolicy(default_latency_ms=0.0)
    price = effective_price(100, reliability=0.5, latency_ms=0.0, policy=policy, overcommit_pct=150)
    assert price == 125.0
    with pytest.raises(InvalidMessageError):
        RankingPolicy(overcommit_weight=-0.1)


def test_a_policy_that_could_make_prices_negative_is_refused():
    with pytest.raises(InvalidMessageError):
        RankingPolicy(reliability_weight=3.0)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 50), st.floats(0, 1), st.floats(0, 500), st.integers(100, 200)),
        max_size=30,
    ),
    st.integers(1, 5),
)
def test_early_stop_returns_exactly_the_top_of_a_full_sort(hosts, limit):
    offers = [offer(f"h{i}", price, overcommit=pct) for i, (price, *_, pct) in enumerate(hosts)]
    reliability = {f"h{i}": r for i, (_, r, *_) in enumerate(hosts)}
    latency = {f"h{i}": lat for i, (_, _, lat, _) in enumerate(hosts)}
    ranked = rank_offers(
        book_of(*offers), bid(), reliability=reliability, latency_ms=latency, limit=limit
    )
    policy = RankingPolicy()
    expected = sorted(
        offers,
        key=lambda o: (
            effective_price(
                o.price,
                reliability=reliability[o.host],
                latency_ms=latency[o.host],
                policy=policy,
                overcommit_pct=o.overcommit_pct,
            ),
            o.price,
            o.created_at,
            o.host,
            o.offer_id,
        ),
    )[:limit]
    assert [r.offer for r in ranked] == expected


# -- cost of entry -------------------------------------------------------------------------


def junk(host, offer_id, price=1):
    return Offer(host, offer_id, "A100", 40, 10, 8, price, 0, "", 0.0, 100.0, 1)


def test_junk_far_below_the_market_ranks_after_hosts_with_a_record_and_fair_newcomers():
    book = book_of(
        offer("recorded", 500), offer("newcomer", 600), *[junk(f"spam{i}", "j") for i in range(50)]
    )
    entry = entry_of(book, bid(), {"recorded"}.__contains__)
    ranked = rank_offers(book, bid(), limit=3, entry=entry)
    assert [r.offer.host for r in ranked[:2]] == ["recorded", "newcomer"]
    assert entry(ranked[2].offer) is Entry.SUSPECT
    # Without a record in the class, "far below" is judged against the bid's limit.
    alone = book_of(offer("newcomer", 600), junk("spam", "j"))
    entry = entry_of(alone, bid(max_price=10_000), lambda host: False)
    ranked = rank_offers(alone, bid(max_price=10_000), entry=entry)
    assert [r.offer.host for r in ranked] == ["newcomer", "spam"]


@pytest.mark.parametrize("price", [1, 100, 499, 500, 900])
def test_an_unknown_host_at_any_price_never_outranks_a_host_with_a_record(price):
    book = book_of(offer("recorded", 500), junk("spam", "j", price))
    entry = entry_of(book, bid(), {"recorded"}.__contains__)
    assert rank_offers(book, bid(), entry=entry)[0].offer.host == "recorded"


# -- liveness: an offer counts once its host has answered a probe ---------------------------


def test_a_newcomer_that_answered_no_probe_ranks_after_one_that_did_even_when_cheaper():
    book = book_of(offer("unproven", 550), offer("proven", 600), offer("recorded", 500))
    entry = entry_of(book, bid(), {"recorded"}.__contains__, alive={"proven"}.__contains__)
    ranked = rank_offers(book, bid(), entry=entry)
    assert [r.offer.host for r in ranked] == ["recorded", "proven", "unproven"]
    assert entry(ranked[2].offer) is Entry.UNPROVEN


def test_a_host_with_a_record_needs_no_probe():
    book = book_of(offer("recorded", 500))
    entry = entry_of(book, bid(), {"recorded"}.__contains__, alive=lambda host: False)
    assert entry(offer("recorded", 500)) is Entry.RECORD


def test_an_unproven_host_is_never_proposed_to():
    entries = {"unproven": Entry.UNPROVEN, "recorded": Entry.RECORD}
    assert proposal_batch(["unproven", "recorded"], entries, at_once=4) == ["recorded"]
    assert proposal_batch(["unproven"], entries, at_once=4) == []


def test_an_unproven_host_never_takes_the_newcomer_slot_from_a_proven_one():
    hosts = ["r1", "r2", "r3", "r4", "unproven", "proven"]
    entries = dict.fromkeys(hosts[:4], Entry.RECORD) | {
        "unproven": Entry.UNPROVEN,
        "proven": Entry.NEWCOMER,
    }
    assert proposal_batch(hosts, entries, at_once=4) == ["r1", "r2", "r3", "proven"]
    first = proposal_batch(hosts, entries, at_once=4, newcomers_first=True)
    assert first[0] == "proven" and "unproven" not in first


def test_a_contending_bid_ranks_offers_by_what_it_pays_there():
    book = book_of(
        offer("dear", 50, contend_price=27), offer("cheap", 40, contend_price=12), offer("od", 9)
    )
    # By the contend price each asks; the offer selling no contending lease is left out.
    ranked = rank_offers(book, bid(30, priority=PriorityClass.CONTEND))
    assert [r.offer.host for r in ranked] == ["cheap", "dear"]
    assert ranked[1].effective_price / ranked[0].effective_price == pytest.approx(27 / 12)
    one = rank_offers(book, bid(30, priority=PriorityClass.CONTEND), limit=1)
    assert [r.offer.host for r in one] == ["cheap"]


def test_a_bid_under_every_ask_is_told_the_bids_ahead_and_the_price_that_runs_it_now():
    book = book_of(offer("h1", 30, shares=1), offer("h2", 50, shares=4, contend_price=20))
    for other in (bid(25, consumer="richer"), bid(10, consumer="same", at=0.0)):
        book.insert(other, now=0.0)
    book.insert(bid(9, consumer="poorer"), now=0.0)
    mine = bid(10, shares=2, at=1.0)
    # h1 cannot hold two shares; h2 asks 50 on demand, 20 to a contending bid.
    assert standing(book, mine) == Standing(bids_ahead=2, run_now_price=50)
    contending = dataclasses.replace(mine, priority=PriorityClass.CONTEND)
    assert standing(book, contending).run_now_price == 20


def test_a_bid_no_offer_can_serve_has_no_price_to_run_now():
    book = book_of(offer("h1", 30, model="A100"))
    assert standing(book, bid(10, models=("H100",))) == Standing(0, None)


def test_hosts_near_the_jobs_region_come_first_within_their_entry_tier():
    hosts = ["record-far", "cheap-far", "dear-near", "suspect-near"]
    entries = {
        "record-far": Entry.RECORD,
        "cheap-far": Entry.NEWCOMER,
        "dear-near": Entry.NEWCOMER,
        "suspect-near": Entry.SUSPECT,
    }
    regions = {"record-far": "us", "cheap-far": "us", "dear-near": "eu", "suspect-near": "eu"}
    assert near_first(hosts, entries, regions, "eu") == [
        "record-far", "dear-near", "cheap-far", "suspect-near",
    ]  # fmt: skip


def test_no_region_to_be_near_keeps_the_ranking():
    hosts = ["b", "a", "c"]
    assert near_first(hosts, {}, {"a": "eu"}, "") == hosts


def test_the_rig_the_first_rank_holds_comes_before_cheaper_hosts_of_its_tier():
    hosts = ["cheap", "near", "rig"]
    regions = {"cheap": "us", "near": "eu", "rig": "us"}
    assert near_first(hosts, {}, regions, "eu", rig="rig") == ["rig", "near", "cheap"]


def test_before_any_rank_holds_a_host_a_rig_with_devices_for_every_rank_comes_first():
    hosts = ["cheap", "small-rig", "big-rig"]
    devices = {"small-rig": 2, "big-rig": 4}
    ordered = near_first(hosts, {}, {}, "", devices=devices, wanted=3)
    assert ordered == ["big-rig", "cheap", "small-rig"]


def test_a_rig_does_not_pass_a_host_with_a_record():
    entries = {"record": Entry.RECORD, "rig": Entry.NEWCOMER}
    ordered = near_first(["rig", "record"], entries, {}, "", devices={"rig": 2}, wanted=2)
    assert ordered == ["record", "rig"]
