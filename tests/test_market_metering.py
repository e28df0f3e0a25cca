"""Specs for cumulus_p2p.market.metering: host receipts, consumer checks."""

import pytest

from cumulus_p2p._errors import EnvelopeRejectedError, ReceiptRejectedError
from cumulus_p2p.envelope import Rejection
from cumulus_p2p.identity import NodeIdentity
from cumulus_p2p.market.messages import (
    CountersignedReceipt,
    Receipt,
    seal_message,
)
from cumulus_p2p.market.metering import Meter, Standing, check_receipt, payment_standing
from cumulus_p2p.testing.market import lease_proposal

NOW = 1_700_000_000.0
HOST, CONSUMER, MALLORY = (NodeIdentity.generate() for _ in range(3))
LEASE = lease_proposal(CONSUMER, HOST, start_at=NOW, duration_s=150, shares=2)


def test_receipts_cover_the_lease_in_intervals_and_countersign():
    meter = Meter(HOST, LEASE, interval=60.0)
    assert not meter.due(NOW + 59)
    meter.record_bytes(1000)
    previous, receipts = None, []
    for t, nonce in [(NOW + 60, 1), (NOW + 120, 2), (NOW + 200, 3)]:
        assert meter.due(t)
        envelope, previous = check_receipt(
            meter.issue(t, nonce=nonce).to_bytes(), LEASE, now=t, previous=previous
        )
        receipts.append(previous)
        signed = CountersignedReceipt.countersign(CONSUMER, envelope)
        assert signed.verify(CONSUMER.public_key) == previous
    assert meter.finished and not meter.due(NOW + 1000)
    assert [r.share_seconds for r in receipts] == [120, 120, 60]
    assert [r.bytes_moved for r in receipts] == [1000, 0, 0]


def test_a_receipt_carries_the_bytes_its_interval_s_collectives_moved_between_hosts():
    meter = Meter(HOST, LEASE, interval=60.0)
    meter.record_peer_bytes(4096)
    meter.record_peer_bytes(1024)
    _, first = check_receipt(meter.issue(NOW + 60, nonce=1).to_bytes(), LEASE, now=NOW + 60)
    raw = meter.issue(NOW + 120, nonce=2).to_bytes()
    _, second = check_receipt(raw, LEASE, now=NOW + 120, previous=first)
    assert (first.peer_bytes, second.peer_bytes) == (5120, 0)
    with pytest.raises(ValueError, match="negative"):
        meter.record_peer_bytes(-1)


def test_a_standby_lease_is_metered_in_gib_seconds_and_both_sides_agree():
    standby = lease_proposal(
        CONSUMER, HOST, lease_id="S1", start_at=NOW, duration_s=150, storage_gib=10, price=36
    )
    meter = Meter(HOST, standby, interval=60.0)
    previous, receipts = None, []
    for t, nonce in [(NOW + 60, 1), (NOW + 120, 2), (NOW + 200, 3)]:
        _, previous = check_receipt(
            meter.issue(t, nonce=nonce).to_bytes(), standby, now=t, previous=previous
        )
        receipts.append(previous)
    # 10 GiB held for 150 s, at 36 micro-credits per GiB-hour.
    assert [r.share_seconds for r in receipts] == [600, 600, 300]
    assert standby.owed(sum(r.share_seconds for r in receipts)) == 10 * 150 * 36 // 3600


def test_a_standby_receipt_charging_more_gib_seconds_than_leased_is_rejected():
    standby = lease_proposal(
        CONSUMER, HOST, lease_id="S1", start_at=NOW, duration_s=150, storage_gib=10
    )
    inflated = Receipt("S1", standby.host, 0, NOW, NOW + 60, 601, 0, NOW + 600, 1)
    raw = seal_message(HOST, inflated, now=NOW + 60).to_bytes()
    with pytest.raises(ReceiptRejectedError, match="601 GiB-seconds, at most 600"):
        check_receipt(raw, standby, now=NOW + 60)
    fair = Receipt("S1", standby.host, 0, NOW, NOW + 60, 600, 0, NOW + 600, 2)
    check_receipt(seal_message(HOST, fair, now=NOW + 60).to_bytes(), standby, now=NOW + 60)


def test_a_receipt_charging_more_than_leased_is_rejected():
    inflated = Receipt("L1", LEASE.host, 0, NOW, NOW + 60, 121, 0, NOW + 600, 1)
    raw = seal_message(HOST, inflated, now=NOW + 60).to_bytes()
    with pytest.raises(ReceiptRejectedError):
        check_receipt(raw, LEASE, now=NOW + 60)


def test_an_overlapping_receipt_is_rejected():
    first = Receipt("L1", LEASE.host, 0, NOW, NOW + 60, 120, 0, NOW + 600, 1)
    overlap = Receipt("L1", LEASE.host, 1, NOW, NOW + 60, 120, 0, NOW + 600, 2)
    raw = seal_message(HOST, overlap, now=NOW + 60).to_bytes()
    with pytest.raises(ReceiptRejectedError):
        check_receipt(raw, LEASE, now=NOW + 60, previous=first)


def test_a_receipt_from_another_host_is_rejected():
    forged = Receipt("L1", MALLORY.peer_id.to_base58(), 0, NOW, NOW + 60, 1, 0, NOW + 600, 1)
    with pytest.raises(ReceiptRejectedError):
        check_receipt(seal_message(MALLORY, forged, now=NOW).to_bytes(), LEASE, now=NOW + 60)


def test_an_expired_receipt_is_rejected():
    raw = Meter(HOST, LEASE, receipt_ttl=10).issue(NOW + 60, nonce=1).to_bytes()
    with pytest.raises(EnvelopeRejectedError) as info:
        check_receipt(raw, LEASE, now=NOW + 70)
    assert info.value.reason is Rejection.EXPIRED


def test_a_late_receipt_pauses_the_session_after_one_grace_period_and_ends_it_after_two():
    def at(now):
        return payment_standing(100.0, now=now, grace=10.0)

    assert [at(105.0), at(115.0), at(125.0)] == [
        Standing.CURRENT,
        Standing.PAUSED,
        Standing.DEFAULTED,
    ]
    assert payment_standing(None, now=1e9, grace=10.0) is Standing.CURRENT
