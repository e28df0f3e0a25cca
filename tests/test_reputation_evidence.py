"""Specs for cumulus_p2p.reputation.evidence: records, reports and their checks."""

import pytest

from cumulus_p2p._errors import InvalidEvidenceError, InvalidMessageError, MalformedMessageError
from cumulus_p2p.envelope import Envelope
from cumulus_p2p.identity import NodeIdentity
from cumulus_p2p.market.messages import PriorityClass
from cumulus_p2p.reputation import (
    BadBlob,
    EvidenceKind,
    HeartbeatObservation,
    NonPayment,
    PerformanceObservation,
    Report,
    ServiceRecord,
    decode_report,
    encode_report,
    open_report,
)
from cumulus_p2p.reputation.testing import Minter, peer

NOW = 1_700_000_000.0
CONSUMER, HOST, OTHER = (NodeIdentity.generate() for _ in range(3))
MINT = Minter()
LEASE = MINT.lease(CONSUMER, HOST, start=NOW - 7200, duration_s=3600, shares=2)


def test_every_evidence_kind_survives_the_wire():
    records = [
        MINT.service(CONSUMER, HOST, LEASE, receipts=3),
        MINT.failure(HOST, LEASE, ended_at=NOW - 5000),
        HeartbeatObservation(peer(HOST), NOW - 60, NOW, 10, 7),
        PerformanceObservation(
            LEASE, HOST.public_key, MINT.offer(HOST, now=NOW - 8000, perf_units=100), 80, NOW - 7000
        ),
        MINT.nonpayment(HOST, LEASE),
        MINT.bad_blob(HOST, CONSUMER, now=NOW),
    ]
    for record in records:
        report = Report(peer(CONSUMER), peer(HOST), record, NOW, NOW + 60, MINT.nonce())
        assert decode_report(encode_report(report)) == report


def test_a_service_record_reports_its_receipted_volume():
    report, finding = open_report(
        MINT.report(
            CONSUMER, peer(HOST), MINT.service(CONSUMER, HOST, LEASE, fraction=0.5), now=NOW
        )
    )
    assert (finding.kind, finding.served, finding.credited) == (
        EvidenceKind.SERVICE,
        3600,
        peer(CONSUMER),
    )


def test_receipts_from_another_lease_do_not_check():
    other = MINT.lease(CONSUMER, HOST, start=NOW - 7200)
    mixed = ServiceRecord(LEASE, HOST.public_key, MINT.service(CONSUMER, HOST, other).receipts)
    with pytest.raises(InvalidEvidenceError, match="another lease"):
        mixed.check(peer(CONSUMER))


def test_a_performance_claim_must_use_the_offer_the_lease_names():
    wrong = MINT.offer(HOST, now=NOW - 8000, perf_units=100, offer_id="other")
    with pytest.raises(InvalidEvidenceError, match="not the one the lease names"):
        PerformanceObservation(LEASE, HOST.public_key, wrong, 10, NOW - 7000).check(peer(CONSUMER))


def test_measured_performance_below_the_claim_gives_the_ratio():
    offer = MINT.offer(HOST, now=NOW - 8000, perf_units=100)
    observed = PerformanceObservation(LEASE, HOST.public_key, offer, 25, NOW - 7000)
    assert observed.check(peer(CONSUMER)).ratio == 0.25


@pytest.mark.parametrize("priority", [PriorityClass.CONTEND, PriorityClass.INTERRUPTIBLE])
def test_a_lease_below_on_demand_cannot_claim_the_device_is_slow(priority):
    lease = MINT.lease(CONSUMER, HOST, start=NOW - 7200, priority=priority)
    offer = MINT.offer(HOST, now=NOW - 8000, perf_units=100)
    with pytest.raises(InvalidEvidenceError, match="only an on-demand lease measures"):
        PerformanceObservation(lease, HOST.public_key, offer, 5, NOW - 7000).check(peer(CONSUMER))


def test_a_nonpayment_claim_is_about_the_consumer_and_weighed_by_the_host():
    report, finding = open_report(
        MINT.report(HOST, peer(CONSUMER), MINT.nonpayment(HOST, LEASE), now=NOW)
    )
    assert (finding.kind, finding.host, finding.credited) == (
        EvidenceKind.NONPAYMENT,
        peer(CONSUMER),
        peer(HOST),
    )


def test_only_the_lease_host_may_claim_nonpayment():
    with pytest.raises(InvalidEvidenceError, match="not the lease's host"):
        MINT.nonpayment(HOST, LEASE).check(peer(CONSUMER))


def test_a_nonpayment_claim_needs_a_receipt_the_host_signed_for_that_lease():
    other = MINT.lease(CONSUMER, HOST, start=NOW - 7200)
    foreign = NonPayment(LEASE, HOST.public_key, MINT.nonpayment(HOST, other).receipt)
    with pytest.raises(InvalidEvidenceError, match="not for this lease"):
        foreign.check(peer(HOST))
    elsewhere = MINT.lease(CONSUMER, OTHER, start=NOW - 7200)
    forged = NonPayment(LEASE, HOST.public_key, MINT.nonpayment(OTHER, elsewhere).receipt)
    with pytest.raises(InvalidEvidenceError, match="not signed by the lease's host"):
        forged.check(peer(HOST))


def test_a_host_cannot_report_its_own_heartbeats():
    with pytest.raises(InvalidEvidenceError):
        HeartbeatObservation(peer(HOST), NOW - 60, NOW, 10, 10).check(peer(HOST))


def test_an_invalid_record_cannot_be_built():
    with pytest.raises(InvalidMessageError):
        HeartbeatObservation(peer(HOST), NOW, NOW - 60, 10, 11)


def test_a_non_canonical_report_body_is_malformed():
    report = Report(
        peer(CONSUMER),
        peer(HOST),
        HeartbeatObservation(peer(HOST), NOW - 60, NOW, 10, 7),
        NOW,
        NOW + 60,
        1,
    )
    body = bytearray(encode_report(report))
    body[-1] = 0xCC  # the nonce 1 re-encoded as a uint8: same value, other bytes
    with pytest.raises(MalformedMessageError):
        decode_report(bytes(body) + b"\x01")


def test_a_host_that_signed_it_served_other_bytes_is_reported_by_the_host_it_served():
    _, finding = open_report(
        MINT.report(CONSUMER, peer(HOST), MINT.bad_blob(HOST, CONSUMER, now=NOW), now=NOW)
    )
    assert (finding.kind, finding.host, finding.credited, finding.at) == (
        EvidenceKind.BADBLOB,
        peer(HOST),
        peer(CONSUMER),
        NOW,
    )


def test_a_statement_that_the_blob_asked_for_was_served_is_no_evidence():
    honest = BadBlob(MINT.served(HOST, CONSUMER, now=NOW, honest=True))
    with pytest.raises(InvalidEvidenceError, match="served the blob asked for"):
        honest.check(peer(CONSUMER))


def test_only_the_host_that_was_served_may_report_a_bad_blob():
    with pytest.raises(InvalidEvidenceError, match="not the host that was served"):
        MINT.bad_blob(HOST, CONSUMER, now=NOW).check(peer(OTHER))


def test_a_bad_blob_statement_whose_signature_does_not_check_is_no_evidence():
    real = MINT.served(HOST, CONSUMER, now=NOW)
    # The same words, put in the host's mouth by another key.
    signature = OTHER.sign(real.signing_bytes())
    forged = Envelope(real.kind, HOST.public_key, real.body, real.expires_at, real.nonce, signature)
    with pytest.raises(InvalidEvidenceError, match="signature"):
        BadBlob(forged).check(peer(CONSUMER))
