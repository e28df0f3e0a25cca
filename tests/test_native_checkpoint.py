"""A native session's checkpoints, sans-IO: what is read back, what is refused, what a
move sends. The end-to-end moves are in ``test_native_session.py``."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from cumulus_p2p._errors import BlobMismatchError, MalformedMessageError
from cumulus_p2p.blobs.names import PIECE, digest
from cumulus_p2p.native import records
from cumulus_p2p.native.checkpoint import (
    GROUP_BYTES,
    Checkpoint,
    Piece,
    PieceStore,
    groups,
    pieces_of,
)
from cumulus_p2p.wire import native as wire


def piece(handle: int, data: bytes, offset: int = 0) -> Piece:
    return Piece(handle, offset, len(data), digest(data))


def test_a_storage_is_named_by_one_digest_per_piece():
    head, tail = b"a" * PIECE, b"b" * 10
    pieces = pieces_of([(7, PIECE + 10, [digest(head), digest(tail)]), (8, 0, [])])
    assert pieces == [
        Piece(7, 0, PIECE, digest(head)),
        Piece(7, PIECE, 10, digest(tail)),
    ]


def test_only_pieces_not_held_are_read_back_each_name_once():
    store = PieceStore()
    held, same = piece(1, b"held"), piece(2, b"same")
    store.add(held, b"held")
    assert store.missing([held, same, piece(3, b"same")]) == [same]


def test_bytes_that_are_not_the_named_piece_are_refused_and_not_kept():
    store = PieceStore()
    named = piece(1, b"the real bytes")
    with pytest.raises(MalformedMessageError, match="not the bytes its digest names"):
        store.add(named, b"forged  bytes!")
    assert named.name not in store


def test_pieces_no_checkpoint_names_are_dropped():
    store = PieceStore()
    old, new = piece(1, b"old"), piece(1, b"new")
    store.add(old, b"old")
    store.add(new, b"new")
    store.keep_only([new])
    assert old.name not in store and new.name in store


def test_a_restore_allocates_every_storage_uploads_its_pieces_then_sets_the_generator():
    store = PieceStore()
    a, b = piece(1, b"\x01" * 8), piece(2, b"\x02" * 4)
    store.add(a, b"\x01" * 8)
    store.add(b, b"\x02" * 4)
    checkpoint = Checkpoint(((1, 8), (2, 4), (3, 0)), (a, b), b"rng", names=5)
    decoded = [r for batch in store.restore_batches(checkpoint) for r in records.decode(batch, [])]
    assert decoded == [
        records.Alloc(1, 8),
        records.Alloc(2, 4),
        records.Alloc(3, 0),
        records.Upload(a.view(), records.HostTensor("uint8", (8,), b"\x01" * 8)),
        records.Upload(b.view(), records.HostTensor("uint8", (4,), b"\x02" * 4)),
        records.RngSet(b"rng"),
    ]


def test_pieces_go_in_groups_that_keep_a_frame_under_its_limit():
    pieces = [Piece(1, i * PIECE, PIECE, f"{i:064x}") for i in range(9)]
    sizes = [sum(p.nbytes for p in group) for group in groups(pieces)]
    assert all(size <= GROUP_BYTES for size in sizes)
    assert sum(sizes) == 9 * PIECE


@pytest.mark.parametrize(
    "manifest",
    [
        b"\xc1",  # not msgpack
        msgpack.packb({"handle": 1}),
        msgpack.packb([[1, PIECE + 1, [digest(b"x")]]]),  # two pieces, one digest
        msgpack.packb([[1, 4, ["not a digest"]]]),
        msgpack.packb([[0, 4, [digest(b"x")]]]),  # handle 0 is no storage
        msgpack.packb([[1, -4, []]]),
    ],
)
def test_a_malformed_storage_manifest_is_refused(manifest):
    with pytest.raises(MalformedMessageError):
        wire.parse_manifest(manifest)


def test_a_manifest_round_trips():
    entries = [(3, 5, [digest(b"12345")]), (4, 0, [])]
    assert wire.parse_manifest(wire.encode_manifest(entries)) == entries


def test_naming_storages_never_runs_on_the_executors_event_loop():
    digests = b"".join(wire.request(wire.DIGESTS, [], b"", reply=True))
    small = b"".join(wire.request(wire.BATCH, [], b"", reply=True))
    assert not wire.runs_inline(digests) and wire.runs_inline(small)


def on_disk(tmp_path, *datas: bytes) -> tuple[PieceStore, list[Piece]]:
    store = PieceStore(tmp_path / "checkpoints")
    store.make_room(sum(len(d) for d in datas))
    pieces = [piece(i + 1, data) for i, data in enumerate(datas)]
    for p, data in zip(pieces, datas, strict=True):
        store.add(p, data)
    return store, pieces


def test_pieces_on_disk_restore_the_bytes_they_were_given(tmp_path):
    store, (a,) = on_disk(tmp_path, b"\x07" * 100)
    checkpoint = Checkpoint(((1, 100),), (a,), b"rng", names=0)
    uploads = [r for batch in store.restore_batches(checkpoint) for r in records.decode(batch, [])]
    assert records.Upload(a.view(), records.HostTensor("uint8", (100,), b"\x07" * 100)) in uploads


def test_a_piece_damaged_on_disk_is_refused_naming_the_directory(tmp_path):
    store, (a,) = on_disk(tmp_path, b"\x07" * 100)
    (tmp_path / "checkpoints" / a.name).write_bytes(b"\x08" * 100)
    with pytest.raises(BlobMismatchError, match="damaged on disk"):
        store.read(a.name)


def test_the_checkpoint_directory_holds_at_most_twice_the_state(tmp_path):
    store = PieceStore(tmp_path / "checkpoints")
    for version in range(6):  # every checkpoint changes the whole state
        data = bytes([version]) * 1000
        store.make_room(len(data))
        store.add(p := piece(1, data), data)
        store.keep_only([p])
    files = [f for f in (tmp_path / "checkpoints").iterdir() if f.is_file() and len(f.name) == 64]
    assert sum(f.stat().st_size for f in files) <= 2 * 1000  # not 6000: old pieces go
    assert store.nbytes == 1000


def test_closing_the_store_removes_its_directory(tmp_path):
    store, _ = on_disk(tmp_path, b"x" * 10)
    store.close()
    assert not (tmp_path / "checkpoints").exists()


def test_keeping_pieces_for_a_standby_never_runs_on_the_executors_event_loop():
    keep = b"".join(wire.request(wire.KEEP, [], b"", reply=True))
    assert not wire.runs_inline(keep)


def test_a_restore_request_round_trips():
    sources = [("127.0.0.1:9", "ab" * 32)]
    entries = [(3, 5, [digest(b"12345")]), (4, 0, [])]
    parsed = wire.parse_restore(wire.encode_restore(sources, entries))
    assert parsed == ([["127.0.0.1:9", "ab" * 32]], entries)


@pytest.mark.parametrize(
    "request_",
    [
        b"\xc1",  # not msgpack
        msgpack.packb([["127.0.0.1:9", "ab" * 32]]),  # not a map
        msgpack.packb({"sources": []}),  # no storages
        msgpack.packb({"sources": [["127.0.0.1:9"]], "storages": []}),  # not a pair
        msgpack.packb({"sources": [["a:1", "b"]] * (wire.MAX_SOURCES + 1), "storages": []}),
        msgpack.packb({"sources": [], "storages": [[1, 4, ["not a digest"]]]}),
        msgpack.packb({"sources": [], "storages": [[1, 0, []], [1, 0, []]]}),  # named twice
    ],
    ids=[
        "not msgpack",
        "a list",
        "no storages",
        "a lone address",
        "too many sources",
        "a bad digest",
        "a storage named twice",
    ],
)
def test_a_malformed_restore_request_is_refused(request_):
    with pytest.raises(MalformedMessageError):
        wire.parse_restore(request_)


def test_a_standby_checkpoint_restores_from_its_standby_then_sets_the_generator():
    from cumulus_p2p.blobs.service import Source
    from cumulus_p2p.native.checkpoint import StandbyCheckpoint, host_checkpoint

    manifest = [(1, 5, [digest(b"12345")]), (2, 0, [])]
    primary, standby = Source("127.0.0.1:1", "aa" * 32), Source("127.0.0.1:2", "bb" * 32)
    held = host_checkpoint(7, manifest, b"rng", primary)
    checkpoint = StandbyCheckpoint(dataclasses.replace(held, sources=(standby,)), names=3)
    assert held.digests == [digest(b"12345")] and checkpoint.nbytes == 5
    sources, entries = wire.parse_restore(checkpoint.restore_request())
    assert sources == [["127.0.0.1:2", "bb" * 32]] and entries == manifest
    assert records.decode(checkpoint.rng_batch(), []) == [records.RngSet(b"rng")]
