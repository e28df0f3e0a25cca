"""Specs for cumulus_p2p.market.gang: which devices a job of N GPUs leases."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cumulus_p2p.market.gang import UNKNOWN_RTT_MS, plan_gang, rtt_via_consumer
from cumulus_p2p.market.matcher import RankedOffer
from cumulus_p2p.market.messages import MAX_GPUS, Offer


def device(host: str, index: int = 0, price: float = 10.0) -> RankedOffer:
    offer = Offer(host, f"gpu{index}", "A100", 40, 10, 4, 10, 0, "", 0.0, 100.0, 1)
    return RankedOffer(offer, 4, price, 0.5, 20.0)


def table(**pairs: float):
    """Round trips between hosts, named ``a_b=ms``; any other pair is unknown."""
    known = {frozenset(name.split("_")): ms for name, ms in pairs.items()}

    def rtt(a: str, b: str) -> float | None:
        return 0.0 if a == b else known.get(frozenset((a, b)))

    return rtt


def test_a_rig_with_enough_free_devices_takes_the_whole_job_though_it_is_dearer():
    ranked = [device("a", price=5), device("b", price=5), device("rig", 0, 9), device("rig", 1, 9)]
    gang = plan_gang(ranked, 2, rtt_ms=table(a_b=1.0))
    assert gang is not None
    assert gang.hosts == ("rig",) and gang.diameter_ms == 0.0
    assert [m.offer.offer_id for m in gang.members] == ["gpu0", "gpu1"]


def test_across_hosts_the_closest_ones_win_over_cheaper_ones_far_apart():
    ranked = [device("near1", price=9), device("near2", price=9)]
    ranked += [device("far1", price=1), device("far2", price=1)]
    far = dict(near1_far1=90.0, near1_far2=90.0, near2_far1=90.0, near2_far2=90.0)
    rtt = table(near1_near2=2.0, far1_far2=80.0, **far)
    gang = plan_gang(ranked, 2, rtt_ms=rtt)
    assert gang is not None and set(gang.hosts) == {"near1", "near2"}
    assert gang.diameter_ms == 2.0


def test_among_hosts_as_close_the_fewest_then_the_cheapest_win():
    two = [device("pair", 0, 8), device("pair", 1, 8)]
    singles = [device("x", price=1), device("y", price=1), device("z", price=1)]
    gang = plan_gang(two + singles, 3)  # every round trip unknown: all equally close
    assert gang is not None
    assert gang.hosts[0] == "pair" and len(gang.hosts) == 2
    assert gang.diameter_ms == UNKNOWN_RTT_MS
    assert gang.price == 8 + 8 + 1


def test_ranks_on_one_host_are_neighbours():
    ranked = [device("a", 0), device("b", 0), device("a", 1), device("b", 1)]
    gang = plan_gang(ranked, 4, rtt_ms=table(a_b=5.0))
    assert gang is not None
    hosts = [m.offer.host for m in gang.members]
    assert hosts in (["a", "a", "b", "b"], ["b", "b", "a", "a"])


def test_fewer_devices_than_the_job_needs_plan_nothing():
    assert plan_gang([device("a", 0), device("b", 0)], 3) is None
    assert plan_gang([], 1) is None


@pytest.mark.parametrize("gpus", [0, -1, MAX_GPUS + 1])
def test_a_gang_size_out_of_range_is_refused(gpus):
    with pytest.raises(ValueError, match="1 to 64 GPUs"):
        plan_gang([device("a")], gpus)


def test_an_offer_ranked_twice_is_refused():
    with pytest.raises(ValueError, match="ranked twice"):
        plan_gang([device("a"), device("a")], 1)


def test_round_trips_through_the_consumer_bound_those_between_hosts():
    rtt = rtt_via_consumer({"a": 10.0, "b": 30.0})
    assert rtt("a", "b") == 40.0
    assert rtt("a", "a") == 0.0
    assert rtt("a", "unmeasured") is None


@st.composite
def markets(draw):
    hosts = draw(st.lists(st.sampled_from("abcdef"), min_size=1, max_size=12))
    counts: dict[str, int] = {}
    ranked = []
    for host in hosts:
        index = counts[host] = counts.get(host, -1) + 1
        ranked.append(device(host, index, draw(st.floats(1, 100))))
    distances = {
        frozenset(pair): draw(st.floats(0.5, 200)) for pair in itertools.combinations("abcdef", 2)
    }
    gpus = draw(st.integers(1, len(ranked) + 1))
    return ranked, distances, gpus


@given(markets())
def test_a_gang_is_n_distinct_offered_devices_whose_diameter_is_its_farthest_pair(market):
    ranked, distances, gpus = market
    rtt = lambda a, b: 0.0 if a == b else distances[frozenset((a, b))]  # noqa: E731
    gang = plan_gang(ranked, gpus, rtt_ms=rtt)
    if gpus > len(ranked):
        assert gang is None
        return
    assert gang is not None
    keys = [(m.offer.host, m.offer.offer_id) for m in gang.members]
    assert len(keys) == gpus == len(set(keys))
    assert all(m in ranked for m in gang.members)
    assert set(gang.hosts) == {m.offer.host for m in gang.members}
    farthest = max((rtt(a, b) for a, b in itertools.combinations(gang.hosts, 2)), default=0.0)
    assert gang.diameter_ms == farthest
    if any(sum(m.offer.host == h for m in ranked) >= gpus for h in "abcdef"):
        assert len(gang.hosts) == 1  # a rig that fits always wins
