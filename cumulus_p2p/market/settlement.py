"""Receipts over a direct libp2p stream: the host asks, the consumer countersigns.

One request, one response per stream (``rpc``). The request is the
host's signed receipt envelope. The response is msgpack ``[True, countersigned_bytes]``
or ``[False, reason]``. The consumer's ``ReceiptDesk`` decides (sans-IO); the host's
``call_countersign`` checks the countersignature before it trusts the answer.

The desk countersigns only what it can check: the receipt fits the lease
(``check_receipt``), does not run past the consumer's own clock by more than
``clock_tolerance``, and, for a lease whose traffic the consumer counts, the bytes
receipted so far do not exceed its own count by more than ``bytes_tolerance``. A
genuine receipt that fails is a dispute: the consumer records it in its ledger and
refuses with the reason; the host (``settle_receipt``) records it in its own.

Both sides append each countersigned receipt to their ledgers, so the two ledgers
hold the same receipts.

When the consumer is done it settles the lease (``/cumulus/lease-close/1.0.0``): the
request names the lease; the host answers once the session is over and its final
receipt has been countersigned, so the consumer leaves with complete books. The host
accepts the request only from the lease's consumer.

A host that must end a lease early says so first (``/cumulus/lease-notice/1.0.0``):
the request is ``[lease_id, kind, detail]`` with kind ``"leaving"`` (the host is
shutting down); the answer is ``[ok, reason]``. A consumer told this way moves its
session at once and files no failure report; it accepts the notice only from the
lease's host.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import msgpack
import trio
from libp2p.abc import IHost
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from .._errors import (
    CumulusError,
    MalformedMessageError,
    ReceiptRejectedError,
)
from ..envelope import Envelope, EnvelopeValidator
from ..identity import NodeIdentity
from .ledger import Dispute, Ledger
from .messages import CountersignedReceipt, LeaseProposal, Receipt, open_message
from .metering import check_receipt
from .rpc import call_rpc, serve_rpc

__all__ = [
    "CLOSE_PROTOCOL",
    "NOTICE_LEAVING",
    "NOTICE_PREEMPTED",
    "NOTICE_PROTOCOL",
    "RECEIPT_PROTOCOL",
    "ReceiptDesk",
    "call_close_lease",
    "call_countersign",
    "call_lease_notice",
    "serve_lease_close",
    "serve_lease_notices",
    "serve_receipts",
    "settle_receipt",
]

RECEIPT_PROTOCOL = TProtocol("/cumulus/receipt/1.0.0")
CLOSE_PROTOCOL = TProtocol("/cumulus/lease-close/1.0.0")
NOTICE_PROTOCOL = TProtocol("/cumulus/lease-notice/1.0.0")
#: The host is shutting down: the lease ends now, settled, through no fault of either.
NOTICE_LEAVING = "leaving"
#: An on-demand lease took the shares of this contending or interruptible one.
NOTICE_PREEMPTED = "preempted"
#: How a host's hang-up begins when it pauses a lease for an overdue receipt: the
#: consumer pays and resumes there instead of failing over (``node.payment``).
HANGUP_PAUSED = "unpaid: the lease is paused"
_NOTICE_KINDS = frozenset({NOTICE_LEAVING, NOTICE_PREEMPTED})
_MAX_DETAIL = 500

#: The host's answer to a close request: ``None`` when settled, else why not.
CloseLease = Callable[[str, str], Awaitable[str | None]]
#: The consumer's answer to ``(lease_id, kind, detail, sender)``: ``None`` when taken,
#: else why not.
TakeNotice = Callable[[str, str, str, str], Awaitable[str | None]]


@dataclass
class _Account:
    lease: LeaseProposal
    previous: Receipt | None = None
    counts_bytes: bool = False
    counted_bytes: int = 0
    receipted_bytes: int = 0
    counted_peer_bytes: int = 0
    receipted_peer_bytes: int = 0


@dataclass
class ReceiptDesk:
    """The consumer's side: check each receipt against its lease, countersign, record.

    Args:
        identity: The consumer; it countersigns.
        ledger: Where countersigned receipts and disputes go (durable before the host
            hears back).
        clock_tolerance: Seconds a receipt may run past the consumer's clock.
        bytes_tolerance: ``(slack, fraction)``: receipted bytes may exceed the
            consumer's own count by ``max(slack, fraction * count)``; frames in flight
            when the host issued the receipt are on its count and not yet on ours. The
            same goes for the bytes carried between hosts (``peer_bytes``), which the
            consumer counts from the collectives its script asked for.
    """

    identity: NodeIdentity
    ledger: Ledger
    clock_tolerance: float = 5.0
    bytes_tolerance: tuple[int, float] = (16 * 2**20, 0.02)
    _accounts: dict[str, _Account] = field(default_factory=dict)
    _validator: EnvelopeValidator = field(default_factory=lambda: EnvelopeValidator([Receipt.KIND]))

    def open_account(self, lease: LeaseProposal, *, counts_bytes: bool = False) -> None:
        """Accept receipts for ``lease`` from now on; with ``counts_bytes``, check their
        bytes against what ``count_bytes`` reports."""
        self._accounts.setdefault(lease.lease_id, _Account(lease, counts_bytes=counts_bytes))

    def count_bytes(self, lease_id: str, total: int) -> None:
        """The consumer's own count of the bytes moved under ``lease_id`` so far."""
        account = self._accounts.get(lease_id)
        if account is not None:
            account.counted_bytes = max(account.counted_bytes, total)

    def count_peer_bytes(self, lease_id: str, total: int) -> None:
        """The consumer's own count of the bytes its collectives under ``lease_id`` had
        the hosts carry between themselves so far."""
        account = self._accounts.get(lease_id)
        if account is not None:
            account.counted_peer_bytes = max(account.counted_peer_bytes, total)

    def counted_bytes(self, lease_id: str) -> int:
        """The consumer's own count for ``lease_id`` (0 if unknown)."""
        account = self._accounts.get(lease_id)
        return 0 if account is None else account.counted_bytes

    def countersign(self, raw: bytes, *, sender: str, now: float) -> CountersignedReceipt:
        """Check, countersign and record one receipt.

        Raises:
            ReceiptRejectedError: Unknown lease, a sender other than the lease's host, or a
                receipt that does not fit the lease (see ``check_receipt``), the
                consumer's clock or its byte count; a genuine receipt refused so is
                recorded as a dispute first.
            EnvelopeRejectedError, MalformedMessageError: a bad envelope.
        """
        envelope = Envelope.from_bytes(raw)
        account = self._account_for(envelope, sender)
        again = self._countersigned_before(envelope)
        if again is not None:  # our answer was lost on the way: the same answer again
            return again
        try:
            checked, receipt = check_receipt(
                raw, account.lease, now=now, previous=account.previous, validator=self._validator
            )
            self._check_usage(account, receipt, now)
        except ReceiptRejectedError as exc:
            self.ledger.record_dispute(Dispute.of(envelope, str(exc), at=now))
            raise
        countersigned = CountersignedReceipt.countersign(self.identity, checked)
        self.ledger.append(countersigned)
        account.previous = receipt
        account.receipted_bytes += receipt.bytes_moved
        account.receipted_peer_bytes += receipt.peer_bytes
        return countersigned

    def _check_usage(self, account: _Account, receipt: Receipt, now: float) -> None:
        ahead = receipt.interval_end - now
        if ahead > self.clock_tolerance:
            raise ReceiptRejectedError(
                f"the receipt charges up to {ahead:.1f} s past this consumer's clock "
                f"(tolerance {self.clock_tolerance:g} s)"
            )
        if not account.counts_bytes:
            return
        self._check_count(
            "bytes", account.receipted_bytes + receipt.bytes_moved, account.counted_bytes
        )
        claimed = account.receipted_peer_bytes + receipt.peer_bytes
        self._check_count("bytes between hosts", claimed, account.counted_peer_bytes)

    def _check_count(self, what: str, claimed: int, counted: int) -> None:
        slack, fraction = self.bytes_tolerance
        if claimed > counted + max(slack, int(fraction * counted)):
            raise ReceiptRejectedError(
                f"{claimed} {what} receipted under this lease, but this consumer counted "
                f"{counted} (tolerance {slack} bytes or {fraction:.0%})"
            )

    def _countersigned_before(self, envelope: Envelope) -> CountersignedReceipt | None:
        try:
            receipt = open_message(envelope)
        except MalformedMessageError:
            return None
        entry = self.ledger.get(receipt.receipt_id) if type(receipt) is Receipt else None
        if entry is None or entry.countersigned.envelope != envelope:
            return None
        return entry.countersigned

    def _account_for(self, envelope: Envelope, sender: str) -> _Account:
        try:
            lease_id = msgpack.unpackb(envelope.body, raw=False)[0]
        except (ValueError, TypeError, IndexError, msgpack.UnpackException) as exc:
            raise MalformedMessageError(f"receipt body is malformed: {exc}") from exc
        account = self._accounts.get(lease_id) if type(lease_id) is str else None
        if account is None:
            raise ReceiptRejectedError(f"no lease {lease_id!r} is open with this consumer")
        if account.lease.host != sender:
            raise ReceiptRejectedError("receipts for this lease come only from its host")
        return account


async def _nothing_to_wait_for() -> None:
    return None


def serve_receipts(
    host: IHost,
    desk: ReceiptDesk,
    *,
    clock: Callable[[], float],
    timeout: float = 10.0,
    fresh_counts: Callable[[], Awaitable[None]] = _nothing_to_wait_for,
    on_receipt: Callable[[CountersignedReceipt], None] = lambda receipt: None,
    on_refused: Callable[[str, str], None] = lambda host, why: None,
) -> None:
    """Answer receipt requests on ``host`` from ``desk``; before each, await
    ``fresh_counts()`` (the consumer's byte counts, newer than the request); after each
    one countersigned, call ``on_receipt`` with it; after each one refused
    (``ReceiptRejectedError``: an overcharge, or a receipt not the sender's to send), call
    ``on_refused`` with the sender and why."""

    async def answer(request: bytes, sender: str) -> bytes:
        await fresh_counts()
        return _answer(desk, request, sender, clock(), on_receipt, on_refused)

    serve_rpc(host, RECEIPT_PROTOCOL, answer, timeout=timeout)


def _answer(
    desk: ReceiptDesk,
    request: bytes,
    sender: str,
    now: float,
    on_receipt: Callable[[CountersignedReceipt], None],
    on_refused: Callable[[str, str], None],
) -> bytes:
    try:
        countersigned = desk.countersign(request, sender=sender, now=now)
    except ReceiptRejectedError as exc:
        on_refused(sender, str(exc))
        return msgpack.packb([False, f"{type(exc).__name__}: {exc}"[:500]])
    except CumulusError as exc:
        return msgpack.packb([False, f"{type(exc).__name__}: {exc}"[:500]])
    on_receipt(countersigned)
    return msgpack.packb([True, countersigned.to_bytes()])


async def call_countersign(
    host: IHost, peer: ID, receipt: Envelope, *, timeout: float = 10.0
) -> CountersignedReceipt:
    """Ask the consumer ``peer`` to countersign ``receipt``; return the verified result.

    Raises:
        ReceiptRejectedError: The consumer refused; the message says why.
        MalformedMessageError: The answer is not a valid countersignature of ``receipt``.
        trio.TooSlowError, libp2p.exceptions.BaseLibp2pError: no answer.
    """
    key = peer.extract_public_key()
    if key is None:
        raise ValueError(f"peer ID {peer} does not embed its public key")
    response = await call_rpc(host, peer, RECEIPT_PROTOCOL, receipt.to_bytes(), timeout=timeout)
    countersigned = _decode(response)
    if countersigned.envelope != receipt:
        raise MalformedMessageError("the consumer countersigned a different receipt")
    countersigned.verify(key.to_bytes())
    return countersigned


async def settle_receipt(
    host: IHost, peer: ID, receipt: Envelope, ledger: Ledger, *, now: float, timeout: float = 10.0
) -> CountersignedReceipt:
    """The host's side: have ``peer`` countersign ``receipt``, then record the result in
    ``ledger``: the countersigned receipt, or the consumer's refusal as a dispute.

    Raises:
        What ``call_countersign`` raises; the receipt stays unsettled.
    """
    try:
        countersigned = await call_countersign(host, peer, receipt, timeout=timeout)
    except ReceiptRejectedError as exc:
        await trio.to_thread.run_sync(ledger.record_dispute, Dispute.of(receipt, str(exc), at=now))
        raise
    await trio.to_thread.run_sync(ledger.append, countersigned)
    return countersigned


def _decode(response: bytes) -> CountersignedReceipt:
    try:
        decoded = msgpack.unpackb(response, raw=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise MalformedMessageError(f"receipt answer is not msgpack: {exc}") from exc
    if type(decoded) is list and len(decoded) == 2 and decoded[0] is True:
        if type(decoded[1]) is bytes:
            return CountersignedReceipt.from_bytes(decoded[1])
    if type(decoded) is list and len(decoded) == 2 and decoded[0] is False:
        raise ReceiptRejectedError(f"the consumer refused the receipt: {decoded[1]}")
    raise MalformedMessageError("receipt answer must be [True, bytes] or [False, reason]")


def serve_lease_close(host: IHost, close: CloseLease, *, timeout: float = 30.0) -> None:
    """Answer settle requests with ``await close(lease_id, requester_peer_id)``."""

    async def answer(request: bytes, requester: str) -> bytes:
        lease_id = _lease_id(request)
        refusal = "malformed request" if lease_id is None else await close(lease_id, requester)
        return msgpack.packb([refusal is None, refusal or ""])

    serve_rpc(host, CLOSE_PROTOCOL, answer, timeout=timeout)


def _lease_id(request: bytes) -> str | None:
    try:
        value = msgpack.unpackb(request, raw=False)
    except (ValueError, msgpack.UnpackException):
        return None
    return value if type(value) is str and 0 < len(value) <= 64 else None


async def call_close_lease(host: IHost, peer: ID, lease_id: str, *, timeout: float = 30.0) -> None:
    """Ask host ``peer`` to end ``lease_id`` and settle its last receipt; wait for it.

    Raises:
        ReceiptRejectedError: The host refused (not our lease, unknown lease).
        MalformedMessageError: The answer is malformed.
        trio.TooSlowError, libp2p.exceptions.BaseLibp2pError: no answer.
    """
    response = await call_rpc(host, peer, CLOSE_PROTOCOL, msgpack.packb(lease_id), timeout=timeout)
    refusal = _refusal(response, "close")
    if refusal is not None:
        raise ReceiptRejectedError(f"the host did not settle lease {lease_id}: {refusal}")


def _refusal(response: bytes, what: str) -> object | None:
    """The reason in an ``[ok, reason]`` answer when not ok, else ``None``.

    Raises:
        MalformedMessageError: the answer is not ``[ok, reason]``.
    """
    try:
        decoded = msgpack.unpackb(response, raw=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise MalformedMessageError(f"{what} answer is not msgpack: {exc}") from exc
    if not (type(decoded) is list and len(decoded) == 2 and type(decoded[0]) is bool):
        raise MalformedMessageError(f"{what} answer must be [ok, reason]")
    return None if decoded[0] else decoded[1]


def serve_lease_notices(host: IHost, take: TakeNotice, *, timeout: float = 10.0) -> None:
    """Answer a host's lease notices with ``await take(lease_id, kind, detail, sender)``."""

    async def answer(request: bytes, sender: str) -> bytes:
        notice = _notice(request)
        refusal = "malformed notice" if notice is None else await take(*notice, sender)
        return msgpack.packb([refusal is None, refusal or ""])

    serve_rpc(host, NOTICE_PROTOCOL, answer, timeout=timeout)


def _notice(request: bytes) -> tuple[str, str, str] | None:
    try:
        value = msgpack.unpackb(request, raw=False)
    except (ValueError, msgpack.UnpackException):
        return None
    if not (type(value) is list and len(value) == 3 and all(type(v) is str for v in value)):
        return None
    lease_id, kind, detail = value
    if not 0 < len(lease_id) <= 64 or kind not in _NOTICE_KINDS or len(detail) > _MAX_DETAIL:
        return None
    return lease_id, kind, detail


async def call_lease_notice(
    host: IHost, peer: ID, lease_id: str, kind: str, detail: str, *, timeout: float = 5.0
) -> None:
    """Tell the consumer ``peer`` that ``lease_id`` ends early, and why.

    Raises:
        ReceiptRejectedError: The consumer refused the notice (not its lease).
        MalformedMessageError: The answer is malformed.
        trio.TooSlowError, libp2p.exceptions.BaseLibp2pError: no answer.
    """
    request = msgpack.packb([lease_id, kind, detail[:_MAX_DETAIL]])
    response = await call_rpc(host, peer, NOTICE_PROTOCOL, request, timeout=timeout)
    refusal = _refusal(response, "notice")
    if refusal is not None:
        raise ReceiptRejectedError(f"the consumer did not take the notice: {refusal}")
