"""Receipts over a direct libp2p stream: the host asks, the consumer countersigns.

One request, one response per stream (``rpc``). The request is the
host's signed receipt envelope. The response is msgpack ``[True, countersigned_bytes]``
or ``[False, reason]``. The consumer's ``ReceiptDesk`` decides (sans-IO); the host's
``call_countersign`` checks the countersignature before it trusts the answer.

Both sides then append the countersigned receipt to their ledgers, so the two ledgers
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
from .ledger import Ledger
from .messages import CountersignedReceipt, LeaseProposal, Receipt
from .metering import check_receipt
from .rpc import call_rpc, serve_rpc

__all__ = [
    "CLOSE_PROTOCOL",
    "NOTICE_LEAVING",
    "NOTICE_PROTOCOL",
    "RECEIPT_PROTOCOL",
    "ReceiptDesk",
    "call_close_lease",
    "call_countersign",
    "call_lease_notice",
    "serve_lease_close",
    "serve_lease_notices",
    "serve_receipts",
]

RECEIPT_PROTOCOL = TProtocol("/cumulus/receipt/1.0.0")
CLOSE_PROTOCOL = TProtocol("/cumulus/lease-close/1.0.0")
NOTICE_PROTOCOL = TProtocol("/cumulus/lease-notice/1.0.0")
#: The host is shutting down: the lease ends now, settled, through no fault of either.
NOTICE_LEAVING = "leaving"
_NOTICE_KINDS = frozenset({NOTICE_LEAVING})
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


@dataclass
class ReceiptDesk:
    """The consumer's side: check each receipt against its lease, countersign, record.

    Args:
        identity: The consumer; it countersigns.
        ledger: Where countersigned receipts go (durable before the host hears back).
    """

    identity: NodeIdentity
    ledger: Ledger
    _accounts: dict[str, _Account] = field(default_factory=dict)
    _validator: EnvelopeValidator = field(default_factory=lambda: EnvelopeValidator([Receipt.KIND]))

    def open_account(self, lease: LeaseProposal) -> None:
        """Accept receipts for ``lease`` from now on."""
        self._accounts.setdefault(lease.lease_id, _Account(lease))

    def countersign(self, raw: bytes, *, sender: str, now: float) -> CountersignedReceipt:
        """Check, countersign and record one receipt.

        Raises:
            ReceiptRejectedError: Unknown lease, a sender other than the lease's host, or a
                receipt that does not fit the lease (see ``check_receipt``).
            EnvelopeRejectedError, MalformedMessageError: a bad envelope.
        """
        envelope = Envelope.from_bytes(raw)
        account = self._account_for(envelope, sender)
        checked, receipt = check_receipt(
            raw, account.lease, now=now, previous=account.previous, validator=self._validator
        )
        countersigned = CountersignedReceipt.countersign(self.identity, checked)
        self.ledger.append(countersigned)
        account.previous = receipt
        return countersigned

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


def serve_receipts(
    host: IHost, desk: ReceiptDesk, *, clock: Callable[[], float], timeout: float = 10.0
) -> None:
    """Answer receipt requests on ``host`` from ``desk``."""

    async def answer(request: bytes, sender: str) -> bytes:
        return _answer(desk, request, sender, clock())

    serve_rpc(host, RECEIPT_PROTOCOL, answer, timeout=timeout)


def _answer(desk: ReceiptDesk, request: bytes, sender: str, now: float) -> bytes:
    try:
        countersigned = desk.countersign(request, sender=sender, now=now)
    except CumulusError as exc:
        return msgpack.packb([False, f"{type(exc).__name__}: {exc}"[:500]])
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
    try:
        decoded = msgpack.unpackb(response, raw=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise MalformedMessageError(f"close answer is not msgpack: {exc}") from exc
    if not (type(decoded) is list and len(decoded) == 2 and type(decoded[0]) is bool):
        raise MalformedMessageError("close answer must be [ok, reason]")
    if not decoded[0]:
        raise ReceiptRejectedError(f"the host did not settle lease {lease_id}: {decoded[1]}")


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
    try:
        decoded = msgpack.unpackb(response, raw=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise MalformedMessageError(f"notice answer is not msgpack: {exc}") from exc
    if not (type(decoded) is list and len(decoded) == 2 and type(decoded[0]) is bool):
        raise MalformedMessageError("notice answer must be [ok, reason]")
    if not decoded[0]:
        raise ReceiptRejectedError(f"the consumer did not take the notice: {decoded[1]}")
