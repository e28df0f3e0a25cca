"""Specs for cumulus_p2p.node.probe's verdict (sans-IO) and its sizing."""

import pytest

from cumulus_p2p.market import Offer
from cumulus_p2p.node.probe import ProbeFacts, judge, probe_size

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


def test_a_busy_device_somewhat_below_its_claim_passes():
    assert judge(OFFER, facts(perf=12_000)) is None


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
