"""The ledger: countersigned usage receipts, durable across restarts and crashes.

Storage is one append-only JSON-lines file, ``ledger.jsonl`` in the data directory.
Each line holds one countersigned receipt (its canonical bytes, base64) and its id.

Theory of operation
-------------------
``append`` writes one whole line and fsyncs before returning: a receipt is
*acknowledged* exactly when ``append`` returns. A crash can therefore only damage the
last line, and only a line that was never acknowledged, which shows as a final line
without its newline. On open, such a torn tail is cut off (and the cut fsynced);
damage anywhere else raises ``LedgerCorruptError`` and changes nothing, because it
means acknowledged data was lost and a person must look. Receipts are deduplicated by
``receipt_id`` both on append and on load, so a receipt delivered twice, or a retry
after a crash, is never counted twice.

Disputes go beside the receipts, in ``disputes.jsonl`` with the same durability: a
receipt one side refused (an inflated charge, say), with the refusal's reason and the
host-signed receipt itself, so that either side can show what was claimed.

Payment rails plug in through the ``PaymentRail`` protocol: the ledger calls
``rail.on_receipt(entry)`` after each new receipt is durable. A crash between the
fsync and that call would skip one notification, so rails must be idempotent by
``receipt_id`` and may be re-fed everything with ``Ledger.replay_to(rail)`` at start.

The ledger stores what it is given: verify receipts (``CountersignedReceipt.verify``)
before appending them. I/O here is plain blocking file I/O; from trio, call it through
``trio.to_thread.run_sync``.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Protocol

from .._errors import EnvelopeRejectedError, LedgerCorruptError, MalformedMessageError
from ..envelope import Envelope
from .messages import CountersignedReceipt, Receipt, open_message

__all__ = [
    "DISPUTES_FILE_NAME",
    "LEDGER_FILE_NAME",
    "Dispute",
    "Ledger",
    "LedgerEntry",
    "LedgerTotals",
    "PaymentRail",
]

LEDGER_FILE_NAME = "ledger.jsonl"
DISPUTES_FILE_NAME = "disputes.jsonl"
_MAX_REASON = 500


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    """One recorded receipt.

    ``share_seconds`` is the receipt's: share-seconds under a compute lease, GiB-seconds
    under a standby lease (``LeaseProposal.units``); price it with the lease's
    ``LeaseProposal.owed``.
    """

    receipt_id: str
    lease_id: str
    host: str
    share_seconds: int
    bytes_moved: int
    interval_start: float
    interval_end: float
    countersigned: CountersignedReceipt
    #: Bytes the lease's collectives carried between its job's hosts (the receipt's).
    peer_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Dispute:
    """A receipt one side refused: what the host claimed, and why it was refused."""

    receipt_id: str
    lease_id: str
    host: str
    reason: str
    at: float
    receipt: Envelope

    @classmethod
    def of(cls, envelope: Envelope, reason: str, *, at: float) -> Dispute:
        """The dispute over the host-signed receipt ``envelope``.

        Raises:
            MalformedMessageError: The envelope does not hold a receipt.
        """
        receipt = open_message(envelope)
        if type(receipt) is not Receipt:
            raise MalformedMessageError("a dispute is about a receipt")
        return cls(
            receipt.receipt_id, receipt.lease_id, receipt.host, reason[:_MAX_REASON], at, envelope
        )


@dataclass(frozen=True, slots=True)
class LedgerTotals:
    """Usage summed over receipts (``share_seconds`` adds up each lease's units: ask per
    lease where compute and standby leases mix)."""

    receipts: int
    share_seconds: int
    bytes_moved: int


class PaymentRail(Protocol):
    """Where settled usage goes: a payment channel, a credit system, an invoice file."""

    def on_receipt(self, entry: LedgerEntry) -> None:
        """Called once per new receipt after it is durable. Must be idempotent by
        ``entry.receipt_id`` (see the module docstring)."""


def _entry(countersigned: CountersignedReceipt) -> LedgerEntry:
    receipt = countersigned.receipt
    return LedgerEntry(
        receipt.receipt_id,
        receipt.lease_id,
        receipt.host,
        receipt.share_seconds,
        receipt.bytes_moved,
        receipt.interval_start,
        receipt.interval_end,
        countersigned,
        receipt.peer_bytes,
    )


class Ledger:
    """Append-only, deduplicated store of countersigned receipts.

    Open it with ``Ledger.open(data_dir)`` (or as a context manager).

    Args:
        data_dir: The directory holding ``ledger.jsonl``; created if missing.
        rail: Notified of each new receipt; optional.

    Raises:
        LedgerCorruptError: The file is damaged other than by a torn last line.
    """

    def __init__(self, data_dir: Path, *, rail: PaymentRail | None = None) -> None:
        data_dir = Path(data_dir)
        data_dir.mkdir(parents=True, exist_ok=True)
        self.path = data_dir / LEDGER_FILE_NAME
        self.disputes_path = data_dir / DISPUTES_FILE_NAME
        self._rail = rail
        self._entries: dict[str, LedgerEntry] = {}
        self._disputes: dict[str, Dispute] = {}
        for entry in _load(self.path, self._parse):
            self._entries.setdefault(entry.receipt_id, entry)
        for dispute in _load(self.disputes_path, _parse_dispute):
            self._disputes.setdefault(dispute.receipt_id, dispute)
        self._file = open(self.path, "ab")
        self._disputes_file = open(self.disputes_path, "ab")
        _fsync_dir(data_dir)

    @classmethod
    def open(cls, data_dir: Path, *, rail: PaymentRail | None = None) -> Ledger:
        """Open (recovering if needed) the ledger in ``data_dir``."""
        return cls(data_dir, rail=rail)

    @staticmethod
    def _parse(line: bytes) -> LedgerEntry:
        record = json.loads(line)
        raw = base64.b64decode(record["receipt"], validate=True)
        entry = _entry(CountersignedReceipt.from_bytes(raw))
        if entry.receipt_id != record["id"]:
            raise ValueError("the id does not match the receipt")
        return entry

    def append(self, countersigned: CountersignedReceipt) -> bool:
        """Record a receipt durably, unless its id is already recorded.

        Returns:
            ``True`` if it was new (and is now on disk), ``False`` for a duplicate.

        Raises:
            MalformedMessageError: The envelope does not hold a receipt.
            OSError: The write or fsync failed; the receipt is not acknowledged.
        """
        entry = _entry(countersigned)
        if entry.receipt_id in self._entries:
            return False
        record = {
            "id": entry.receipt_id,
            "receipt": base64.b64encode(countersigned.to_bytes()).decode("ascii"),
        }
        _write_line(self._file, record)
        self._entries[entry.receipt_id] = entry
        if self._rail is not None:
            self._rail.on_receipt(entry)
        return True

    def record_dispute(self, dispute: Dispute) -> bool:
        """Record a refused receipt durably, unless it is already recorded.

        Returns:
            ``True`` if it was new (and is now on disk).

        Raises:
            OSError: The write or fsync failed.
        """
        if dispute.receipt_id in self._disputes:
            return False
        _write_line(
            self._disputes_file,
            {
                "id": dispute.receipt_id,
                "reason": dispute.reason,
                "at": dispute.at,
                "receipt": base64.b64encode(dispute.receipt.to_bytes()).decode("ascii"),
            },
        )
        self._disputes[dispute.receipt_id] = dispute
        return True

    def disputes(self) -> Iterator[Dispute]:
        """Recorded disputes in the order they were first recorded."""
        return iter(list(self._disputes.values()))

    def get(self, receipt_id: str) -> LedgerEntry | None:
        """The receipt recorded under ``receipt_id``, if any."""
        return self._entries.get(receipt_id)

    def __contains__(self, receipt_id: object) -> bool:
        return receipt_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> Iterator[LedgerEntry]:
        """Recorded receipts in the order they were first appended."""
        return iter(list(self._entries.values()))

    def totals(self, lease_id: str | None = None) -> LedgerTotals:
        """Usage summed over all receipts, or those of one lease."""
        picked = [e for e in self._entries.values() if lease_id in (None, e.lease_id)]
        return LedgerTotals(
            len(picked), sum(e.share_seconds for e in picked), sum(e.bytes_moved for e in picked)
        )

    def replay_to(self, rail: PaymentRail) -> None:
        """Feed every recorded receipt to ``rail`` (for a rail that must catch up)."""
        for entry in self.entries():
            rail.on_receipt(entry)

    def close(self) -> None:
        """Close the files. Everything appended is already durable."""
        self._file.close()
        self._disputes_file.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _load(path: Path, parse) -> Iterator:
    """Parse each complete line of ``path``; cut off a torn last line (never
    acknowledged); raise on damage anywhere else."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return
    lines = data.split(b"\n")
    complete, tail = lines[:-1], lines[-1]
    for number, line in enumerate(complete, start=1):
        try:
            yield parse(line)
        except (
            ValueError,
            KeyError,
            TypeError,
            MalformedMessageError,
            EnvelopeRejectedError,
        ) as exc:
            raise LedgerCorruptError(
                f"{path} line {number} is damaged ({exc}); nothing was changed"
            ) from exc
    if tail:
        with open(path, "r+b") as f:
            f.truncate(len(data) - len(tail))
            f.flush()
            os.fsync(f.fileno())


def _parse_dispute(line: bytes) -> Dispute:
    record = json.loads(line)
    raw = base64.b64decode(record["receipt"], validate=True)
    dispute = Dispute.of(Envelope.from_bytes(raw), record["reason"], at=float(record["at"]))
    if dispute.receipt_id != record["id"]:
        raise ValueError("the id does not match the receipt")
    return dispute


def _write_line(file, record: dict) -> None:
    file.write(json.dumps(record, separators=(",", ":")).encode() + b"\n")
    file.flush()
    os.fsync(file.fileno())


def _fsync_dir(path: Path) -> None:
    # A newly created file is durable only once its directory entry is.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
