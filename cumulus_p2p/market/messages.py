"""The market's wire messages: typed, frozen, validated on construction.

Each message is a frozen dataclass whose ``__post_init__`` checks every field, so an
invalid message cannot exist: building one locally with a bad value raises
``InvalidMessageError`` (our bug); decoding one from a peer raises
``MalformedMessageError`` (their fault).

Encoding: a message's body is the canonical msgpack array of its fields in declaration
order (enums as their values, tuples as arrays). Decoding re-encodes and compares, so
each message has exactly one encoding. Messages travel signed inside an ``Envelope``
whose kind is the class's ``KIND``; the envelope's ``expires_at`` and ``nonce`` must
equal the message's, and its author must be the peer the message names (``host``,
``consumer`` or ``author``). ``seal_message`` and ``open_message`` enforce that pairing.

Money is an integer number of micro-credits, so prices compare exactly and every node
computes the same book. Times are Unix seconds (floats); durations whole seconds.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields
from functools import lru_cache
from typing import Any, ClassVar, Self, TypeAlias, TypeVar

import msgpack

from .._errors import (
    EnvelopeRejectedError,
    InvalidCountersignatureError,
    InvalidMessageError,
    MalformedMessageError,
)
from ..envelope import Envelope, seal
from ..identity import NodeIdentity, peer_id_from_public_key, verify
from .checks import bad, check_float, check_int

__all__ = [
    "KINDS",
    "Bid",
    "Cancel",
    "CountersignedReceipt",
    "Lease",
    "LeaseKind",
    "LeaseProposal",
    "MAX_GPUS",
    "MAX_OVERCOMMIT_PCT",
    "MarketMessage",
    "Offer",
    "PriorityClass",
    "Receipt",
    "Side",
    "decode_message",
    "encode_message",
    "open_message",
    "peer_id_of",
    "seal_message",
]

_MAX_ID = 64
_MAX_PEER_ID = 128
_MAX_TEXT = 64
_MAX_MODELS = 16
#: Most GiB an offer lends or a standby lease holds: 1 PiB.
_MAX_GIB = 2**20
#: The most micro-credits per share-hour a bid may offer.
MAX_PRICE = 2**48
#: The most an offer may overcommit its VRAM, in percent: its shares' memory may add up
#: to twice the device's.
MAX_OVERCOMMIT_PCT = 200
#: The most devices one bid may ask for (a job of that many GPUs, ``market.gang``).
MAX_GPUS = 64
_COUNTERSIGN_DOMAIN = "cumulus/countersign/v1"


class PriorityClass(enum.IntEnum):
    """How a consumer wants its lease treated.

    ``ON_DEMAND`` leases run to their end and pay at least the offer's ask;
    ``INTERRUPTIBLE`` leases may be preempted by the host. A ``CONTEND`` lease shares the
    device at a lower rank than on-demand ones (it runs in their idle gaps and yields
    turns to them) and pays the offer's ``contend_price``, below the ask, whatever its
    bid above that (``pricing.py``).
    """

    ON_DEMAND = 0
    INTERRUPTIBLE = 1
    CONTEND = 2


class LeaseKind(enum.IntEnum):
    """What a lease buys.

    ``COMPUTE`` leases GPU shares, charged per share-hour at the offer's ``price``.
    ``STANDBY`` leases disk on the host for another session's checkpoints (the host
    keeps blobs, runs nothing), charged per GiB-hour at the offer's ``storage_price``;
    it takes no shares.
    """

    COMPUTE = 0
    STANDBY = 1


class Side(enum.IntEnum):
    """Which side of the book an order (or its cancellation) is on."""

    OFFER = 0
    BID = 1


def _check_text(msg: object, name: str, max_len: int, *, allow_empty: bool = False) -> None:
    value = getattr(msg, name)
    if type(value) is not str or len(value) > max_len or (not value and not allow_empty):
        raise bad(
            type(msg),
            name,
            f"must be a {'' if allow_empty else 'non-empty '}string "
            f"of at most {max_len} characters, got {value!r}",
        )


def _check_bytes(msg: object, name: str, size: int | None = None) -> None:
    value = getattr(msg, name)
    if type(value) is not bytes or (size is not None and len(value) != size):
        raise bad(type(msg), name, f"must be {size or 'some'} bytes")


def _check_enum(msg: object, name: str, enum_type: type[enum.IntEnum]) -> None:
    value = getattr(msg, name)
    if type(value) is enum_type:
        return
    if type(value) is int and value in enum_type._value2member_map_:
        object.__setattr__(msg, name, enum_type(value))
        return
    raise bad(type(msg), name, f"must be a {enum_type.__name__}, got {value!r}")


def _check_window(msg: Any) -> None:
    if msg.created_at > msg.expires_at:
        raise bad(type(msg), "expires_at", "must not be before created_at")


@dataclass(frozen=True, slots=True)
class Offer:
    """A host's signed advertisement of GPU capacity, and of disk for standbys.

    A standby is a host a consumer leases for storage only: it keeps the checkpoints of
    a session running on another host. ``storage_price`` and ``storage_gib`` are its
    terms; they come last, with defaults, so an offer of GPU capacity alone is built
    as before.

    Attributes:
        host: The host's peer ID (base58); must be the envelope's author.
        offer_id: The host's name for this offer; a newer nonce with the same id
            replaces it.
        gpu_model: The GPU model, e.g. ``"RTX 4090"``.
        vram_mib: GPU memory, MiB.
        perf_units: Measured performance units (from the host's self benchmark).
        shares_free: Share units offered.
        price: Micro-credits per share-hour.
        min_lease_s: Shortest lease accepted, seconds.
        region: A free-form hint such as ``"eu-west"``; may be empty.
        created_at: When the host made the offer (time priority in the book).
        expires_at: When the offer lapses.
        nonce: The host's increasing nonce.
        storage_price: Micro-credits per GiB-hour of a standby lease.
        storage_gib: GiB of disk free for standbys now (what is left after the host's
            standby leases); 0 means the host keeps no standbys.
        contend_price: What a contending lease (``PriorityClass.CONTEND``) pays per
            share-hour; at most ``price``; 0 means the host sells no contending leases.
        contend_shares: Shares free for contending leases, *beyond* ``shares_free``: a
            contending tenant runs in the device's idle gaps, so a host sells such
            shares on top of its on-demand ones, and an on-demand lease never preempts
            them. Needs a ``contend_price``.
        overcommit_pct: The memory the host's shares grant together, in percent of its
            VRAM (100..``MAX_OVERCOMMIT_PCT``). Above 100 the host pages idle tenants'
            memory to its RAM or disk (``host/eviction.py``), and a tenant whose memory
            was paged out pays the transfer back at its next op.
    """

    KIND: ClassVar[str] = "market/offer"
    AUTHOR_FIELD: ClassVar[str] = "host"

    host: str
    offer_id: str
    gpu_model: str
    vram_mib: int
    perf_units: int
    shares_free: int
    price: int
    min_lease_s: int
    region: str
    created_at: float
    expires_at: float
    nonce: int
    storage_price: int = 0
    storage_gib: int = 0
    contend_price: int = 0
    contend_shares: int = 0
    overcommit_pct: int = 100

    def __post_init__(self) -> None:
        _check_text(self, "host", _MAX_PEER_ID)
        _check_text(self, "offer_id", _MAX_ID)
        _check_text(self, "gpu_model", _MAX_TEXT)
        check_int(self, "vram_mib", 1, 2**32)
        check_int(self, "perf_units", 0, 2**32)
        check_int(self, "contend_shares", 0, 2**16)
        # An offer whose on-demand shares are all leased still sells its contending ones.
        check_int(self, "shares_free", 0 if self.contend_shares else 1, 2**16)
        check_int(self, "price", 0, 2**48)
        check_int(self, "min_lease_s", 0, 2**32)
        _check_text(self, "region", _MAX_TEXT, allow_empty=True)
        check_float(self, "created_at")
        check_float(self, "expires_at")
        check_int(self, "nonce", 0)
        check_int(self, "storage_price", 0, 2**48)
        check_int(self, "storage_gib", 0, _MAX_GIB)
        check_int(self, "contend_price", 0, self.price)
        if self.contend_shares and not self.contend_price:
            raise bad(type(self), "contend_shares", "needs a contend_price")
        check_int(self, "overcommit_pct", 100, MAX_OVERCOMMIT_PCT)
        _check_window(self)

    @property
    def resource_class(self) -> tuple[str, int]:
        """The book this offer rests in: (GPU model, VRAM MiB)."""
        return (self.gpu_model, self.vram_mib)

    @property
    def author(self) -> str:
        """The signing peer."""
        return self.host

    @property
    def order_id(self) -> str:
        """The id under which the author may replace or cancel this order."""
        return self.offer_id


@dataclass(frozen=True, slots=True)
class Bid:
    """A consumer's signed request for GPU capacity.

    Attributes:
        consumer: The consumer's peer ID; must be the envelope's author.
        bid_id: The consumer's name for this bid.
        min_vram_mib: Least GPU memory acceptable, MiB.
        gpu_models: Acceptable GPU models; empty means any model.
        min_perf_units: Least performance acceptable.
        shares: Share units wanted.
        max_price: Most micro-credits per share-hour the consumer pays.
        priority: ``ON_DEMAND``, ``CONTEND`` or ``INTERRUPTIBLE``.
        duration_s: Expected lease length, seconds.
        created_at: When the bid was made (time priority in the book).
        expires_at: When the bid lapses.
        nonce: The consumer's increasing nonce.
        max_overcommit_pct: The most overcommitted offer acceptable (``Offer.
            overcommit_pct``): 100 for a tenant whose memory must stay on the device.
        gpus: Devices the job needs at once, each leased with ``shares`` of its own
            offer (``market.gang`` chooses them); 1 to ``MAX_GPUS``.
    """

    KIND: ClassVar[str] = "market/bid"
    AUTHOR_FIELD: ClassVar[str] = "consumer"
    #: Fields added after nodes were deployed: left off the wire while at their default,
    #: so a bid for one GPU is the bytes it was before (older nodes read it).
    WIRE_TAIL: ClassVar[tuple[str, ...]] = ("gpus",)

    consumer: str
    bid_id: str
    min_vram_mib: int
    gpu_models: tuple[str, ...]
    min_perf_units: int
    shares: int
    max_price: int
    priority: PriorityClass
    duration_s: int
    created_at: float
    expires_at: float
    nonce: int
    max_overcommit_pct: int = MAX_OVERCOMMIT_PCT
    gpus: int = 1

    def __post_init__(self) -> None:
        _check_text(self, "consumer", _MAX_PEER_ID)
        _check_text(self, "bid_id", _MAX_ID)
        check_int(self, "min_vram_mib", 0, 2**32)
        models = self.gpu_models
        if type(models) is list:
            models = tuple(models)
        if (
            type(models) is not tuple
            or len(models) > _MAX_MODELS
            or any(type(m) is not str or not 0 < len(m) <= _MAX_TEXT for m in models)
        ):
            raise bad(Bid, "gpu_models", f"must be up to {_MAX_MODELS} non-empty names")
        # Sorted and unique, so equal requirements have equal encodings.
        object.__setattr__(self, "gpu_models", tuple(sorted(set(models))))
        check_int(self, "min_perf_units", 0, 2**32)
        check_int(self, "shares", 1, 2**16)
        check_int(self, "max_price", 0, MAX_PRICE)
        _check_enum(self, "priority", PriorityClass)
        check_int(self, "duration_s", 1, 2**32)
        check_float(self, "created_at")
        check_float(self, "expires_at")
        check_int(self, "nonce", 0)
        check_int(self, "max_overcommit_pct", 100, MAX_OVERCOMMIT_PCT)
        check_int(self, "gpus", 1, MAX_GPUS)
        _check_window(self)

    @property
    def author(self) -> str:
        """The signing peer."""
        return self.consumer

    @property
    def order_id(self) -> str:
        """The id under which the author may replace or cancel this order."""
        return self.bid_id

    def accepts(self, offer: Offer) -> bool:
        """Whether ``offer`` meets this bid's requirements (price aside)."""
        return (
            offer.vram_mib >= self.min_vram_mib
            and offer.perf_units >= self.min_perf_units
            and offer.min_lease_s <= self.duration_s
            and offer.overcommit_pct <= self.max_overcommit_pct
            and (not self.gpu_models or offer.gpu_model in self.gpu_models)
        )


@dataclass(frozen=True, slots=True)
class Cancel:
    """Withdraws the author's order ``(side, order_id)`` with a nonce below this one."""

    KIND: ClassVar[str] = "market/cancel"
    AUTHOR_FIELD: ClassVar[str] = "author"

    author: str
    side: Side
    order_id: str
    expires_at: float
    nonce: int

    def __post_init__(self) -> None:
        _check_text(self, "author", _MAX_PEER_ID)
        _check_enum(self, "side", Side)
        _check_text(self, "order_id", _MAX_ID)
        check_float(self, "expires_at")
        check_int(self, "nonce", 0)


@dataclass(frozen=True, slots=True)
class LeaseProposal:
    """A consumer's signed proposal to lease shares of one offer, or disk on its host.

    A ``COMPUTE`` lease (the default) takes ``shares`` (at least 1) and no storage. A
    ``STANDBY`` lease takes ``storage_gib`` (at least 1) of the host's disk and no
    shares: ``shares`` must be 0, so nothing that counts GPU shares counts it. Any
    other combination is invalid. What a lease is metered in, ``units``, is its shares
    or its GiB; receipts charge ``units`` times seconds, at ``price`` per hour.

    Attributes:
        lease_id: Chosen by the consumer; unique (e.g. 16 random bytes in hex).
        consumer: The consumer's peer ID; must be the envelope's author.
        host: The host's peer ID.
        offer_id: The offer leased from (for a standby, any live offer of the host's).
        offer_nonce: The version of the offer the consumer saw.
        shares: Share units leased; 0 for a standby lease.
        price: Micro-credits per share-hour: at least the offer's ``price``, or for a
            contending lease its ``contend_price`` (``pricing.least_price``); for a
            standby lease, per GiB-hour, at least the offer's ``storage_price``.
        start_at: Lease start, Unix seconds.
        duration_s: Lease length, seconds.
        priority: ``ON_DEMAND``, ``CONTEND`` or ``INTERRUPTIBLE``.
        expires_at: The proposal lapses if the host has not answered by then.
        nonce: The consumer's increasing nonce.
        kind: ``COMPUTE`` or ``STANDBY``.
        storage_gib: GiB of disk leased; 0 for a compute lease.
    """

    KIND: ClassVar[str] = "market/lease-proposal"
    AUTHOR_FIELD: ClassVar[str] = "consumer"

    lease_id: str
    consumer: str
    host: str
    offer_id: str
    offer_nonce: int
    shares: int
    price: int
    start_at: float
    duration_s: int
    priority: PriorityClass
    expires_at: float
    nonce: int
    kind: LeaseKind = LeaseKind.COMPUTE
    storage_gib: int = 0

    def __post_init__(self) -> None:
        _check_text(self, "lease_id", _MAX_ID)
        _check_text(self, "consumer", _MAX_PEER_ID)
        _check_text(self, "host", _MAX_PEER_ID)
        _check_text(self, "offer_id", _MAX_ID)
        check_int(self, "offer_nonce", 0)
        _check_enum(self, "kind", LeaseKind)
        check_int(self, "shares", 0, 2**16)
        check_int(self, "storage_gib", 0, _MAX_GIB)
        if self.kind is LeaseKind.STANDBY:
            if self.shares != 0:
                raise bad(LeaseProposal, "shares", "must be 0 for a standby lease")
            if self.storage_gib < 1:
                raise bad(LeaseProposal, "storage_gib", "must be at least 1 for a standby lease")
        else:
            if self.shares < 1:
                raise bad(LeaseProposal, "shares", "must be at least 1 for a compute lease")
            if self.storage_gib != 0:
                raise bad(LeaseProposal, "storage_gib", "must be 0 for a compute lease")
        check_int(self, "price", 0, 2**48)
        check_float(self, "start_at")
        check_int(self, "duration_s", 1, 2**32)
        _check_enum(self, "priority", PriorityClass)
        check_float(self, "expires_at")
        check_int(self, "nonce", 0)

    @property
    def end_at(self) -> float:
        """When the lease ends."""
        return self.start_at + self.duration_s

    @property
    def units(self) -> int:
        """What the lease is metered in: its shares, or for a standby its GiB."""
        return self.storage_gib if self.kind is LeaseKind.STANDBY else self.shares

    def owed(self, unit_seconds: int) -> int:
        """Micro-credits owed for ``unit_seconds`` of use (a receipt's ``share_seconds``):
        share-seconds or GiB-seconds, at ``price`` per hour, rounded down."""
        return unit_seconds * self.price // 3600


@dataclass(frozen=True, slots=True)
class Receipt:
    """A host's signed statement of usage under a lease for one interval.

    Attributes:
        lease_id: The lease metered.
        seq: 0, 1, 2, ... per lease; ``(lease_id, seq)`` is the receipt's id.
        interval_start: Start of the metered interval, Unix seconds.
        interval_end: End of the metered interval.
        share_seconds: The lease's units times seconds used in the interval: share
            units for a compute lease, GiB held for a standby lease (GiB-seconds).
        bytes_moved: Bytes carried for the lease in the interval.
        expires_at: The envelope's expiry (a receipt must be countersigned by then).
        nonce: The host's increasing nonce.
        peer_bytes: Bytes the lease's collectives carried between its job's hosts in the
            interval (the tensors the records name; ``host.collectives``).
    """

    KIND: ClassVar[str] = "market/receipt"
    AUTHOR_FIELD: ClassVar[str] = "host"
    #: Fields added after nodes were deployed: left off the wire while at their default,
    #: so a receipt without collectives is the bytes it was before (older nodes read it).
    WIRE_TAIL: ClassVar[tuple[str, ...]] = ("peer_bytes",)

    lease_id: str
    host: str
    seq: int
    interval_start: float
    interval_end: float
    share_seconds: int
    bytes_moved: int
    expires_at: float
    nonce: int
    peer_bytes: int = 0

    def __post_init__(self) -> None:
        _check_text(self, "lease_id", _MAX_ID)
        _check_text(self, "host", _MAX_PEER_ID)
        check_int(self, "seq", 0, 2**32)
        check_float(self, "interval_start")
        check_float(self, "interval_end")
        if self.interval_end < self.interval_start:
            raise bad(Receipt, "interval_end", "must not be before interval_start")
        check_int(self, "share_seconds", 0)
        check_int(self, "bytes_moved", 0)
        check_float(self, "expires_at")
        check_int(self, "nonce", 0)
        check_int(self, "peer_bytes", 0)

    @property
    def receipt_id(self) -> str:
        """``"<lease_id>/<seq>"``: the id ledgers deduplicate on."""
        return f"{self.lease_id}/{self.seq}"


MarketMessage: TypeAlias = Offer | Bid | Cancel | LeaseProposal | Receipt
_M = TypeVar("_M", bound=MarketMessage)
_BY_KIND: dict[str, type[Any]] = {
    cls.KIND: cls for cls in (Offer, Bid, Cancel, LeaseProposal, Receipt)
}
KINDS = frozenset(_BY_KIND)


def _packb(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True, strict_types=True)


def _wire_value(value: object) -> object:
    if isinstance(value, enum.IntEnum):
        return int(value)
    if type(value) is tuple:
        return list(value)
    return value


def encode_message(message: MarketMessage) -> bytes:
    """Return the canonical msgpack body of ``message``: its fields in order, less the
    trailing ones of ``WIRE_TAIL`` still at their defaults."""
    declared = fields(message)
    tail = getattr(message, "WIRE_TAIL", ())
    while declared and declared[-1].name in tail:
        if getattr(message, declared[-1].name) != declared[-1].default:
            break
        declared = declared[:-1]
    return _packb([_wire_value(getattr(message, f.name)) for f in declared])


def decode_message(kind: str, body: bytes) -> MarketMessage:
    """Decode a message body of the given envelope kind.

    Raises:
        MalformedMessageError: Unknown kind, bad msgpack, wrong shape, an invalid field
            value, or a non-canonical encoding.
    """
    cls = _BY_KIND.get(kind)
    if cls is None:
        raise MalformedMessageError(f"unknown market message kind {kind!r}")
    try:
        values = msgpack.unpackb(body, raw=False, use_list=True, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise MalformedMessageError(f"{cls.__name__} body is not msgpack: {exc}") from exc
    most = len(fields(cls))
    least = most - len(getattr(cls, "WIRE_TAIL", ()))
    if type(values) is not list or not least <= len(values) <= most:
        counts = f"{least} to {most}" if least < most else str(most)
        raise MalformedMessageError(f"{cls.__name__} body must be an array of {counts} fields")
    try:
        message = cls(*values)
    except InvalidMessageError as exc:
        raise MalformedMessageError(str(exc)) from exc
    if encode_message(message) != body:
        raise MalformedMessageError(f"{cls.__name__} body is not the canonical encoding")
    return message


@lru_cache(maxsize=65536)
def peer_id_of(public_key: bytes) -> str:
    """The base58 peer ID of a raw public key (cached: base58 is slow in Python).

    Raises:
        ValueError: Not a valid ed25519 public key.
    """
    return peer_id_from_public_key(public_key).to_base58()


def seal_message(identity: NodeIdentity, message: MarketMessage, *, now: float) -> Envelope:
    """Sign ``message`` as ``identity``, with the message's own expiry and nonce.

    Raises:
        InvalidMessageError: ``identity`` is not the peer the message names as author,
            or the message has already expired at ``now``.
    """
    author = getattr(message, type(message).AUTHOR_FIELD)
    if author != identity.peer_id.to_base58():
        raise InvalidMessageError(
            f"{type(message).__name__} names {author} as its author, "
            f"but is being signed by {identity.peer_id.to_base58()}"
        )
    return seal(
        identity,
        message.KIND,
        encode_message(message),
        now=now,
        ttl=message.expires_at - now,
        nonce=message.nonce,
    )


def open_message(envelope: Envelope) -> MarketMessage:
    """Decode a validated envelope's market message and check it matches the envelope.

    Run the envelope through an ``EnvelopeValidator`` first; this checks what only the
    market knows: the body's shape, and that its author, expiry and nonce are the
    envelope's.

    Raises:
        MalformedMessageError: The body is invalid or disagrees with the envelope.
    """
    message = decode_message(envelope.kind, envelope.body)
    try:
        signer = peer_id_of(envelope.author)
    except ValueError as exc:
        raise MalformedMessageError("envelope author is not a valid public key") from exc
    author = getattr(message, type(message).AUTHOR_FIELD)
    if author != signer:
        raise MalformedMessageError(
            f"{type(message).__name__} claims author {author} but was signed by {signer}"
        )
    if message.expires_at != envelope.expires_at or message.nonce != envelope.nonce:
        raise MalformedMessageError("message expiry or nonce differs from its envelope's")
    return message


def _countersign_bytes(envelope: Envelope) -> bytes:
    return _packb([_COUNTERSIGN_DOMAIN, envelope.to_bytes()])


@dataclass(frozen=True, slots=True)
class _Countersigned:
    """A message one party signed (``envelope``), countersigned by the other: a lease
    (the consumer's proposal, the host's countersignature) or a settled receipt (the
    host's receipt, the consumer's countersignature)."""

    envelope: Envelope
    countersignature: bytes

    def __post_init__(self) -> None:
        if type(self.envelope) is not Envelope:
            raise bad(type(self), "envelope", "must be an Envelope")
        _check_bytes(self, "countersignature", 64)

    @classmethod
    def countersign(cls, signer: NodeIdentity, envelope: Envelope) -> Self:
        """Return ``envelope`` countersigned by ``signer`` (the host for a lease, the
        consumer for a receipt)."""
        return cls(envelope, signer.sign(_countersign_bytes(envelope)))

    def to_bytes(self) -> bytes:
        """Canonical wire form: ``[envelope bytes, countersignature]``."""
        return _packb([self.envelope.to_bytes(), self.countersignature])

    def countersignature_valid(self, public_key: bytes) -> bool:
        """Whether ``public_key`` countersigned exactly this envelope."""
        return verify(public_key, _countersign_bytes(self.envelope), self.countersignature)

    def _opened(self, kind: type[_M], wrong_kind: str) -> _M:
        """The envelope's message, which must be a ``kind``.

        Raises:
            MalformedMessageError: It is not (``wrong_kind`` says so).
        """
        message = open_message(self.envelope)
        if type(message) is not kind:
            raise MalformedMessageError(wrong_kind)
        return message

    @classmethod
    def from_bytes(cls, raw: bytes, max_size: int = 16 * 1024) -> Self:
        """Decode from peer bytes (signatures are checked by ``verify``).

        Raises:
            MalformedMessageError: Not a canonical encoding.
        """
        if len(raw) > max_size:
            raise MalformedMessageError(f"{cls.__name__} of {len(raw)} bytes is too large")
        try:
            parts = msgpack.unpackb(raw, raw=False, use_list=True, strict_map_key=True)
        except (ValueError, msgpack.UnpackException) as exc:
            raise MalformedMessageError(f"{cls.__name__} is not msgpack: {exc}") from exc
        if type(parts) is not list or len(parts) != 2 or type(parts[0]) is not bytes:
            raise MalformedMessageError(f"{cls.__name__} must be [envelope, countersignature]")
        try:
            result = cls(Envelope.from_bytes(parts[0], max_size), parts[1])
        except (EnvelopeRejectedError, InvalidMessageError) as exc:
            raise MalformedMessageError(f"{cls.__name__}: {exc}") from exc
        if result.to_bytes() != raw:
            raise MalformedMessageError(f"{cls.__name__} is not the canonical encoding")
        return result


@dataclass(frozen=True, slots=True)
class Lease(_Countersigned):
    """A lease: the consumer's signed proposal, countersigned by the host.

    Build it with ``Lease.countersign(host_identity, proposal_envelope)``.
    """

    @property
    def proposal(self) -> LeaseProposal:
        """The decoded proposal.

        Raises:
            MalformedMessageError: The envelope does not hold a lease proposal.
        """
        return self._opened(LeaseProposal, "a lease must wrap a lease proposal")

    def verify(self, host_public_key: bytes) -> LeaseProposal:
        """Check both signatures and return the proposal.

        Raises:
            InvalidCountersignatureError: A signature does not verify, or the host key
                is not the proposal's host.
            MalformedMessageError: The envelope does not hold a valid proposal.
        """
        proposal = self.proposal
        if not self.envelope.has_valid_signature():
            raise InvalidCountersignatureError("the consumer's signature does not verify")
        if peer_id_of(host_public_key) != proposal.host or not self.countersignature_valid(
            host_public_key
        ):
            raise InvalidCountersignatureError("the host's countersignature does not verify")
        return proposal


@dataclass(frozen=True, slots=True)
class CountersignedReceipt(_Countersigned):
    """A host-signed receipt, countersigned by the consumer: both agree on the usage.

    Build it with ``CountersignedReceipt.countersign(consumer_identity, receipt_envelope)``.
    """

    @property
    def receipt(self) -> Receipt:
        """The decoded receipt.

        Raises:
            MalformedMessageError: The envelope does not hold a receipt.
        """
        return self._opened(Receipt, "a countersigned receipt must wrap a receipt")

    def verify(self, consumer_public_key: bytes) -> Receipt:
        """Check the host's signature and the consumer's countersignature.

        Raises:
            InvalidCountersignatureError: A signature does not verify.
            MalformedMessageError: The envelope does not hold a valid receipt.
        """
        receipt = self.receipt
        if not self.envelope.has_valid_signature():
            raise InvalidCountersignatureError("the host's signature does not verify")
        if not self.countersignature_valid(consumer_public_key):
            raise InvalidCountersignatureError("the consumer's countersignature does not verify")
        return receipt
