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

from .._errors import LedgerCorruptError, MalformedMessageError
from .messages import CountersignedReceipt

__all__ = ["LEDGER_FILE_NAME", "Ledger", "LedgerEntry", "LedgerTotals", "PaymentRail"]

LEDGER_FILE_NAME = "ledger.jsonl"


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    """One recorded receipt."""

    receipt_id: str
    lease_id: str
    host: str
    share_seconds: int
    bytes_moved: int
    interval_start: float
    interval_end: float
    countersigned: CountersignedReceipt


@dataclass(frozen=True, slots=True)
class LedgerTotals:
    """Usage summed over receipts."""

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
        self._rail = rail
        self._entries: dict[str, LedgerEntry] = {}
        self._load()
        self._file = open(self.path, "ab")
        _fsync_dir(data_dir)

    @classmethod
    def open(cls, data_dir: Path, *, rail: PaymentRail | None = None) -> Ledger:
        """Open (recovering if needed) the ledger in ``data_dir``."""
        return cls(data_dir, rail=rail)

    def _load(self) -> None:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return
        lines = data.split(b"\n")
        # Everything after the last newline was never acknowledged: a torn write.
        complete, tail = lines[:-1], lines[-1]
        for number, line in enumerate(complete, start=1):
            try:
                entry = self._parse(line)
            except (ValueError, KeyError, TypeError, MalformedMessageError) as exc:
                raise LedgerCorruptError(
                    f"{self.path} line {number} is damaged ({exc}); nothing was changed"
                ) from exc
            self._entries.setdefault(entry.receipt_id, entry)
        if tail:
            with open(self.path, "r+b") as f:
                f.truncate(len(data) - len(tail))
                f.flush()
                os.fsync(f.fileno())

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
        self._file.write(json.dumps(record, separators=(",", ":")).encode() + b"\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._entries[entry.receipt_id] = entry
        if self._rail is not None:
            self._rail.on_receipt(entry)
        return True

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
        """Close the file. Everything appended is already durable."""
        self._file.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _fsync_dir(path: Path) -> None:
    # A newly created file is durable only once its directory entry is.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
