"""Signed envelopes, and the one validator every receiver runs on them.

Every market message, report and ``/cumulus/`` DHT record travels inside an
``Envelope``: a kind, the author's raw ed25519 public key, an opaque body, an absolute
expiry, a per-author nonce, and the author's signature over the canonical msgpack
encoding of all the other fields.

Public API (stable; the mesh room imports it):

- ``Envelope(kind, author, body, expires_at, nonce, signature)``: frozen; raises
  ``InvalidMessageError`` on a bad field. ``to_bytes() -> bytes``,
  ``Envelope.from_bytes(raw, max_size=DEFAULT_MAX_SIZE) -> Envelope`` (raises
  ``EnvelopeRejectedError`` with reason ``OVERSIZED`` or ``MALFORMED``),
  ``signing_bytes() -> bytes``, ``has_valid_signature() -> bool``, ``digest -> bytes``
  (SHA-256 of the wire bytes: a message id), ``author_peer_id -> ID``.
- ``seal(identity, kind, body, *, now, ttl, nonce) -> Envelope``.
- ``signing_bytes(kind, author, body, expires_at, nonce) -> bytes``.
- ``EnvelopeValidator(kinds, *, max_size, max_ttl, nonce_window, max_tracked_nonces)``:
  ``validate(raw, *, now, remember=True) -> Envelope | Rejected``,
  ``validate_envelope(envelope, *, now, remember=True) -> Envelope | Rejected``,
  ``check(raw, *, now, remember=True) -> Envelope`` (raises ``EnvelopeRejectedError``),
  ``expire(now) -> int``, ``statistics() -> ValidatorStatistics``.
- ``Rejection`` (enum of reasons) and ``Rejected(reason, detail)``.

Times are Unix wall-clock seconds (``float``), passed in by the caller: this module
never reads a clock and does no I/O.

Theory of operation of the replay check
---------------------------------------
A replay is a second delivery of the very same signed bytes. Because the expiry is
signed, a replayed envelope carries its original expiry, so the validator only has to
remember a nonce until the envelope that carried it expires; after that the expiry
check rejects it. Per author the validator keeps a high-water mark (the largest nonce
accepted) and the nonces accepted within ``nonce_window`` below it, each with its
expiry. A nonce at or below ``high_water - nonce_window`` is refused as stale, which
bounds memory per author; authors therefore use increasing nonces (a counter, or a
nanosecond timestamp). An author's record is dropped only when every envelope it
could still be replaying has expired. ``max_tracked_nonces`` caps memory over all
authors; past it, new envelopes are refused with ``REPLAY_CACHE_FULL`` (our overload,
not the sender's fault) rather than forgetting nonces and letting replays through.

``remember=False`` checks without recording the nonce: use it where the same record is
legitimately read many times (a DHT ``get``), and ``remember=True`` where each
delivery is a new event (gossip, an RPC request).
"""

from __future__ import annotations

import enum
import hashlib
import heapq
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgpack

from ._errors import EnvelopeRejectedError, InvalidMessageError
from .identity import (
    PUBLIC_KEY_SIZE,
    SIGNATURE_SIZE,
    NodeIdentity,
    peer_id_from_public_key,
    verify,
)

if TYPE_CHECKING:
    from libp2p.peer.id import ID

__all__ = [
    "DEFAULT_MAX_SIZE",
    "MAX_KIND_LENGTH",
    "MAX_NONCE",
    "Envelope",
    "EnvelopeValidator",
    "Rejected",
    "Rejection",
    "ValidatorStatistics",
    "seal",
    "signing_bytes",
]

DEFAULT_MAX_SIZE = 64 * 1024
MAX_KIND_LENGTH = 64
MAX_NONCE = 2**64 - 1
# Domain separation: a signature over an envelope can never be mistaken for a signature
# over some other Cumulus structure (a lease countersignature, a session handshake).
_SIGNING_DOMAIN = "cumulus/envelope/v1"
_WIRE_FIELDS = 6


def _packb(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True, strict_types=True)


def signing_bytes(kind: str, author: bytes, body: bytes, expires_at: float, nonce: int) -> bytes:
    """Return the canonical bytes an envelope's signature covers.

    A fixed-order msgpack array of a domain tag and every field except the signature.
    """
    return _packb([_SIGNING_DOMAIN, kind, author, body, expires_at, nonce])


@dataclass(frozen=True, slots=True)
class Envelope:
    """A signed, expiring message.

    Attributes:
        kind: What the body is, e.g. ``"market/offer"``; at most 64 characters.
        author: The author's 32-byte raw ed25519 public key.
        body: The message, opaque here (canonical msgpack of a typed message).
        expires_at: Unix time after which the envelope is dead.
        nonce: Per-author, increasing; unique among the author's live envelopes.
        signature: The author's 64-byte signature over ``signing_bytes()``.

    Raises:
        InvalidMessageError: A field has the wrong type or is out of range.
    """

    kind: str
    author: bytes
    body: bytes
    expires_at: float
    nonce: int
    signature: bytes
    _wire: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if type(self.kind) is not str or not 0 < len(self.kind) <= MAX_KIND_LENGTH:
            raise InvalidMessageError(f"kind must be 1..{MAX_KIND_LENGTH} characters")
        if type(self.author) is not bytes or len(self.author) != PUBLIC_KEY_SIZE:
            raise InvalidMessageError(f"author must be {PUBLIC_KEY_SIZE} raw key bytes")
        if type(self.body) is not bytes:
            raise InvalidMessageError("body must be bytes")
        if type(self.expires_at) is not float or not math.isfinite(self.expires_at):
            raise InvalidMessageError("expires_at must be a finite float (Unix seconds)")
        if type(self.nonce) is not int or not 0 <= self.nonce <= MAX_NONCE:
            raise InvalidMessageError(f"nonce must be an int in 0..{MAX_NONCE}")
        if type(self.signature) is not bytes or len(self.signature) != SIGNATURE_SIZE:
            raise InvalidMessageError(f"signature must be {SIGNATURE_SIZE} bytes")
        wire = _packb(
            [self.kind, self.author, self.body, self.expires_at, self.nonce, self.signature]
        )
        object.__setattr__(self, "_wire", wire)

    def signing_bytes(self) -> bytes:
        """Return the canonical bytes the signature covers."""
        return signing_bytes(self.kind, self.author, self.body, self.expires_at, self.nonce)

    def has_valid_signature(self) -> bool:
        """Return whether ``signature`` is ``author``'s signature of this envelope."""
        return verify(self.author, self.signing_bytes(), self.signature)

    def to_bytes(self) -> bytes:
        """Return the canonical wire encoding (a fixed-order msgpack array)."""
        return self._wire

    @property
    def digest(self) -> bytes:
        """SHA-256 of the wire bytes: a stable message id (encodings are canonical)."""
        return hashlib.sha256(self._wire).digest()

    @property
    def author_peer_id(self) -> ID:
        """The libp2p peer ID of ``author``.

        Raises:
            ValueError: ``author`` is not a valid ed25519 point (the signature cannot
                verify either, so a validated envelope never raises here).
        """
        return peer_id_from_public_key(self.author)

    @classmethod
    def from_bytes(cls, raw: bytes, max_size: int = DEFAULT_MAX_SIZE) -> Envelope:
        """Decode an envelope from peer bytes. Does not check signature or time.

        Args:
            raw: The wire bytes.
            max_size: Largest accepted ``len(raw)``; checked before decoding.

        Returns:
            The envelope.

        Raises:
            EnvelopeRejectedError: ``reason`` is ``Rejection.OVERSIZED`` or
                ``Rejection.MALFORMED`` (not msgpack, wrong shape or types, or not the
                canonical encoding).
        """
        if len(raw) > max_size:
            raise EnvelopeRejectedError(
                Rejection.OVERSIZED, f"{len(raw)} bytes is over the limit of {max_size}"
            )
        try:
            fields = msgpack.unpackb(raw, raw=False, use_list=True, strict_map_key=True)
        except (ValueError, msgpack.UnpackException) as exc:
            raise EnvelopeRejectedError(Rejection.MALFORMED, f"not msgpack: {exc}") from exc
        if type(fields) is not list or len(fields) != _WIRE_FIELDS:
            raise EnvelopeRejectedError(
                Rejection.MALFORMED, f"expected an array of {_WIRE_FIELDS} fields"
            )
        try:
            envelope = cls(*fields)
        except InvalidMessageError as exc:
            raise EnvelopeRejectedError(Rejection.MALFORMED, str(exc)) from exc
        # One message, one encoding: otherwise a relay could re-encode an envelope and
        # defeat digest-based deduplication without touching the signature.
        if envelope.to_bytes() != bytes(raw):
            raise EnvelopeRejectedError(Rejection.MALFORMED, "not the canonical encoding")
        return envelope


def seal(
    identity: NodeIdentity, kind: str, body: bytes, *, now: float, ttl: float, nonce: int
) -> Envelope:
    """Sign ``body`` as ``identity`` into an envelope expiring at ``now + ttl``.

    Args:
        identity: The author.
        kind: The message kind.
        body: The encoded message.
        now: The current Unix time.
        ttl: Seconds the envelope lives; positive. Keep it under the receivers'
            ``max_ttl`` or they refuse the envelope as too far in the future.
        nonce: Larger than the author's previous nonces (see the module docstring).

    Returns:
        The signed envelope.

    Raises:
        InvalidMessageError: A field is invalid or ``ttl`` is not positive.
    """
    if not ttl > 0:
        raise InvalidMessageError("ttl must be positive")
    expires_at = float(now + ttl)
    if type(kind) is not str or type(body) is not bytes or type(nonce) is not int:
        raise InvalidMessageError("kind must be str, body bytes and nonce int")
    try:
        payload = signing_bytes(kind, identity.public_key, body, expires_at, nonce)
    except (TypeError, OverflowError) as exc:
        raise InvalidMessageError(f"cannot encode envelope: {exc}") from exc
    return Envelope(kind, identity.public_key, body, expires_at, nonce, identity.sign(payload))


class Rejection(enum.Enum):
    """Why an envelope was refused."""

    MALFORMED = "malformed"
    OVERSIZED = "oversized"
    UNKNOWN_KIND = "unknown kind"
    BAD_SIGNATURE = "bad signature"
    EXPIRED = "expired"
    TOO_FAR_IN_FUTURE = "expiry too far in the future"
    REPLAYED = "replayed"
    STALE_NONCE = "nonce below the author's replay window"
    REPLAY_CACHE_FULL = "replay cache full"

    @property
    def is_peer_fault(self) -> bool:
        """Whether the sender is to blame (for reputation and gossip scoring)."""
        return self is not Rejection.REPLAY_CACHE_FULL


@dataclass(frozen=True, slots=True)
class Rejected:
    """A validation failure: the reason and a sentence for logs."""

    reason: Rejection
    detail: str

    def to_error(self) -> EnvelopeRejectedError:
        """Return the matching ``EnvelopeRejectedError``."""
        return EnvelopeRejectedError(self.reason, self.detail)


@dataclass(frozen=True, slots=True)
class ValidatorStatistics:
    """A snapshot of a validator's replay memory."""

    tracked_authors: int
    tracked_nonces: int


@dataclass(slots=True)
class _AuthorNonces:
    high_water: int = -1
    live: dict[int, float] = field(default_factory=dict)
    # Min-heap of accepted nonces, so the window floor can advance in O(log n).
    order: list[int] = field(default_factory=list)
    # Latest expiry among nonces forgotten because they fell below the window: until
    # then the record must stay, or those envelopes could be replayed.
    stale_until: float = -math.inf


class EnvelopeValidator:
    """The single check every received envelope goes through. Sans-IO.

    Checks, in order: size, shape, kind, expiry, signature, replay. The signature is
    checked before the nonce is recorded, so forgeries cannot poison the replay memory.

    Args:
        kinds: The envelope kinds this receiver accepts.
        max_size: Largest wire size accepted, in bytes.
        max_ttl: Largest ``expires_at - now`` accepted, in seconds; it also bounds how
            long a nonce is remembered. Allow for clock skew on top of senders' TTLs.
        nonce_window: How far below an author's highest nonce a nonce is still
            accepted; bounds memory per author.
        max_tracked_nonces: Bound on remembered nonces over all authors.
    """

    def __init__(
        self,
        kinds: Iterable[str],
        *,
        max_size: int = DEFAULT_MAX_SIZE,
        max_ttl: float = 3600.0,
        nonce_window: int = 4096,
        max_tracked_nonces: int = 1_000_000,
    ) -> None:
        self._kinds = frozenset(kinds)
        self._max_size = max_size
        self._max_ttl = max_ttl
        self._window = nonce_window
        self._max_tracked = max_tracked_nonces
        self._authors: dict[bytes, _AuthorNonces] = {}
        self._tracked = 0
        # (expires_at, author, nonce); entries already forgotten are skipped when popped.
        self._expiry_heap: list[tuple[float, bytes, int]] = []

    @property
    def kinds(self) -> frozenset[str]:
        """The accepted kinds."""
        return self._kinds

    def validate(self, raw: bytes, *, now: float, remember: bool = True) -> Envelope | Rejected:
        """Decode and check wire bytes.

        Args:
            raw: The envelope's wire bytes, as received.
            now: The current Unix time.
            remember: Record the nonce, so a second delivery is ``REPLAYED``.

        Returns:
            The envelope if accepted, else a ``Rejected``. Nothing changes on rejection.
        """
        try:
            envelope = Envelope.from_bytes(raw, self._max_size)
        except EnvelopeRejectedError as exc:
            return Rejected(exc.reason, exc.detail)  # type: ignore[arg-type]
        return self.validate_envelope(envelope, now=now, remember=remember)

    def validate_envelope(
        self, envelope: Envelope, *, now: float, remember: bool = True
    ) -> Envelope | Rejected:
        """Check an already-decoded envelope; see ``validate``."""
        if len(envelope.to_bytes()) > self._max_size:
            return Rejected(Rejection.OVERSIZED, f"over the limit of {self._max_size} bytes")
        if envelope.kind not in self._kinds:
            return Rejected(Rejection.UNKNOWN_KIND, f"kind {envelope.kind!r} is not accepted")
        if envelope.expires_at <= now:
            return Rejected(Rejection.EXPIRED, f"expired {now - envelope.expires_at:.3f}s ago")
        if envelope.expires_at > now + self._max_ttl:
            return Rejected(
                Rejection.TOO_FAR_IN_FUTURE,
                f"expires in {envelope.expires_at - now:.3f}s, over the {self._max_ttl}s limit",
            )
        if not envelope.has_valid_signature():
            return Rejected(Rejection.BAD_SIGNATURE, "signature does not verify")
        return self._check_nonce(envelope, now, remember)

    def check(self, raw: bytes, *, now: float, remember: bool = True) -> Envelope:
        """Like ``validate``, but raise on rejection.

        Raises:
            EnvelopeRejectedError: The envelope was refused; ``reason`` says why.
        """
        result = self.validate(raw, now=now, remember=remember)
        if isinstance(result, Rejected):
            raise result.to_error()
        return result

    def expire(self, now: float) -> int:
        """Forget nonces whose envelopes have expired by ``now``.

        Returns:
            How many nonces were forgotten.
        """
        forgotten = 0
        heap = self._expiry_heap
        while heap and heap[0][0] <= now:
            expires_at, author, nonce = heapq.heappop(heap)
            record = self._authors.get(author)
            if record is None:
                continue
            if record.live.get(nonce) == expires_at:
                del record.live[nonce]
                self._tracked -= 1
                forgotten += 1
            if not record.live and record.stale_until <= now:
                del self._authors[author]
        return forgotten

    def statistics(self) -> ValidatorStatistics:
        """Return how much replay state is held."""
        return ValidatorStatistics(len(self._authors), self._tracked)

    def _check_nonce(self, envelope: Envelope, now: float, remember: bool) -> Envelope | Rejected:
        record = self._authors.get(envelope.author)
        nonce = envelope.nonce
        if record is not None:
            if nonce in record.live:
                return Rejected(Rejection.REPLAYED, f"nonce {nonce} was already seen")
            if nonce <= record.high_water - self._window:
                return Rejected(
                    Rejection.STALE_NONCE,
                    f"nonce {nonce} is more than {self._window} below {record.high_water}",
                )
        if not remember:
            return envelope
        if self._tracked >= self._max_tracked:
            self.expire(now)
            if self._tracked >= self._max_tracked:
                return Rejected(
                    Rejection.REPLAY_CACHE_FULL, f"{self._tracked} nonces are being tracked"
                )
        if record is None:
            record = self._authors[envelope.author] = _AuthorNonces()
        record.live[nonce] = envelope.expires_at
        heapq.heappush(record.order, nonce)
        self._tracked += 1
        heapq.heappush(self._expiry_heap, (envelope.expires_at, envelope.author, nonce))
        if nonce > record.high_water:
            record.high_water = nonce
            self._forget_below_window(record)
        return envelope

    def _forget_below_window(self, record: _AuthorNonces) -> None:
        floor = record.high_water - self._window
        order = record.order
        while order and order[0] <= floor:
            stale = heapq.heappop(order)
            expires_at = record.live.pop(stale, None)
            if expires_at is not None:  # else it already expired and was forgotten
                record.stale_until = max(record.stale_until, expires_at)
                self._tracked -= 1
