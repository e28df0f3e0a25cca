"""Reputation evidence: typed, frozen, self-checking records, and the signed ``Report``.

Sans-IO: no clock, no I/O. Every record validates its shape in ``__init__`` (an
invalid record cannot exist) and checks its signatures in ``check(reporter)``, which
returns a ``Finding``: the plain facts the scorer and the trust graph consume.

Theory of operation
-------------------
A report is worth only what can be checked. So every record that speaks of a lease
carries the lease itself, doubly signed (the consumer's proposal, countersigned by
the host): nobody can invent a lease against a host that never accepted one.

- ``ServiceRecord``: a lease plus receipts the host signed and the consumer
  countersigned: paid, agreed usage. Either party may publish it; the consumer's
  credibility weighs it, because the consumer is the one vouching for the usage.
- ``LeaseFailure``: the consumer's claim that the host vanished or refused service
  after accepting. Only the lease's consumer may make it, and it can only claim the
  part of the lease that receipts do not cover (the scorer clips it).
- ``HeartbeatObservation``: heartbeats a peer expected from a host and saw. It cannot
  be proven, so it carries no volume: only the observer's credibility weighs it.
- ``PerformanceObservation``: the lease, the host-signed offer the lease names (the
  claim) and what the consumer measured. Only the consumer may make it.
- ``BadBlob``: a host's signed statement (``served.py``) that it served another host
  bytes other than the blob asked for. The statement proves it alone; only the host it
  was sent to may report it.
- ``NonPayment``: the host's claim that the lease's consumer never countersigned a
  receipt the host issued. It is about the *consumer*: a ``Finding``'s ``host`` is the
  peer the evidence is about, which here is the consumer, and the lease's host's
  credibility weighs it. Only the lease's host may make it. A service record holding
  that receipt countersigned voids the claim (the scorer checks).

A ``Report`` wraps one record, names the reporter and the host, and travels in an
``Envelope`` of kind ``REPORT_KIND`` signed by the reporter (``seal_report`` /
``open_report``). Encoding is canonical msgpack, decoded once at the edge.
"""

from __future__ import annotations

import enum
import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeAlias

import msgpack

from .._errors import (
    EnvelopeRejectedError,
    InvalidCountersignatureError,
    InvalidEvidenceError,
    InvalidMessageError,
    MalformedMessageError,
)
from ..envelope import Envelope, seal
from ..identity import PUBLIC_KEY_SIZE, NodeIdentity
from ..market.checks import bad, check_float, check_int
from ..market.messages import (
    CountersignedReceipt,
    Lease,
    LeaseProposal,
    Offer,
    PriorityClass,
    Receipt,
    open_message,
    peer_id_of,
)
from .served import open_served

__all__ = [
    "MAX_RECEIPTS",
    "REPORT_KIND",
    "Evidence",
    "BadBlob",
    "EvidenceKind",
    "FailureReason",
    "Finding",
    "HeartbeatObservation",
    "LeaseFailure",
    "NonPayment",
    "PerformanceObservation",
    "Report",
    "ServiceRecord",
    "decode_report",
    "encode_report",
    "open_report",
    "seal_report",
]

REPORT_KIND = "reputation/report"
MAX_RECEIPTS = 128
_MAX_PEER_ID = 128
_MAX_HEARTBEATS = 1_000_000
_MAX_PART = 16 * 1024
_MAX_U32 = 2**32


class EvidenceKind(enum.IntEnum):
    """The wire tag of each evidence record."""

    SERVICE = 1
    FAILURE = 2
    HEARTBEAT = 3
    PERFORMANCE = 4
    NONPAYMENT = 5
    BADBLOB = 6


class FailureReason(enum.IntEnum):
    """How a lease failed after the host accepted it."""

    VANISHED = 0
    REFUSED_SERVICE = 1


@dataclass(frozen=True, slots=True)
class Finding:
    """The checked facts of one evidence record; what scoring and trust consume.

    Attributes:
        evidence_id: Stable id; two reports of the same fact share it (dedupe key).
        kind: Which record it came from.
        host: The peer the evidence is about (base58 peer ID): a host, or for
            ``NONPAYMENT`` the consumer that did not pay.
        credited: The peer whose credibility weighs the evidence (the lease's
            consumer, the heartbeat observer, the host served a bad blob, or for
            ``NONPAYMENT`` the lease's host).
        at: When the evidence happened (Unix seconds); decay counts from here.
        lease_key: Digest of the lease envelope, or ``b""`` for evidence no lease backs
            (heartbeats, bad blobs).
        served: Receipted share-seconds (``SERVICE``).
        served_until: End of the last receipt (``SERVICE``), or of the unpaid one
            (``NONPAYMENT``).
        lease_shares: Shares leased (lease-backed kinds).
        lease_end: When the lease was due to end (lease-backed kinds).
        ratio: Answered/expected heartbeats or measured/claimed performance, in [0, 1].
    """

    evidence_id: bytes
    kind: EvidenceKind
    host: str
    credited: str
    at: float
    lease_key: bytes = b""
    served: int = 0
    served_until: float = 0.0
    lease_shares: int = 0
    lease_end: float = 0.0
    ratio: float = 1.0


def _check_type(msg: object, name: str, expected: type) -> None:
    if type(getattr(msg, name)) is not expected:
        raise bad(type(msg), name, f"must be a {expected.__name__}")


def _check_host_key(msg: Any) -> None:
    key = msg.host_key
    if type(key) is not bytes or len(key) != PUBLIC_KEY_SIZE:
        raise bad(type(msg), "host_key", f"must be {PUBLIC_KEY_SIZE} raw key bytes")


def _evidence_id(kind: EvidenceKind, *parts: bytes) -> bytes:
    return hashlib.sha256(_packb(["cumulus/evidence/v1", int(kind), *parts])).digest()


def _packb(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True, strict_types=True)


def _verified_lease(lease: Lease, host_key: bytes) -> LeaseProposal:
    """Check both lease signatures, and that the host did not lease to itself."""
    try:
        proposal = lease.verify(host_key)
    except (InvalidCountersignatureError, MalformedMessageError) as exc:
        raise InvalidEvidenceError(f"the lease does not check: {exc}") from exc
    if proposal.consumer == proposal.host:
        raise InvalidEvidenceError("a host cannot lease to itself")
    return proposal


def _lease_finding(
    kind: EvidenceKind, lease: Lease, proposal: LeaseProposal, *, at: float, **facts: Any
) -> Finding:
    key = lease.envelope.digest
    return Finding(
        _evidence_id(kind, key),
        kind,
        proposal.host,
        proposal.consumer,
        at,
        lease_key=key,
        lease_shares=proposal.shares,
        lease_end=proposal.end_at,
        **facts,
    )


def _require_consumer(reporter: str, proposal: LeaseProposal) -> None:
    if reporter != proposal.consumer:
        raise InvalidEvidenceError(
            f"reporter {reporter} is not the lease's consumer {proposal.consumer}"
        )


@dataclass(frozen=True, slots=True)
class ServiceRecord:
    """Good service: a doubly signed lease and its countersigned receipts.

    Attributes:
        lease: The lease, countersigned by the host.
        host_key: The host's raw public key (the lease names only its peer ID).
        receipts: Host-signed, consumer-countersigned receipts, in ``seq`` order.
    """

    KIND: ClassVar[EvidenceKind] = EvidenceKind.SERVICE

    lease: Lease
    host_key: bytes
    receipts: tuple[CountersignedReceipt, ...]

    def __post_init__(self) -> None:
        _check_type(self, "lease", Lease)
        _check_host_key(self)
        receipts = self.receipts
        if type(receipts) is list:
            receipts = tuple(receipts)
            object.__setattr__(self, "receipts", receipts)
        if (
            type(receipts) is not tuple
            or not 0 < len(receipts) <= MAX_RECEIPTS
            or any(type(r) is not CountersignedReceipt for r in receipts)
        ):
            raise bad(ServiceRecord, "receipts", f"must be 1..{MAX_RECEIPTS} receipts")

    def check(self, reporter: str) -> Finding:
        """Verify every signature and that the receipts fit the lease.

        Args:
            reporter: The report's author; must be the lease's consumer or host.

        Raises:
            InvalidEvidenceError: A check failed; the message says which.
        """
        proposal = _verified_lease(self.lease, self.host_key)
        if reporter not in (proposal.consumer, proposal.host):
            raise InvalidEvidenceError(f"reporter {reporter} is not a party to the lease")
        served, until = self._served(proposal)
        return _lease_finding(
            self.KIND, self.lease, proposal, at=until, served=served, served_until=until
        )

    def _served(self, proposal: LeaseProposal) -> tuple[int, float]:
        consumer_key = self.lease.envelope.author
        total, until, last_seq = 0, proposal.start_at, -1
        for signed in self.receipts:
            try:
                receipt = signed.verify(consumer_key)
            except (InvalidCountersignatureError, MalformedMessageError) as exc:
                raise InvalidEvidenceError(f"a receipt does not check: {exc}") from exc
            if signed.envelope.author != self.host_key or receipt.lease_id != proposal.lease_id:
                raise InvalidEvidenceError("a receipt is for another lease or host")
            if receipt.seq <= last_seq or receipt.interval_start < until:
                raise InvalidEvidenceError("receipts overlap or are out of order")
            if receipt.interval_end > proposal.end_at:
                raise InvalidEvidenceError("a receipt runs past the end of the lease")
            span = receipt.interval_end - receipt.interval_start
            if receipt.share_seconds > math.floor(span * proposal.units):
                raise InvalidEvidenceError("a receipt charges more unit-seconds than leased")
            total += receipt.share_seconds
            until, last_seq = receipt.interval_end, receipt.seq
        return total, until

    def _to_wire(self) -> list[object]:
        return [self.lease.to_bytes(), self.host_key, [r.to_bytes() for r in self.receipts]]

    @classmethod
    def _from_wire(cls, parts: list[Any]) -> ServiceRecord:
        lease, host_key, receipts = parts
        if type(receipts) is not list or len(receipts) > MAX_RECEIPTS:
            raise MalformedMessageError(f"receipts must be a list of at most {MAX_RECEIPTS}")
        return cls(
            _lease_from(lease),
            host_key,
            tuple(CountersignedReceipt.from_bytes(_as_bytes(r), _MAX_PART) for r in receipts),
        )


@dataclass(frozen=True, slots=True)
class LeaseFailure:
    """The consumer's claim that a leased host vanished or refused service.

    Attributes:
        lease: The lease the host accepted (doubly signed).
        host_key: The host's raw public key.
        reason: ``VANISHED`` or ``REFUSED_SERVICE``.
        ended_at: When service stopped; within the lease.
    """

    KIND: ClassVar[EvidenceKind] = EvidenceKind.FAILURE

    lease: Lease
    host_key: bytes
    reason: FailureReason
    ended_at: float

    def __post_init__(self) -> None:
        _check_type(self, "lease", Lease)
        _check_host_key(self)
        if type(self.reason) is int and self.reason in FailureReason._value2member_map_:
            object.__setattr__(self, "reason", FailureReason(self.reason))
        _check_type(self, "reason", FailureReason)
        check_float(self, "ended_at")

    def check(self, reporter: str) -> Finding:
        """Verify the lease and that the reporter is its consumer.

        Raises:
            InvalidEvidenceError: A check failed; the message says which.
        """
        proposal = _verified_lease(self.lease, self.host_key)
        _require_consumer(reporter, proposal)
        if not proposal.start_at <= self.ended_at <= proposal.end_at:
            raise InvalidEvidenceError("ended_at lies outside the lease")
        return _lease_finding(
            self.KIND, self.lease, proposal, at=self.ended_at, served_until=self.ended_at
        )

    def _to_wire(self) -> list[object]:
        return [self.lease.to_bytes(), self.host_key, int(self.reason), self.ended_at]

    @classmethod
    def _from_wire(cls, parts: list[Any]) -> LeaseFailure:
        lease, host_key, reason, ended_at = parts
        return cls(_lease_from(lease), host_key, reason, ended_at)


@dataclass(frozen=True, slots=True)
class HeartbeatObservation:
    """Heartbeats the reporter expected from ``host`` in a window, and how many came.

    Attributes:
        host: The observed host's peer ID.
        window_start: Start of the observation window.
        window_end: End of the window.
        expected: Heartbeats due in the window; at least 1.
        answered: Heartbeats seen; at most ``expected``.
    """

    KIND: ClassVar[EvidenceKind] = EvidenceKind.HEARTBEAT

    host: str
    window_start: float
    window_end: float
    expected: int
    answered: int

    def __post_init__(self) -> None:
        if type(self.host) is not str or not 0 < len(self.host) <= _MAX_PEER_ID:
            raise bad(HeartbeatObservation, "host", "must be a peer ID")
        check_float(self, "window_start")
        check_float(self, "window_end")
        if self.window_end < self.window_start:
            raise bad(HeartbeatObservation, "window_end", "must not be before window_start")
        check_int(self, "expected", 1, _MAX_HEARTBEATS)
        check_int(self, "answered", 0, self.expected)

    def check(self, reporter: str) -> Finding:
        """Nothing to verify beyond shape: the reporter's credibility is all it has.

        Raises:
            InvalidEvidenceError: The reporter reports on itself.
        """
        if reporter == self.host:
            raise InvalidEvidenceError("a host cannot report its own heartbeats")
        key = _evidence_id(
            self.KIND, reporter.encode(), self.host.encode(), _packb(self.window_start)
        )
        return Finding(
            key,
            self.KIND,
            self.host,
            reporter,
            self.window_end,
            ratio=self.answered / self.expected,
        )

    def _to_wire(self) -> list[object]:
        return [self.host, self.window_start, self.window_end, self.expected, self.answered]

    @classmethod
    def _from_wire(cls, parts: list[Any]) -> HeartbeatObservation:
        return cls(*parts)


@dataclass(frozen=True, slots=True)
class PerformanceObservation:
    """Performance measured under a lease against what the host's offer claimed.

    Attributes:
        lease: The lease (doubly signed).
        host_key: The host's raw public key.
        offer: The host-signed offer envelope the lease names (the claim).
        measured_perf_units: What the consumer measured, in the offer's units.
        measured_at: When; within the lease.
    """

    KIND: ClassVar[EvidenceKind] = EvidenceKind.PERFORMANCE

    lease: Lease
    host_key: bytes
    offer: Envelope
    measured_perf_units: int
    measured_at: float

    def __post_init__(self) -> None:
        _check_type(self, "lease", Lease)
        _check_host_key(self)
        _check_type(self, "offer", Envelope)
        check_int(self, "measured_perf_units", 0, _MAX_U32)
        check_float(self, "measured_at")

    def check(self, reporter: str) -> Finding:
        """Verify the lease, the offer's signature and that the lease names that offer.

        Raises:
            InvalidEvidenceError: A check failed; the message says which.
        """
        proposal = _verified_lease(self.lease, self.host_key)
        _require_consumer(reporter, proposal)
        if proposal.priority is not PriorityClass.ON_DEMAND:
            # Such a tenant yields the device to on-demand ones by design: it measured
            # its share of a contended device, not the device.
            raise InvalidEvidenceError(
                "only an on-demand lease measures the device; this one ranks below others"
            )
        claimed = self._claimed(proposal)
        if not proposal.start_at <= self.measured_at <= proposal.end_at:
            raise InvalidEvidenceError("measured_at lies outside the lease")
        ratio = 1.0 if claimed == 0 else min(1.0, self.measured_perf_units / claimed)
        return _lease_finding(self.KIND, self.lease, proposal, at=self.measured_at, ratio=ratio)

    def _claimed(self, proposal: LeaseProposal) -> int:
        if self.offer.author != self.host_key or not self.offer.has_valid_signature():
            raise InvalidEvidenceError("the offer is not signed by the host")
        try:
            offer = open_message(self.offer)
        except MalformedMessageError as exc:
            raise InvalidEvidenceError(f"the offer does not decode: {exc}") from exc
        if (
            type(offer) is not Offer
            or offer.offer_id != proposal.offer_id
            or offer.nonce != proposal.offer_nonce
        ):
            raise InvalidEvidenceError("the offer is not the one the lease names")
        return offer.perf_units

    def _to_wire(self) -> list[object]:
        return [
            self.lease.to_bytes(),
            self.host_key,
            self.offer.to_bytes(),
            self.measured_perf_units,
            self.measured_at,
        ]

    @classmethod
    def _from_wire(cls, parts: list[Any]) -> PerformanceObservation:
        lease, host_key, offer, measured, at = parts
        try:
            envelope = Envelope.from_bytes(_as_bytes(offer), _MAX_PART)
        except EnvelopeRejectedError as exc:
            raise MalformedMessageError(f"offer envelope: {exc}") from exc
        return cls(_lease_from(lease), host_key, envelope, measured, at)


@dataclass(frozen=True, slots=True)
class NonPayment:
    """The host's claim that the lease's consumer left a receipt uncountersigned.

    Attributes:
        lease: The lease (doubly signed).
        host_key: The host's raw public key; the host is the reporter.
        receipt: The host-signed receipt envelope the consumer never countersigned.
    """

    KIND: ClassVar[EvidenceKind] = EvidenceKind.NONPAYMENT

    lease: Lease
    host_key: bytes
    receipt: Envelope

    def __post_init__(self) -> None:
        _check_type(self, "lease", Lease)
        _check_host_key(self)
        _check_type(self, "receipt", Envelope)

    def check(self, reporter: str) -> Finding:
        """Verify the lease, that the reporter is its host, and that the host signed a
        receipt for this lease.

        Raises:
            InvalidEvidenceError: A check failed; the message says which.
        """
        proposal = _verified_lease(self.lease, self.host_key)
        if reporter != proposal.host:
            raise InvalidEvidenceError(f"reporter {reporter} is not the lease's host")
        receipt = self._receipt(proposal)
        key = self.lease.envelope.digest
        return Finding(
            _evidence_id(self.KIND, key),
            self.KIND,
            proposal.consumer,
            proposal.host,
            receipt.interval_end,
            lease_key=key,
            served_until=receipt.interval_end,
            lease_shares=proposal.shares,
            lease_end=proposal.end_at,
        )

    def _receipt(self, proposal: LeaseProposal) -> Receipt:
        if self.receipt.author != self.host_key or not self.receipt.has_valid_signature():
            raise InvalidEvidenceError("the receipt is not signed by the lease's host")
        try:
            receipt = open_message(self.receipt)
        except MalformedMessageError as exc:
            raise InvalidEvidenceError(f"the receipt does not decode: {exc}") from exc
        if type(receipt) is not Receipt or receipt.lease_id != proposal.lease_id:
            raise InvalidEvidenceError("the receipt is not for this lease")
        if not proposal.start_at <= receipt.interval_end <= proposal.end_at:
            raise InvalidEvidenceError("the receipt lies outside the lease")
        return receipt

    def _to_wire(self) -> list[object]:
        return [self.lease.to_bytes(), self.host_key, self.receipt.to_bytes()]

    @classmethod
    def _from_wire(cls, parts: list[Any]) -> NonPayment:
        lease, host_key, receipt = parts
        try:
            envelope = Envelope.from_bytes(_as_bytes(receipt), _MAX_PART)
        except EnvelopeRejectedError as exc:
            raise MalformedMessageError(f"receipt envelope: {exc}") from exc
        return cls(_lease_from(lease), host_key, envelope)


@dataclass(frozen=True, slots=True)
class BadBlob:
    """A host's own signed statement that it served other bytes than the blob asked for.

    Attributes:
        statement: The ``BlobServed`` envelope the serving host signed.
    """

    KIND: ClassVar[EvidenceKind] = EvidenceKind.BADBLOB

    statement: Envelope

    def __post_init__(self) -> None:
        _check_type(self, "statement", Envelope)

    def check(self, reporter: str) -> Finding:
        """Verify the host's signature, that the reporter is the host it served, and that
        the digest it signed for the bytes sent is not the one asked for.

        Raises:
            InvalidEvidenceError: A check failed; the message says which.
        """
        try:
            served = open_served(self.statement)
        except MalformedMessageError as exc:
            raise InvalidEvidenceError(f"the statement does not check: {exc}") from exc
        if reporter != served.requester:
            raise InvalidEvidenceError(f"reporter {reporter} is not the host that was served")
        if served.sent == served.name:
            raise InvalidEvidenceError("the host signed that it served the blob asked for")
        host = peer_id_of(self.statement.author)
        if host == reporter:
            raise InvalidEvidenceError("a host cannot report itself")
        key = self.statement.digest
        return Finding(_evidence_id(self.KIND, key), self.KIND, host, reporter, served.served_at)

    def _to_wire(self) -> list[object]:
        return [self.statement.to_bytes()]

    @classmethod
    def _from_wire(cls, parts: list[Any]) -> BadBlob:
        try:
            return cls(Envelope.from_bytes(_as_bytes(parts[0]), _MAX_PART))
        except EnvelopeRejectedError as exc:
            raise MalformedMessageError(f"statement envelope: {exc}") from exc


Evidence: TypeAlias = (
    ServiceRecord
    | LeaseFailure
    | HeartbeatObservation
    | PerformanceObservation
    | NonPayment
    | BadBlob
)
_BY_KIND: dict[int, Any] = {
    int(cls.KIND): cls
    for cls in (
        ServiceRecord,
        LeaseFailure,
        HeartbeatObservation,
        PerformanceObservation,
        NonPayment,
        BadBlob,
    )
}
_WIRE_ARITY = {
    EvidenceKind.SERVICE: 3,
    EvidenceKind.FAILURE: 4,
    EvidenceKind.HEARTBEAT: 5,
    EvidenceKind.PERFORMANCE: 5,
    EvidenceKind.NONPAYMENT: 3,
    EvidenceKind.BADBLOB: 1,
}


def _as_bytes(value: object) -> bytes:
    if type(value) is not bytes:
        raise MalformedMessageError("expected bytes")
    return value


def _lease_from(value: object) -> Lease:
    return Lease.from_bytes(_as_bytes(value), _MAX_PART)


@dataclass(frozen=True, slots=True)
class Report:
    """A peer's signed statement of evidence about a host.

    Attributes:
        reporter: The reporter's peer ID; must be the envelope's author.
        host: The host the evidence is about; must match the evidence.
        evidence: One evidence record.
        created_at: When the report was made.
        expires_at: The envelope's expiry (gossip lifetime, not evidence lifetime).
        nonce: The reporter's increasing nonce.
    """

    KIND: ClassVar[str] = REPORT_KIND

    reporter: str
    host: str
    evidence: Evidence
    created_at: float
    expires_at: float
    nonce: int
    _finding: list[Finding] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("reporter", "host"):
            value = getattr(self, name)
            if type(value) is not str or not 0 < len(value) <= _MAX_PEER_ID:
                raise bad(Report, name, "must be a peer ID")
        if type(self.evidence) not in _BY_KIND.values():
            raise bad(Report, "evidence", "must be an evidence record")
        check_float(self, "created_at")
        check_float(self, "expires_at")
        check_int(self, "nonce", 0)

    def check(self) -> Finding:
        """Check the evidence (signatures included) and that it is about ``host``.

        The result is cached: signatures are verified once per report object.

        Raises:
            InvalidEvidenceError: A check failed; the message says which.
        """
        if not self._finding:
            finding = self.evidence.check(self.reporter)
            if finding.host != self.host:
                raise InvalidEvidenceError(f"the evidence is about {finding.host}, not {self.host}")
            self._finding.append(finding)
        return self._finding[0]


def encode_report(report: Report) -> bytes:
    """Return the canonical msgpack body of ``report``."""
    evidence = report.evidence
    return _packb(
        [
            report.reporter,
            report.host,
            int(evidence.KIND),
            evidence._to_wire(),
            report.created_at,
            report.expires_at,
            report.nonce,
        ]
    )


def decode_report(body: bytes) -> Report:
    """Decode a report body from a peer (shape only; call ``Report.check`` next).

    Raises:
        MalformedMessageError: Bad msgpack, wrong shape or types, an unknown evidence
            kind, or a non-canonical encoding.
    """
    try:
        values = msgpack.unpackb(body, raw=False, use_list=True, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise MalformedMessageError(f"report body is not msgpack: {exc}") from exc
    if type(values) is not list or len(values) != 7:
        raise MalformedMessageError("a report must be an array of 7 fields")
    reporter, host, tag, parts, created_at, expires_at, nonce = values
    cls = _BY_KIND.get(tag) if type(tag) is int else None
    if cls is None or type(parts) is not list or len(parts) != _WIRE_ARITY[cls.KIND]:
        raise MalformedMessageError(f"unknown evidence kind or shape: {tag!r}")
    try:
        report = Report(reporter, host, cls._from_wire(parts), created_at, expires_at, nonce)
    except InvalidMessageError as exc:
        raise MalformedMessageError(str(exc)) from exc
    if encode_report(report) != body:
        raise MalformedMessageError("report body is not the canonical encoding")
    return report


def seal_report(identity: NodeIdentity, report: Report, *, now: float) -> Envelope:
    """Sign ``report`` as ``identity`` with the report's own expiry and nonce.

    Raises:
        InvalidMessageError: ``identity`` is not the report's reporter, or the report
            has expired at ``now``.
    """
    if report.reporter != identity.peer_id.to_base58():
        raise InvalidMessageError("a report must be signed by its reporter")
    return seal(
        identity,
        REPORT_KIND,
        encode_report(report),
        now=now,
        ttl=report.expires_at - now,
        nonce=report.nonce,
    )


def open_report(envelope: Envelope) -> tuple[Report, Finding]:
    """Decode and check a validated report envelope.

    Run the envelope through an ``EnvelopeValidator`` first (signature, expiry, replay);
    this checks what only reputation knows.

    Raises:
        MalformedMessageError: Wrong kind, bad body, or a body that disagrees with its
            envelope (author, expiry, nonce).
        InvalidEvidenceError: The evidence does not check.
    """
    if envelope.kind != REPORT_KIND:
        raise MalformedMessageError(f"not a report: {envelope.kind!r}")
    report = decode_report(envelope.body)
    try:
        signer = peer_id_of(envelope.author)
    except ValueError as exc:
        raise MalformedMessageError("envelope author is not a valid public key") from exc
    if report.reporter != signer:
        raise MalformedMessageError(f"report names {report.reporter} but {signer} signed it")
    if report.expires_at != envelope.expires_at or report.nonce != envelope.nonce:
        raise MalformedMessageError("report expiry or nonce differs from its envelope's")
    return report, report.check()
