"""Usage metering: the host issues signed receipts, the consumer checks and countersigns.

Sans-IO. The host keeps a ``Meter`` per lease, reports bytes as they move, and asks
``issue(now, nonce=...)`` whenever ``due(now)``: the receipt covers the time since the
previous one (clipped to the lease), charged as ``units * seconds``: share-seconds for
a compute lease, GiB-seconds for a standby lease (``LeaseProposal.units``; the
receipt's ``share_seconds`` field carries either, and ``LeaseProposal.owed`` prices
it). The consumer runs ``check_receipt`` (right host, right lease, inside the lease,
never more unit-seconds than leased, following the previous receipt without gap or
overlap) and countersigns with ``CountersignedReceipt.countersign``. Both sides then
append the countersigned receipt to their ``Ledger``.

Nothing runs unpaid: ``payment_standing`` tells the host what a lease's oldest
unsettled receipt means now. Within one grace period it is merely late; past it the
session is paused (parked, as at the end of a term); past a second one the lease ends
and the consumer is reported for not paying.
"""

from __future__ import annotations

import enum
import math

from .._errors import EnvelopeRejectedError, MalformedMessageError, ReceiptRejectedError
from ..envelope import Envelope, EnvelopeValidator, Rejected
from ..identity import NodeIdentity
from .messages import LeaseKind, LeaseProposal, Receipt, open_message, seal_message

__all__ = ["Meter", "Standing", "check_receipt", "payment_standing"]


class Standing(enum.Enum):
    """Where a lease stands with its payments."""

    CURRENT = "current"
    PAUSED = "paused"
    DEFAULTED = "defaulted"


def payment_standing(oldest_unsettled_at: float | None, *, now: float, grace: float) -> Standing:
    """A lease's standing, from when its oldest unsettled receipt was issued.

    Args:
        oldest_unsettled_at: When the oldest receipt still unsettled was issued; ``None``
            when every receipt is settled.
        now: The current time, on the same clock.
        grace: How long a receipt may stay unsettled before the session pauses; the
            lease ends after twice that.
    """
    if oldest_unsettled_at is None or now - oldest_unsettled_at <= grace:
        return Standing.CURRENT
    if now - oldest_unsettled_at <= 2 * grace:
        return Standing.PAUSED
    return Standing.DEFAULTED


class Meter:
    """Meters one lease on the host and issues its receipts.

    Args:
        host: The host's identity; it signs the receipts.
        lease: The granted lease's proposal.
        interval: Seconds between receipts.
        receipt_ttl: How long the consumer has to countersign a receipt.
    """

    def __init__(
        self,
        host: NodeIdentity,
        lease: LeaseProposal,
        *,
        interval: float = 60.0,
        receipt_ttl: float = 600.0,
    ) -> None:
        if lease.host != host.peer_id.to_base58():
            raise ValueError("the lease is not for this host")
        self._host = host
        self._lease = lease
        self._interval = interval
        self._ttl = receipt_ttl
        self._seq = 0
        self._metered_until = lease.start_at
        self._bytes = 0
        self._peer_bytes = 0

    @property
    def finished(self) -> bool:
        """Whether the whole lease has been receipted."""
        return self._metered_until >= self._lease.end_at

    def record_bytes(self, n: int) -> None:
        """Count ``n`` bytes moved for the lease since the last receipt."""
        if n < 0:
            raise ValueError("bytes moved cannot be negative")
        self._bytes += n

    def record_peer_bytes(self, n: int) -> None:
        """Count ``n`` bytes the lease's collectives carried between the job's hosts
        since the last receipt."""
        if n < 0:
            raise ValueError("bytes carried cannot be negative")
        self._peer_bytes += n

    def due(self, now: float) -> bool:
        """Whether a receipt should be issued now (an interval passed, or the lease ended)."""
        if self.finished:
            return False
        return now >= min(self._metered_until + self._interval, self._lease.end_at)

    def issue(self, now: float, *, nonce: int) -> Envelope:
        """Sign a receipt for usage from the last receipt up to ``now`` (within the lease).

        Args:
            now: The current Unix time.
            nonce: The host's next envelope nonce.

        Returns:
            The signed receipt envelope, to send to the consumer.
        """
        end = min(now, self._lease.end_at)
        start = min(self._metered_until, end)
        receipt = Receipt(
            self._lease.lease_id,
            self._lease.host,
            self._seq,
            start,
            end,
            math.floor((end - start) * self._lease.units),
            self._bytes,
            now + self._ttl,
            nonce,
            peer_bytes=self._peer_bytes,
        )
        envelope = seal_message(self._host, receipt, now=now)
        self._seq += 1
        self._metered_until = end
        self._bytes = self._peer_bytes = 0
        return envelope


def check_receipt(
    raw: bytes,
    lease: LeaseProposal,
    *,
    now: float,
    previous: Receipt | None = None,
    validator: EnvelopeValidator | None = None,
) -> tuple[Envelope, Receipt]:
    """The consumer's check of a host's receipt before countersigning it.

    Args:
        raw: The receipt envelope's bytes.
        lease: The lease it claims to meter.
        now: The current Unix time.
        previous: The last receipt accepted for this lease, or ``None`` for the first.
            Receipts must follow each other without gap or overlap, so no second of
            the lease is charged twice.
        validator: Replay memory shared across receipts; a fresh one if omitted.

    Returns:
        The envelope (to countersign) and the decoded receipt.

    Raises:
        EnvelopeRejectedError: Bad signature, expired, replayed, malformed envelope.
        MalformedMessageError: The body is not a valid receipt from its signer.
        ReceiptRejectedError: The receipt does not fit the lease.
    """
    validator = validator or EnvelopeValidator([Receipt.KIND])
    checked = validator.validate(raw, now=now)
    if isinstance(checked, Rejected):
        raise EnvelopeRejectedError(checked.reason, checked.detail)
    receipt = open_message(checked)
    if type(receipt) is not Receipt:
        raise MalformedMessageError("not a receipt")
    if receipt.lease_id != lease.lease_id or receipt.host != lease.host:
        raise ReceiptRejectedError("the receipt is for another lease or from another host")
    expected_seq = 0 if previous is None else previous.seq + 1
    expected_start = lease.start_at if previous is None else previous.interval_end
    if receipt.seq != expected_seq or receipt.interval_start != expected_start:
        raise ReceiptRejectedError(
            f"receipt {receipt.seq} from {receipt.interval_start}; expected receipt "
            f"{expected_seq} from {expected_start}"
        )
    if receipt.interval_start < lease.start_at or receipt.interval_end > lease.end_at:
        raise ReceiptRejectedError("the interval lies outside the lease")
    allowed = (receipt.interval_end - receipt.interval_start) * lease.units
    if receipt.share_seconds > math.floor(allowed):
        unit = "GiB-seconds" if lease.kind is LeaseKind.STANDBY else "share-seconds"
        raise ReceiptRejectedError(f"{receipt.share_seconds} {unit}, at most {allowed}")
    return checked, receipt
