"""Uploads named by digest: bytes the host's blob store holds do not cross the link again.

Theory of operation
-------------------
The native device uploads a large tensor as UPLOAD records of one ``PIECE`` (16 MiB) at
most, their bytes inline. A second run of a script on the same model, or a move to a
host that keeps the session's checkpoint, would send those bytes again. So before it
sends a batch holding uploads of ``MIN_NAMED`` bytes or more, the client names each by
its BLAKE3 digest and asks the host which its store holds (a HAVE request). Each held
upload becomes a NAMED_UPLOAD record: the same destination, dtype and shape, and the
digest where the bytes were. The batch goes as a NAMED request.

The host resolves a NAMED request before its replay loop sees it: each NAMED_UPLOAD
becomes an UPLOAD again, with the bytes read from the store and checked against the
digest, and each inline upload of ``MIN_NAMED`` bytes or more is kept in the store
under its digest, for the next time. The replay loop (C++) never sees a named record.

The client's replay log keeps the batch with its bytes inline, so a move to a host that
holds nothing still has them. A private session names nothing, and its host keeps none
of its uploads.

Sans-IO: bytes in, bytes out; the store and the HAVE round trip are the caller's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .._errors import BlobMismatchError, MalformedMessageError
from ..blobs.names import digest, is_digest
from . import records

#: A record kind only the client and the host's Python read and write: an UPLOAD whose
#: bytes the host's store holds, named by digest. Outside the C++ kinds (1-12).
NAMED_UPLOAD = 64
#: Uploads smaller than this go inline always: a HAVE round trip costs more than they do.
MIN_NAMED = 1 << 20
_NAME_BYTES = 64


def large_uploads(batch: bytes | memoryview) -> list[tuple[int, memoryview]]:
    """``(record index, bytes)`` of each UPLOAD in ``batch`` of ``MIN_NAMED`` bytes or
    more (views into ``batch``)."""
    view, found = memoryview(batch), []
    for index, (kind, start, end) in enumerate(records.spans(view)):
        if kind == 3 and end - start >= MIN_NAMED:
            data_start, data_end = records.upload_data(view[start:end])
            if data_end - data_start >= MIN_NAMED:
                found.append((index, view[start + data_start : start + data_end]))
    return found


def name_uploads(batch: bytes | memoryview, named: dict[int, str]) -> bytes:
    """``batch`` with the UPLOAD records at the indexes of ``named`` as NAMED_UPLOAD
    records carrying those digests instead of their bytes."""
    view, out = memoryview(batch), bytearray()
    for index, (_, start, end) in enumerate(records.spans(view)):
        name = named.get(index)
        if name is None:
            out += view[start - records.HEAD_BYTES : end]  # the record whole
            continue
        data_start, _ = records.upload_data(view[start:end])
        body = bytes(view[start : start + data_start]) + name.encode("ascii")
        out += records.head(NAMED_UPLOAD, len(body)) + body
    return bytes(out)


def resolve(
    batch: bytes | memoryview,
    piece: Callable[[str], memoryview | bytes | None],
    keep: Callable[[str, memoryview], None],
) -> bytes:
    """A NAMED request's batch as the replay loop reads it: each NAMED_UPLOAD's bytes
    from ``piece(digest)`` (the host's store), and each large inline upload handed to
    ``keep(digest, bytes)`` on the way.

    Raises:
        MalformedMessageError: a named record is malformed, or names bytes the store
            does not hold (the client was told it did; the session cannot go on).
        BlobMismatchError: the store's bytes are damaged (``piece`` checks them).
    """
    view, out = memoryview(batch), bytearray()
    for kind, start, end in records.spans(view):
        if kind == NAMED_UPLOAD:
            out += _resolved(view[start:end], piece)
            continue
        if kind == 3 and end - start >= MIN_NAMED:
            data_start, data_end = records.upload_data(view[start:end])
            data = view[start + data_start : start + data_end]
            if len(data) >= MIN_NAMED:
                keep(digest(data), data)
        out += view[start - records.HEAD_BYTES : end]
    return bytes(out)


def _resolved(body: memoryview, piece: Callable[[str], memoryview | bytes | None]) -> bytes:
    """A NAMED_UPLOAD's body as the UPLOAD record it stands for, whole."""
    if len(body) < _NAME_BYTES:
        raise MalformedMessageError("a named upload shorter than its digest")
    header, name = body[:-_NAME_BYTES], bytes(body[-_NAME_BYTES:]).decode("ascii", "replace")
    if not is_digest(name):
        raise MalformedMessageError("a named upload's name is not a digest")
    data = piece(name)
    if data is None:
        raise MalformedMessageError(f"a named upload's piece {name[:16]} is not held here")
    upload = bytes(header) + bytes(data)
    data_start, data_end = records.upload_data(memoryview(upload))
    if data_end - data_start != len(data) or digest(data) != name:
        raise BlobMismatchError(f"the piece {name[:16]} is not the bytes its upload names")
    return records.head(3, len(upload)) + upload


def digests(uploads: Sequence[tuple[int, memoryview]]) -> list[str]:
    """The digest of each upload's bytes, in order."""
    return [digest(data) for _, data in uploads]
