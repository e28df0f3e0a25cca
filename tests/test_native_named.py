"""Uploads named by digest (``native/named.py``), sans-IO: what is named, what the host
resolves, what it refuses."""

from __future__ import annotations

import pytest

from cumulus_p2p._errors import BlobMismatchError, MalformedMessageError
from cumulus_p2p.blobs.names import digest
from cumulus_p2p.native import named, records

BIG = bytes(range(256)) * (named.MIN_NAMED // 256)  # one MiB: worth naming
SMALL = b"\x07" * 1024


def upload(handle: int, data: bytes) -> records.Upload:
    dst = records.TensorRef(handle, 0, "uint8", (len(data),), (1,))
    return records.Upload(dst, records.HostTensor("uint8", (len(data),), data))


def batch_of(*uploads: records.Upload) -> bytes:
    return records.encode([records.Alloc(9, 4), *uploads, records.Free(9)], [])


def test_only_uploads_of_a_mebibyte_or_more_are_worth_naming():
    batch = batch_of(upload(1, SMALL), upload(2, BIG))
    assert [(index, bytes(data)) for index, data in named.large_uploads(batch)] == [(2, BIG)]


def test_a_named_batch_resolves_to_the_batch_it_was_made_from():
    batch = batch_of(upload(1, SMALL), upload(2, BIG))
    sent = named.name_uploads(batch, {2: digest(BIG)})
    assert len(sent) < len(batch) - len(BIG) + 100  # the bytes stayed home
    store = {digest(BIG): BIG}
    assert named.resolve(sent, store.get, lambda *_: None) == batch


def test_the_host_keeps_large_inline_uploads_for_the_next_time():
    kept = {}
    batch = batch_of(upload(1, SMALL), upload(2, BIG))
    assert named.resolve(batch, {}.get, lambda name, data: kept.update({name: bytes(data)}))
    assert kept == {digest(BIG): BIG}


def test_a_named_piece_the_store_does_not_hold_is_refused():
    sent = named.name_uploads(batch_of(upload(2, BIG)), {1: digest(BIG)})
    with pytest.raises(MalformedMessageError, match="not held here"):
        named.resolve(sent, {}.get, lambda *_: None)


def test_store_bytes_that_are_not_the_named_piece_are_refused():
    sent = named.name_uploads(batch_of(upload(2, BIG)), {1: digest(BIG)})
    forged = {digest(BIG): bytes(len(BIG))}
    with pytest.raises(BlobMismatchError):
        named.resolve(sent, forged.get, lambda *_: None)


@pytest.mark.parametrize(
    "body",
    [b"short", b"\x01" * 40 + b"z" * 64],
    ids=["shorter than a digest", "a name that is not a digest"],
)
def test_a_malformed_named_upload_is_refused(body):
    with pytest.raises(MalformedMessageError):
        named.resolve(records.head(named.NAMED_UPLOAD, len(body)) + body, {}.get, print)


def test_a_record_running_past_its_batch_is_refused():
    batch = batch_of(upload(2, BIG))
    with pytest.raises(MalformedMessageError, match="truncated"):
        list(records.spans(batch[:-10]))
