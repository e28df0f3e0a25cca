"""Specs for cumulus_p2p.market.ledger: durable, deduplicated receipts."""

from pathlib import Path

import pytest

from cumulus_p2p._errors import LedgerCorruptError
from cumulus_p2p.identity import NodeIdentity
from cumulus_p2p.market.ledger import DISPUTES_FILE_NAME, LEDGER_FILE_NAME, Dispute, Ledger
from cumulus_p2p.market.messages import CountersignedReceipt, Receipt, seal_message

NOW = 1_700_000_000.0
HOST, CONSUMER = NodeIdentity.generate(), NodeIdentity.generate()


def receipt(seq, lease_id="L1", share_seconds=60):
    body = Receipt(
        lease_id,
        HOST.peer_id.to_base58(),
        seq,
        NOW + 60 * seq,
        NOW + 60 * (seq + 1),
        share_seconds,
        10,
        NOW + 600,
        seq + 1,
    )
    return CountersignedReceipt.countersign(CONSUMER, seal_message(HOST, body, now=NOW))


class RecordingRail:
    def __init__(self):
        self.seen = []

    def on_receipt(self, entry):
        self.seen.append(entry.receipt_id)


def ledger_of_two_receipts(tmp_path: Path) -> Path:
    """Append receipts 0 and 1 to a ledger under ``tmp_path``, close it; its file."""
    with Ledger.open(tmp_path) as ledger:
        ledger.append(receipt(0))
        ledger.append(receipt(1))
    return tmp_path / LEDGER_FILE_NAME


def test_receipts_survive_a_restart(tmp_path):
    with Ledger.open(tmp_path) as ledger:
        assert all(ledger.append(receipt(seq)) for seq in range(3))
    with Ledger.open(tmp_path) as reopened:
        assert [e.receipt_id for e in reopened.entries()] == ["L1/0", "L1/1", "L1/2"]
        assert reopened.totals("L1").share_seconds == 180
        assert reopened.entries().__next__().countersigned.verify(CONSUMER.public_key)


def test_a_receipt_appended_twice_counts_once_even_across_restarts(tmp_path):
    with Ledger.open(tmp_path) as ledger:
        assert ledger.append(receipt(0))
        assert not ledger.append(receipt(0))
    with Ledger.open(tmp_path) as reopened:
        assert not reopened.append(receipt(0))
        assert reopened.totals().receipts == 1


def test_a_torn_last_line_is_dropped_and_nothing_acknowledged_is_lost(tmp_path):
    path = ledger_of_two_receipts(tmp_path)
    acknowledged = path.read_bytes()
    # A crash mid-write: half of the third receipt's line reached the disk.
    with Ledger.open(tmp_path) as ledger:
        ledger.append(receipt(2))
    path.write_bytes(path.read_bytes()[: len(acknowledged) + 40])
    with Ledger.open(tmp_path) as recovered:
        assert len(recovered) == 2
        assert path.read_bytes() == acknowledged
        assert recovered.append(receipt(2))  # the consumer's retry
    with Ledger.open(tmp_path) as again:
        assert [e.receipt_id for e in again.entries()] == ["L1/0", "L1/1", "L1/2"]
        assert again.totals().share_seconds == 180


def test_damage_before_the_last_line_is_refused_untouched(tmp_path):
    path = ledger_of_two_receipts(tmp_path)
    damaged = path.read_bytes().replace(b'"id":"L1/0"', b'"id":"L1/9"')
    path.write_bytes(damaged)
    with pytest.raises(LedgerCorruptError, match="line 1"):
        Ledger.open(tmp_path)
    assert path.read_bytes() == damaged


def test_the_payment_rail_hears_each_new_receipt_once(tmp_path):
    rail = RecordingRail()
    with Ledger.open(tmp_path, rail=rail) as ledger:
        ledger.append(receipt(0))
        ledger.append(receipt(0))
        ledger.append(receipt(1, lease_id="L2"))
    assert rail.seen == ["L1/0", "L2/1"]
    catch_up = RecordingRail()
    with Ledger.open(tmp_path) as reopened:
        reopened.replay_to(catch_up)
    assert catch_up.seen == rail.seen


def test_a_dispute_keeps_the_hosts_claim_and_the_reason_across_restarts(tmp_path):
    claim = receipt(0).envelope
    with Ledger.open(tmp_path) as ledger:
        assert ledger.record_dispute(Dispute.of(claim, "bytes inflated", at=NOW))
        assert not ledger.record_dispute(Dispute.of(claim, "said again", at=NOW + 1))
    with Ledger.open(tmp_path) as reopened:
        (dispute,) = reopened.disputes()
        assert (dispute.receipt_id, dispute.reason, dispute.receipt) == (
            "L1/0",
            "bytes inflated",
            claim,
        )
        assert len(reopened) == 0


def test_a_damaged_dispute_line_is_refused_untouched(tmp_path):
    (tmp_path / DISPUTES_FILE_NAME).write_bytes(b'{"id": "L1/0", "receipt": "AAAA"}\n')
    with pytest.raises(LedgerCorruptError, match="line 1"):
        Ledger.open(tmp_path)
