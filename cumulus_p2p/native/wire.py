"""The frames between a native session and its executor process (sans-IO).

Each frame travels length-prefixed over ``cumulus_p2p.channel.transport``'s channels;
this module only says what the bytes inside mean.

Client to executor::

    Request := kind:u8 reply:u8 nnames:u32 (len:u32 utf8)[nnames] batch
      kind 1 BATCH   run `batch` (record.h's records, to the frame's end) after adding
                     the names to the session's op name table (the names the client
                     interned since its last frame); `reply` 1: answer when done
      kind 2 BYE     the session ends (no reply)

Executor to client, only for a request with `reply` 1::

    Reply := 0:u8 n:u32 (len:u64 bytes)[n]           the batch's readbacks, in order
           | 1:u8 record:i64 kind_len:u32 kind message   the session's first failure

A failure ends the session's usefulness: the executor replays nothing after it and
answers every later request with the same failure (the client's picture of the
executor's storages is no longer true).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from .._errors import MalformedMessageError

BATCH, BYE = 1, 2
_HEAD = struct.Struct("<BBI")
_LEN = struct.Struct("<I")


def request(kind: int, names: Sequence[str], batch: bytes, reply: bool) -> list[bytes]:
    """A request's parts (sent as one frame, without joining the batch)."""
    head = bytearray(_HEAD.pack(kind, reply, len(names)))
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
    kind, reply, count = _HEAD.unpack_from(view)
    if kind not in (BATCH, BYE):
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


def ok(readbacks: Sequence[bytes]) -> list[bytes]:
    """A reply carrying the batch's readbacks."""
    parts = [struct.pack("<BI", 0, len(readbacks))]
    for data in readbacks:
        parts += [struct.pack("<Q", len(data)), data]
    return parts


def failed(record: int, kind: str, message: str) -> list[bytes]:
    """A reply carrying the session's first failure."""
    data = kind.encode()
    return [struct.pack("<BqI", 1, record, len(data)) + data + message.encode()]


def parse_reply(frame: bytes | bytearray) -> list[bytes] | tuple[int, str, str]:
    """The readbacks of an ``ok`` reply, or (record, kind, message) of a failure.

    Raises:
        MalformedMessageError: the reply is truncated or of an unknown status.
    """
    view = memoryview(frame)
    try:
        status = view[0]
        if status == 1:
            record, length = struct.unpack_from("<qI", view, 1)
            kind = bytes(view[13 : 13 + length]).decode()
            return record, kind, bytes(view[13 + length :]).decode()
        if status != 0:
            raise MalformedMessageError(f"unknown reply status {status}")
        (count,) = struct.unpack_from("<I", view, 1)
        at, out = 5, []
        for _ in range(count):
            (length,) = struct.unpack_from("<Q", view, at)
            at += 8
            if at + length > len(view):
                raise MalformedMessageError("reply truncated")
            out.append(bytes(view[at : at + length]))
            at += length
        return out
    except (IndexError, struct.error) as exc:
        raise MalformedMessageError(f"reply truncated: {exc}") from None
