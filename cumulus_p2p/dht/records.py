"""DHT records under ``/cumulus/``: the offer sheets that let a late joiner read the book.

Sans-IO: nothing here touches the network or reads a clock; ``now`` is passed in.

Theory of operation
-------------------
Kademlia stores one value per key, but the book is many offers from many hosts. So
each host owns exactly one key, ``/cumulus/offers/<hash of peer id>``, and stores there its
*offer sheet*: an ``Envelope`` of kind ``SHEET_KIND`` whose body is a msgpack array of
the host's current offer envelopes (the very bytes it gossips). A host is also a
*provider* of the index key ``OFFERS_INDEX``, so a late joiner finds every host with
``find_providers(OFFERS_INDEX)`` and reads each sheet with ``get_value``.

Every sheet is re-sealed with a fresh expiry on each announce heartbeat, and so is
every offer in it. A host that stops announcing therefore disappears by itself: its
last sheet and offers expire everywhere at most one TTL after its last heartbeat, and
expired records are refused by ``check_sheet`` wherever they turn up (a stale replica,
a provider record that outlives the host).

A record is accepted only if the sheet and every offer in it verify, are live, and
are authored by the peer named in the key, so nobody can write into another host's
key. Among competing valid sheets for one key, ``select_sheet`` keeps the freshest
(largest expiry, then largest nonce); since only the owner can sign, the freshest is
the owner's latest.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import msgpack
from libp2p.peer.id import ID

from .._errors import InvalidRecordError
from ..envelope import Envelope, EnvelopeValidator, Rejection

__all__ = [
    "NAMESPACE",
    "OFFERS_INDEX",
    "SHEET_KIND",
    "LiveEnvelopes",
    "check_sheet",
    "decode_sheet_body",
    "encode_sheet_body",
    "offers_key",
    "select_sheet",
]

NAMESPACE = "cumulus"
# The provider key every announcing host provides; its providers are the hosts.
OFFERS_INDEX = f"/{NAMESPACE}/offers"
SHEET_KIND = "mesh/offer-sheet"
_OFFERS_PREFIX = f"{OFFERS_INDEX}/"
_KEY_HEX_DIGITS = 32


def offers_key(peer_id: ID) -> str:
    """Return the DHT key where ``peer_id`` keeps its offer sheet.

    The key holds a 128-bit hash of the peer ID rather than the ID itself: py-libp2p
    0.8.1 looks keys up with FIND_NODE on the raw key bytes, and its own servers ignore
    FIND_NODE keys longer than 50 bytes that are not multihashes, so a
    ``/cumulus/offers/<base58 id>`` key (68 bytes) could never be found on the network.
    """
    return _OFFERS_PREFIX + hashlib.sha256(peer_id.to_bytes()).hexdigest()[:_KEY_HEX_DIGITS]


def encode_sheet_body(offers: Iterable[bytes]) -> bytes:
    """Encode offer envelopes (wire bytes) as a sheet body."""
    return msgpack.packb(list(offers), use_bin_type=True, strict_types=True)


def decode_sheet_body(body: bytes, *, max_items: int) -> list[bytes]:
    """Decode a sheet body into offer envelope bytes.

    Raises:
        InvalidRecordError: Not a msgpack array of at most ``max_items`` byte strings.
    """
    try:
        items = msgpack.unpackb(body, raw=False, use_list=True, max_array_len=max_items)
    except (ValueError, msgpack.UnpackException) as exc:
        raise InvalidRecordError(f"sheet body is not msgpack: {exc}") from exc
    if type(items) is not list or any(type(item) is not bytes for item in items):
        raise InvalidRecordError("sheet body must be an array of byte strings")
    return items


def check_sheet(
    key: str,
    value: bytes,
    validator: EnvelopeValidator,
    *,
    now: float,
    max_offers: int,
) -> tuple[Envelope, list[Envelope]]:
    """Check an offer-sheet record without recording any nonce.

    A DHT record is legitimately read many times, so this never marks anything as
    seen (``remember=False``); replay protection applies when the offers are delivered.

    Args:
        key: The record's key, ``offers_key(<author>)``.
        value: The record's value: a sheet envelope's wire bytes.
        validator: The node's envelope validator; it must accept ``SHEET_KIND``.
        now: The current Unix time.
        max_offers: Largest number of offers a sheet may list.

    Returns:
        The sheet envelope and its offer envelopes.

    Raises:
        InvalidRecordError: The key, the sheet or any offer in it is invalid, expired
            or not authored by the key's owner.
    """
    if not key.startswith(_OFFERS_PREFIX):
        raise InvalidRecordError(f"{key!r} is not an offer-sheet key")
    sheet = _check_record_envelope(value, validator, now, "sheet")
    if sheet.kind != SHEET_KIND:
        raise InvalidRecordError(f"record kind is {sheet.kind!r}, not {SHEET_KIND!r}")
    # A valid signature implies a valid key, so author_peer_id cannot raise here.
    if offers_key(sheet.author_peer_id) != key:
        raise InvalidRecordError("sheet is not signed by the owner of its key")
    offers: list[Envelope] = []
    for raw in decode_sheet_body(sheet.body, max_items=max_offers):
        offer = _check_record_envelope(raw, validator, now, "offer")
        if offer.author != sheet.author:
            raise InvalidRecordError("a sheet may only list its own author's offers")
        offers.append(offer)
    return sheet, offers


# The validator checks the nonce last, after size, kind, expiry and signature. A record
# is legitimately read again and again, so "already seen" does not make it invalid.
_SEEN = (Rejection.REPLAYED, Rejection.STALE_NONCE)


def _check_record_envelope(
    raw: bytes, validator: EnvelopeValidator, now: float, what: str
) -> Envelope:
    result = validator.validate(raw, now=now, remember=False)
    if isinstance(result, Envelope):
        return result
    if result.reason in _SEEN:
        return Envelope.from_bytes(raw, max_size=len(raw))
    raise InvalidRecordError(f"{what} refused: {result.reason.value}: {result.detail}")


def _freshness(value: bytes) -> tuple[float, int]:
    # Undecodable values rank below every valid one; select must never raise.
    try:
        sheet = Envelope.from_bytes(value, max_size=len(value))
    except Exception:  # noqa: BLE001 - any decoding failure means "worst"
        return (-math.inf, -1)
    return (sheet.expires_at, sheet.nonce)


def select_sheet(values: Sequence[bytes]) -> int:
    """Return the index of the freshest sheet (largest expiry, then nonce).

    Ties go to the earliest index, which Kademlia reads as "keep the existing record".
    """
    best = 0
    best_rank = _freshness(values[0])
    for index in range(1, len(values)):
        rank = _freshness(values[index])
        if rank > best_rank:
            best, best_rank = index, rank
    return best


@dataclass(frozen=True, slots=True)
class LiveEntry:
    """One live envelope and where it came from."""

    envelope: Envelope
    source: str


class LiveEnvelopes:
    """Accepted envelopes that have not expired yet, keyed by digest. Sans-IO.

    A minimal book: enough for tests and tools to ask "what is live now, and from
    whom". The market's order book does the real work (offer identity, matching).
    """

    def __init__(self) -> None:
        self._entries: dict[bytes, LiveEntry] = {}

    def add(self, envelope: Envelope, *, source: str, now: float) -> bool:
        """Record ``envelope`` unless it is already expired; return whether it was new."""
        if envelope.expires_at <= now or envelope.digest in self._entries:
            return False
        self._entries[envelope.digest] = LiveEntry(envelope, source)
        return True

    def expire(self, now: float) -> list[Envelope]:
        """Drop and return every envelope that expired by ``now``."""
        dead = [d for d, e in self._entries.items() if e.envelope.expires_at <= now]
        return [self._entries.pop(d).envelope for d in dead]

    def live(self, now: float) -> list[LiveEntry]:
        """Return the entries still live at ``now``."""
        return [e for e in self._entries.values() if e.envelope.expires_at > now]

    def authors(self, now: float, *, kind: str | None = None) -> set[bytes]:
        """Return the authors with at least one live envelope (of ``kind``, if given)."""
        return {
            e.envelope.author for e in self.live(now) if kind is None or e.envelope.kind == kind
        }

    def __contains__(self, digest: object) -> bool:
        return digest in self._entries

    def __len__(self) -> int:
        return len(self._entries)
