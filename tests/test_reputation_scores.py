"""Specs for cumulus_p2p.reputation.scores: the Beta posterior, volume and decay."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cumulus_p2p.reputation import EvidenceKind, Finding, ScoringPolicy, beta_score, outcomes
from cumulus_p2p.reputation.scores import score_hosts

POLICY = ScoringPolicy(half_life_s=1000.0)
NOW = 1_000_000.0
counts = st.floats(min_value=0.0, max_value=1e5, allow_nan=False)


def service(at, served=3600, key=b"L1"):
    return Finding(
        b"s" + key,
        EvidenceKind.SERVICE,
        "h",
        "c",
        at,
        lease_key=key,
        served=served,
        served_until=at,
        lease_shares=1,
        lease_end=at,
    )


def failure(at, lease_end, key=b"L1"):
    return Finding(
        b"f" + key,
        EvidenceKind.FAILURE,
        "h",
        "c",
        at,
        lease_key=key,
        served_until=at,
        lease_shares=1,
        lease_end=lease_end,
    )


def score(findings, now=NOW):
    return score_hosts(outcomes(findings, now=now, policy=POLICY), {"c": 1.0}, policy=POLICY)["h"]


@settings(max_examples=200, deadline=None)
@given(counts, counts)
def test_scores_stay_in_the_unit_interval_with_the_bound_below_the_mean(s, f):
    result = beta_score("h", s, f, POLICY)
    assert 0.0 <= result.lower_bound <= result.mean <= 1.0


@settings(max_examples=200, deadline=None)
@given(counts, counts, st.floats(min_value=1e-6, max_value=1e4))
def test_adding_a_success_never_lowers_a_score(s, f, extra):
    before, after = beta_score("h", s, f, POLICY), beta_score("h", s + extra, f, POLICY)
    assert after.mean >= before.mean
    assert after.lower_bound >= before.lower_bound - 1e-12


@settings(max_examples=200, deadline=None)
@given(counts, counts, st.floats(min_value=1e-6, max_value=1e4))
def test_adding_a_failure_never_raises_a_score(s, f, extra):
    before, after = beta_score("h", s, f, POLICY), beta_score("h", s, f + extra, POLICY)
    assert after.mean <= before.mean
    assert after.lower_bound <= before.lower_bound + 1e-12


def test_evidence_decays_with_age():
    fresh, old = score([service(NOW)]), score([service(NOW - 2000.0)])
    assert old.evidence_weight == pytest.approx(fresh.evidence_weight / 4)
    assert old.lower_bound < fresh.lower_bound


def test_old_evidence_fades_back_to_the_prior():
    faded = score([service(NOW)] * 1, now=NOW + 100 * POLICY.half_life_s)
    assert faded.mean == pytest.approx(POLICY.prior_mean)


def test_success_is_weighted_by_paid_volume():
    small, large = score([service(NOW, served=360)]), score([service(NOW, served=36_000)])
    assert large.successes == pytest.approx(100 * small.successes)


def test_a_failure_claim_counts_only_the_unserved_part_of_the_lease():
    half = score([service(NOW, served=1800), failure(NOW, lease_end=NOW + 1800)])
    assert half.failures == pytest.approx(POLICY.failure_penalty * 1800 / 3600)


def test_receipts_covering_the_whole_lease_void_a_failure_claim():
    covered = score([service(NOW, served=3600), failure(NOW - 3600, lease_end=NOW)])
    assert covered.failures == 0.0


def test_a_report_from_a_peer_without_credibility_counts_for_nothing():
    items = outcomes([service(NOW)], now=NOW, policy=POLICY)
    assert score_hosts(items, {}, policy=POLICY)["h"].evidence_weight == 0.0


def nonpayment(unpaid_until, key=b"L1"):
    # About the consumer "c", weighed by the host "h" that reports it.
    return Finding(
        b"n" + key,
        EvidenceKind.NONPAYMENT,
        "c",
        "h",
        unpaid_until,
        lease_key=key,
        served_until=unpaid_until,
        lease_shares=1,
        lease_end=unpaid_until + 3600,
    )


def consumer_score(findings):
    items = outcomes(findings, now=NOW, policy=POLICY)
    return score_hosts(items, {"h": 1.0, "c": 1.0}, policy=POLICY, hosts=["c"])["c"]


def test_an_unpaid_lease_lowers_its_consumers_score():
    assert consumer_score([nonpayment(NOW)]).failures == pytest.approx(POLICY.nonpayment_weight)
    assert consumer_score([nonpayment(NOW)]).mean < consumer_score([]).mean


def test_a_countersigned_receipt_voids_a_nonpayment_claim():
    paid = consumer_score([service(NOW, served=60), nonpayment(NOW)])
    assert paid.failures == 0.0


def test_a_bad_blob_adds_failures_to_the_host_that_served_it():
    bad = Finding(b"b1", EvidenceKind.BADBLOB, "h", "c", NOW)
    assert score([bad]).failures == pytest.approx(POLICY.bad_blob_weight)
    assert score([bad]).mean < POLICY.prior_mean
