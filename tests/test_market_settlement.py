"""Specs for cumulus_p2p.market.settlement: the consumer's receipt desk (sans-IO)."""

import pytest

from cumulus_p2p._errors import EnvelopeRejectedError, MalformedMessageError, ReceiptRejectedError
from cumulus_p2p.identity import NodeIdentity
from cumulus_p2p.market.ledger import Ledger
from cumulus_p2p.market.messages import Receipt, seal_message
from cumulus_p2p.market.metering import Meter
from cumulus_p2p.market.settlement import ReceiptDesk
from cumulus_p2p.testing.market import lease_proposal

NOW = 1_700_000_000.0
HOST, CONSUMER, MALLORY = (NodeIdentity.generate() for _ in range(3))
HOST_ID = HOST.peer_id.to_base58()
LEASE = lease_proposal(CONSUMER, HOST, start_at=NOW, duration_s=150, shares=2)


@pytest.fixture
def desk(tmp_path):
    with Ledger.open(tmp_path) as ledger:
        desk = ReceiptDesk(CONSUMER, ledger)
        desk.open_account(LEASE)
        yield desk


def test_a_fitting_receipt_is_countersigned_and_recorded(desk):
    raw = Meter(HOST, LEASE, interval=60).issue(NOW + 60, nonce=1).to_bytes()
    signed = desk.countersign(raw, sender=HOST_ID, now=NOW + 60)
    assert signed.verify(CONSUMER.public_key).share_seconds == 120
    assert [e.receipt_id for e in desk.ledger.entries()] == [signed.receipt.receipt_id]


def test_receipts_must_follow_each_other(desk):
    meter = Meter(HOST, LEASE, interval=60)
    meter.issue(NOW + 60, nonce=1)  # never delivered
    second = meter.issue(NOW + 120, nonce=2).to_bytes()
    with pytest.raises(ReceiptRejectedError):
        desk.countersign(second, sender=HOST_ID, now=NOW + 120)
    assert len(desk.ledger) == 0


def test_a_receipt_for_a_lease_never_opened_is_refused(desk):
    other = lease_proposal(
        CONSUMER, HOST, start_at=NOW, duration_s=150, lease_id="L2", shares=2, nonce=2
    )
    raw = Meter(HOST, other, interval=60).issue(NOW + 60, nonce=1).to_bytes()
    with pytest.raises(ReceiptRejectedError, match="no lease"):
        desk.countersign(raw, sender=HOST_ID, now=NOW + 60)


def test_a_receipt_relayed_by_another_peer_is_refused(desk):
    raw = Meter(HOST, LEASE, interval=60).issue(NOW + 60, nonce=1).to_bytes()
    with pytest.raises(ReceiptRejectedError, match="only from its host"):
        desk.countersign(raw, sender=MALLORY.peer_id.to_base58(), now=NOW + 60)


def test_a_receipt_delivered_again_gets_the_same_countersignature_and_is_recorded_once(desk):
    # The host asks again when our answer was lost on the way; refusing would leave a
    # paid receipt unsettled (and the lease paused for it).
    raw = Meter(HOST, LEASE, interval=60).issue(NOW + 60, nonce=1).to_bytes()
    first = desk.countersign(raw, sender=HOST_ID, now=NOW + 60)
    assert desk.countersign(raw, sender=HOST_ID, now=NOW + 61) == first
    assert len(desk.ledger) == 1


def test_a_replayed_receipt_that_was_never_countersigned_is_refused(desk):
    meter = Meter(HOST, LEASE, interval=60)
    raw = meter.issue(NOW + 60, nonce=1).to_bytes()
    with pytest.raises(ReceiptRejectedError):
        desk.countersign(raw, sender=HOST_ID, now=NOW + 1)  # charges ahead of our clock
    with pytest.raises(EnvelopeRejectedError, match="already seen"):
        desk.countersign(raw, sender=HOST_ID, now=NOW + 60)
    assert len(desk.ledger) == 0


def inflated(share_seconds=120, bytes_moved=0, end=NOW + 60, peer_bytes=0):
    receipt = Receipt(
        "L1", HOST_ID, 0, NOW, end, share_seconds, bytes_moved, NOW + 600, 7, peer_bytes
    )
    return seal_message(HOST, receipt, now=end)


def test_more_share_seconds_than_the_lease_allows_is_refused_and_disputed(desk):
    with pytest.raises(ReceiptRejectedError, match="share-seconds"):
        desk.countersign(inflated(share_seconds=121).to_bytes(), sender=HOST_ID, now=NOW + 60)
    (dispute,) = desk.ledger.disputes()
    assert dispute.receipt_id == "L1/0" and "share-seconds" in dispute.reason
    assert len(desk.ledger) == 0


def test_a_standby_lease_is_countersigned_for_its_gib_seconds_and_no_more(tmp_path):
    standby = lease_proposal(
        CONSUMER, HOST, lease_id="S1", start_at=NOW, duration_s=150, storage_gib=4
    )
    with Ledger.open(tmp_path) as ledger:
        desk = ReceiptDesk(CONSUMER, ledger)
        desk.open_account(standby)
        fair = Meter(HOST, standby, interval=60).issue(NOW + 60, nonce=1)
        assert (
            desk.countersign(fair.to_bytes(), sender=HOST_ID, now=NOW + 60).receipt.share_seconds
            == 240
        )
        over = Receipt("S1", HOST_ID, 1, NOW + 60, NOW + 120, 241, 0, NOW + 600, 2)
        with pytest.raises(ReceiptRejectedError, match="GiB-seconds"):
            desk.countersign(
                seal_message(HOST, over, now=NOW + 120).to_bytes(), sender=HOST_ID, now=NOW + 120
            )
        assert [d.receipt_id for d in ledger.disputes()] == ["S1/1"]
        assert ledger.totals("S1").share_seconds == 240


def test_a_receipt_running_past_the_consumers_clock_is_refused_and_disputed(desk):
    with pytest.raises(ReceiptRejectedError, match="past this consumer's clock"):
        desk.countersign(inflated().to_bytes(), sender=HOST_ID, now=NOW + 60 - 30)
    assert [d.receipt_id for d in desk.ledger.disputes()] == ["L1/0"]


@pytest.fixture
def counting(tmp_path):
    """A desk that has counted 100,000 bytes on its link and 8,000,000 between hosts
    under ``L1``, with a tolerance of 1,000 bytes or 1%."""
    with Ledger.open(tmp_path) as ledger:
        desk = ReceiptDesk(CONSUMER, ledger, bytes_tolerance=(1000, 0.01))
        desk.open_account(LEASE, counts_bytes=True)
        desk.count_bytes("L1", 100_000)
        desk.count_peer_bytes("L1", 8_000_000)
        yield desk


def test_bytes_beyond_the_consumers_own_count_are_refused_and_disputed(counting):
    with pytest.raises(ReceiptRejectedError, match="counted 100000"):
        counting.countersign(inflated(bytes_moved=101_001).to_bytes(), sender=HOST_ID, now=NOW + 60)
    assert [d.receipt_id for d in counting.ledger.disputes()] == ["L1/0"]


def test_bytes_within_the_tolerance_of_the_consumers_count_are_countersigned(counting):
    counting.countersign(inflated(bytes_moved=101_000).to_bytes(), sender=HOST_ID, now=NOW + 60)
    assert len(counting.ledger) == 1 and not list(counting.ledger.disputes())


def test_bytes_between_hosts_beyond_the_consumers_count_of_its_collectives_are_refused(counting):
    receipt = inflated(bytes_moved=100_000, peer_bytes=8_080_001)
    with pytest.raises(ReceiptRejectedError, match="bytes between hosts .* counted 8000000"):
        counting.countersign(receipt.to_bytes(), sender=HOST_ID, now=NOW + 60)
    assert [d.receipt_id for d in counting.ledger.disputes()] == ["L1/0"]


def test_bytes_between_hosts_within_the_consumers_count_are_countersigned(counting):
    receipt = inflated(bytes_moved=100_000, peer_bytes=8_080_000)
    counting.countersign(receipt.to_bytes(), sender=HOST_ID, now=NOW + 60)
    assert counting.ledger.get("L1/0").peer_bytes == 8_080_000
    assert not list(counting.ledger.disputes())


@pytest.mark.parametrize("raw", [b"", b"\x00" * 10, b"\x93\x01\x02\x03"])
def test_garbage_is_refused_as_malformed(desk, raw):
    with pytest.raises((MalformedMessageError, EnvelopeRejectedError)):
        desk.countersign(raw, sender=HOST_ID, now=NOW)
    assert len(desk.ledger) == 0
