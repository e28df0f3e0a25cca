"""The frames of a native session with its executor, after its hello (sans-IO).

Each frame travels length-prefixed over ``cumulus_p2p.channel.transport``'s channels
(plain TCP or the secure channel); this module only says what the bytes inside mean.

A native session opens as every session does (``protocol``): the client's
``["hello", PROTOCOL_VERSION, {"native": VERSION, ...}]`` and the executor's
``["welcome", ...]`` or ``["fatal", why]``. From then on, only these frames.

Client to executor::

    Request := kind:u8 reply:u8 grows:u64 nnames:u32 (len:u32 utf8)[nnames] batch
      kind 1 BATCH   run `batch` (record.h's records, to the frame's end) after adding
                     the names to the session's op name table (the names the client
                     interned since its last frame); `reply` 1: answer when done.
                     `grows`: the most bytes its storages take beyond the last batch's,
                     as the client counted them; a host that bounds its device's memory
                     makes that room before it runs the batch (0 in other requests)
      kind 2 BYE     the session ends (no reply)
      kind 3 DIGESTS name every live storage's pieces (`reply` 1, no names, no batch):
                     what a checkpoint reads to fetch only the pieces that changed
      kind 4 KEEP    as DIGESTS, and the executor keeps a copy of every piece for a
                     standby host to pull under the session's grant (``host/kept.py``)
      kind 5 RESTORE `batch` is msgpack {"sources": [[address, grant], ...],
                     "storages": [[handle, nbytes, [digest, ...]], ...]}: make those
                     storages and fill them with their pieces, from this host's store
                     or pulled from the sources (a failover's fresh host, `reply` 1)
      kind 6 RESEND  the reply to the last BATCH received, again: a resumed client's
                     request that ran while its connection dropped (`reply` 1)
      kind 7 NAMED   a BATCH whose uploads may name their bytes by digest
                     (``native.named``): the host fills those from its blob store, and
                     keeps its large inline uploads there
      kind 8 HAVE    `batch` is a msgpack list of digests: which the host's store holds
                     (`reply` 1; the answer is a msgpack list of booleans). Those held
                     stay pinned until the next HAVE

A session that resumes (``["resume", PROTOCOL_VERSION, {"token": ..., "native": VERSION}]``)
is welcomed with ``"batches"``: how many BATCH requests it has received in all. The
client sends again only those after.

Executor to client, only for a request with `reply` 1, an op-stream frame
(``protocol.encode_frame``: a msgpack header, then the blobs)::

    ["ok", lengths] + blobs          the batch's readbacks, in order
    ["failed", record, kind, why]    the session's first failed record
    ["ok", [n]] + [manifest]         a DIGESTS or KEEP answer: msgpack [[handle, nbytes,
                                     [digest, ...]], ...], a digest (``blobs.names``)
                                     per ``PIECE`` of each storage, by handle
    ["ok", [n]] + [result]           a RESTORE answer: msgpack {"fetched_bytes": n,
                                     "local_bytes": n}
    ["failed", -1, "restore", why]   a RESTORE that could not fill every storage: none
                                     is left, and the session goes on without them
    ["fatal", why]                   the session is over (sent unasked, as for any session)

A failure ends the session's usefulness: the executor replays nothing after it and
answers every later request with the same failure (the client's picture of the
executor's storages is no longer true).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import msgpack

from .._errors import MalformedMessageError, SessionClosedError
from ..blobs.names import is_digest, piece_count
from .protocol import decode_frame, encode_frame, split_blobs

#: The native frames' version, named in the hello: both sides must speak the same.
VERSION = 7
BATCH, BYE, DIGESTS, KEEP, RESTORE, RESEND, NAMED, HAVE = 1, 2, 3, 4, 5, 6, 7, 8
#: The requests that run a batch, and that a resumed session counts.
BATCHES = (BATCH, NAMED)
#: A restore's most storages and sources: far more than a session holds or needs.
MAX_RESTORE_STORAGES = 1 << 20
MAX_SOURCES = 16
#: Requests this small are replayed on the executor's event loop (about a millisecond
#: of records at most): cheaper than handing them to a thread and back.
LIGHT_BYTES = 64 * 1024
_HEAD = struct.Struct("<BBQI")
_LEN = struct.Struct("<I")


def request(
    kind: int, names: Sequence[str], batch: bytes, reply: bool, grows: int = 0
) -> list[bytes]:
    """A request's parts (sent as one frame, without joining the batch)."""
    head = bytearray(_HEAD.pack(kind, reply, grows, len(names)))
    for name in names:
        data = name.encode()
        head += _LEN.pack(len(data)) + data
    return [bytes(head), batch]


def parse_request(frame: bytes | bytearray) -> tuple[int, bool, list[str], memoryview]:
    """(kind, reply, names, batch) of a request frame.

    Raises:
        MalformedMessageError: the frame is shorter than its header says, or its kind
            is unknown.
    """
    view = memoryview(frame)
    if len(view) < _HEAD.size:
        raise MalformedMessageError("request shorter than its header")
    kind, reply, _, count = _HEAD.unpack_from(view)
    if not BATCH <= kind <= HAVE:
        raise MalformedMessageError(f"unknown request kind {kind}")
    at, names = _HEAD.size, []
    for _ in range(count):
        if at + _LEN.size > len(view):
            raise MalformedMessageError("request's name table truncated")
        (length,) = _LEN.unpack_from(view, at)
        at += _LEN.size
        if at + length > len(view):
            raise MalformedMessageError("request's name table truncated")
        names.append(bytes(view[at : at + length]).decode())
        at += length
    return kind, bool(reply), names, view[at:]


def growth(frame: bytes | bytearray) -> int:
    """The bytes a BATCH or NAMED request says its storages grow by; 0 for any other
    request, or one too short to say (``parse_request`` refuses it)."""
    if len(frame) < _HEAD.size or frame[0] not in BATCHES:
        return 0
    return _HEAD.unpack_from(frame)[2]


def runs_inline(frame: bytes | bytearray) -> bool:
    """Whether a request is light enough to replay on the executor's event loop: a small
    batch, but never one that hashes storages or reads the blob store (nor, the session
    decides, one that calls a compiled graph: ``ReplaySession.runs_inline``)."""
    return len(frame) <= LIGHT_BYTES and frame[0] in (BATCH, BYE, RESEND) if frame else True


def encode_manifest(entries: Sequence[tuple[int, int, Sequence[str]]]) -> bytes:
    """A DIGESTS answer's manifest: ``(handle, nbytes, piece digests)`` per storage."""
    return msgpack.packb([[h, n, list(d)] for h, n, d in entries])


def parse_manifest(data: bytes | memoryview) -> list[tuple[int, int, list[str]]]:
    """The entries of a DIGESTS answer, checked: each storage's digests are one per
    ``PIECE`` of its bytes.

    Raises:
        MalformedMessageError: the manifest is not that.
    """
    return _checked_entries(_unpacked(data, "a storage manifest"))


def _unpacked(data: bytes | memoryview, what: str) -> object:
    try:
        return msgpack.unpackb(data, use_list=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise MalformedMessageError(f"{what} that is not msgpack: {exc}") from exc


def _checked_entries(entries: object) -> list[tuple[int, int, list[str]]]:
    if not isinstance(entries, list):
        raise MalformedMessageError("a storage manifest must be a list")
    out = []
    for entry in entries:
        match entry:
            case [int(handle), int(nbytes), list(digests)] if (
                handle > 0 and nbytes >= 0 and len(digests) == piece_count(nbytes)
                and all(is_digest(d) for d in digests)
            ):  # fmt: skip
                out.append((handle, nbytes, digests))
            case _:
                raise MalformedMessageError(f"a malformed storage manifest entry: {entry!r:.80}")
    return out


def encode_restore(
    sources: Sequence[tuple[str, str]], entries: Sequence[tuple[int, int, Sequence[str]]]
) -> bytes:
    """A RESTORE request's batch: the storages to make, and the hosts their pieces are at
    (``(address, grant)``, tried in order)."""
    storages = [[h, n, list(d)] for h, n, d in entries]
    return msgpack.packb({"sources": [list(s) for s in sources], "storages": storages})


def parse_restore(
    data: bytes | memoryview,
) -> tuple[list[list], list[tuple[int, int, list[str]]]]:
    """(sources, storages) of a RESTORE request's batch; each storage checked as a
    manifest's entry is, a handle named once. The sources are only ``[str, str]`` here:
    the executor checks them as addresses and grants (``blobs.service.parse_sources``).

    Raises:
        MalformedMessageError: the batch is not that.
    """
    match _unpacked(data, "a restore"):
        case {"sources": list(sources), "storages": list(storages)} if (
            len(sources) <= MAX_SOURCES and len(storages) <= MAX_RESTORE_STORAGES
        ):
            pass
        case _:
            raise MalformedMessageError(
                'a restore is {"sources": [[address, grant], ...], "storages": [[handle, '
                f"nbytes, [digest, ...]], ...]}} with at most {MAX_SOURCES} sources"
            )
    if not all(isinstance(s, list) and [type(x) for x in s] == [str, str] for s in sources):
        raise MalformedMessageError("a restore's sources are [address, grant] pairs")
    entries = _checked_entries(storages)
    if len({handle for handle, _, _ in entries}) != len(entries):
        raise MalformedMessageError("a restore names a storage twice")
    return sources, entries


def ok(readbacks: Sequence[bytes]) -> list:
    """A reply carrying the batch's readbacks."""
    return encode_frame(["ok", [len(data) for data in readbacks]], list(readbacks))


def failed(record: int, kind: str, message: str) -> list:
    """A reply carrying the session's first failure."""
    return encode_frame(["failed", record, kind, message])


def parse_reply(frame: bytes | bytearray) -> list[memoryview] | tuple[int, str, str]:
    """The readbacks of an ``ok`` reply, or (record, kind, message) of a failure.

    Raises:
        SessionClosedError: the executor ended the session (``fatal``, ``lost``); the
            message says why.
        RemoteProtocolError: the reply is malformed.
    """
    header, area = decode_frame(frame)
    match header:
        case ["ok", lengths]:
            return split_blobs(area, lengths)
        case ["failed", int(record), str(kind), str(message)]:
            return record, kind, message
        case ["fatal", str(message)] | ["lost", str(message), *_]:
            raise SessionClosedError(f"the executor ended the session: {message}")
    raise MalformedMessageError(f"not a native session's reply: {header[0]!r}")
