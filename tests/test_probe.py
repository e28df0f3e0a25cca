"""Specs for cumulus_p2p.node.probe's verdict (sans-IO) and its sizing."""

import pytest

from cumulus_p2p.market import Offer
from cumulus_p2p.node.probe import ATTEMPTS, ProbeFacts, best_of, judge, probe_size

OFFER = Offer(
    "host", "device0", "NVIDIA H100 80GB HBM3", 81920, 50_000, 4, 1000, 0, "", 0.0, 60.0, 1
)


def facts(name="NVIDIA H100 80GB HBM3", perf=48_000):
    return ProbeFacts("cuda:0", name, 20 * 2**30, perf, 0.5)


def test_a_device_that_fits_its_offer_passes():
    assert judge(OFFER, facts()) is None


def test_another_model_than_offered_is_a_misrepresentation():
    assert "runs on 'cpu'" in judge(OFFER, facts(name="cpu"))


def test_far_less_performance_than_claimed_is_a_misrepresentation():
    assert "measured 60" in judge(OFFER, facts(perf=60))


def test_a_tenant_below_on_demand_judges_the_model_but_not_its_share_of_the_speed():
    assert judge(OFFER, facts(perf=60), on_demand=False) is None
    assert "runs on 'cpu'" in judge(OFFER, facts(name="cpu"), on_demand=False)


def test_a_busy_device_somewhat_below_its_claim_passes():
    assert judge(OFFER, facts(perf=12_000)) is None


def measurements(*perfs):
    """A ``measure_once`` that reads ``perfs`` in turn, and the list of those it read."""
    taken = []

    def once():
        taken.append(perfs[len(taken)])
        return facts(perf=taken[-1])

    return once, taken


def test_a_device_that_meets_its_claim_is_measured_once():
    once, taken = measurements(48_000, 48_000)
    assert best_of(once, claimed_perf=50_000, pause_s=0).perf_units == 48_000
    assert taken == [48_000]


def test_a_busy_device_measured_short_once_is_measured_again_and_judged_on_its_best():
    # A host whose machine is busy for a moment: short, then short, then as claimed.
    once, taken = measurements(900, 3_000, 40_000)
    best = best_of(once, claimed_perf=50_000, pause_s=0)
    assert taken == [900, 3_000, 40_000]
    assert best.perf_units == 40_000 and best.seconds == 3 * 0.5
    assert judge(OFFER, best) is None


def test_a_device_a_hundredfold_short_is_judged_at_once_without_measuring_again():
    # A CPU offered as a GPU: no load on the host explains a thousandth of the claim.
    once, taken = measurements(40, 40_000)
    best = best_of(once, claimed_perf=50_000, pause_s=0)
    assert taken == [40]
    assert "measured 40" in judge(OFFER, best)


def test_a_small_claim_measured_at_zero_units_is_measured_again():
    # 0 units is anything under 1 (a first product slowed past the budget by a busy host):
    # for a claim of 1 that is no proof of a lie.
    once, taken = measurements(0, 3)
    best = best_of(once, claimed_perf=1, pause_s=0)
    assert taken == [0, 3]
    assert best.perf_units == 3


def test_the_pause_before_each_new_measurement_doubles(monkeypatch):
    # A burst of other work on the host gets 0.5 + 1 + 2 + 4 s to pass, not 0.5 s each.
    pauses = []
    monkeypatch.setattr("cumulus_p2p.node.probe.time.sleep", pauses.append)
    once, _ = measurements(*[2_000] * ATTEMPTS)  # 4% of the claim: a busy host, maybe
    best_of(once, claimed_perf=50_000, pause_s=0.5)
    assert pauses == [0.5 * 2**i for i in range(ATTEMPTS - 1)]


def test_a_device_short_every_time_is_a_misrepresentation_after_every_attempt():
    once, taken = measurements(*[2_000 + i for i in range(ATTEMPTS + 1)])
    best = best_of(once, claimed_perf=50_000, pause_s=0)
    assert len(taken) == ATTEMPTS
    assert f"measured {2_000 + ATTEMPTS - 1}" in judge(OFFER, best)


@pytest.mark.parametrize("claim, side", [(50, 384), (60_000, 3904), (10**9, 8192), (0, 128)])
def test_one_probe_product_takes_about_two_milliseconds_at_the_claimed_speed(claim, side):
    assert probe_size(claim) == side


@pytest.mark.parametrize(
    "wire",
    [
        None,
        [],
        {"device": "cpu"},
        facts().to_wire() | {"perf_units": -1},
        facts().to_wire() | {"seconds": "soon"},
    ],
)
def test_malformed_probe_facts_are_refused(wire):
    with pytest.raises(ValueError):
        ProbeFacts.from_wire(wire)


def test_probe_facts_survive_the_wire():
    assert ProbeFacts.from_wire(facts().to_wire()) == facts()
