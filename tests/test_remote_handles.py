"""The executor's handle table (``host/handles.py``), without an executor."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from cumulus_p2p.host.handles import (
    MAX_HANDLE,
    MAX_VIEWS_PER_STORAGE,
    ErrorKind,
    HandleTable,
    OpFailed,
    raw_bytes,
)
from cumulus_p2p.host.session import SessionStats
from cumulus_p2p.wire.protocol import TensorRef

CPU = torch.device("cpu")


def table(quota_bytes: int = 1 << 20) -> HandleTable:
    return HandleTable(CPU, SessionStats(), quota_bytes=quota_bytes)


def ref(handle: int, sizes=(4,), strides=(1,), offset=0, dtype=torch.float32) -> TensorRef:
    return TensorRef(handle, dtype, offset, tuple(sizes), tuple(strides))


def holding_one() -> HandleTable:
    """A table holding handle 1: four float32 zeros (16 bytes)."""
    handles = table()
    handles.add(1, torch.zeros(4))
    return handles


@contextmanager
def fails(kind: str, match: str) -> Iterator[None]:
    with pytest.raises(OpFailed, match=match) as info:
        yield
    assert info.value.kind == kind


def test_registering_counts_the_whole_storage():
    handles = table()
    handles.add(1, torch.zeros(8)[2:4])
    assert 1 in handles and len(handles) == 1
    assert handles.get(1).capacity == 32
    stats = handles.stats
    assert (stats.bytes_in_use, stats.peak_bytes, stats.storages) == (32, 32, 1)


def test_a_handle_in_use_cannot_be_registered_again():
    handles = holding_one()
    with fails(ErrorKind.INVALID_HANDLE, "handle 1 is already in use"):
        handles.add(1, torch.zeros(4))
    assert handles.bytes_in_use == 16


@pytest.mark.parametrize("handle", [0, -1, MAX_HANDLE, 1.0, "1", None])
def test_a_handle_a_client_may_not_choose_is_refused(handle):
    with fails(ErrorKind.INVALID_HANDLE, "bad output handle"):
        table().add(handle, torch.zeros(4))


def test_a_view_is_built_once_and_then_reused():
    handles = table()
    handles.add(1, torch.arange(6.0))
    first = handles.view(ref(1, sizes=(2,), strides=(2,), offset=1))
    assert first.tolist() == [1.0, 3.0]
    assert handles.view(ref(1, sizes=(2,), strides=(2,), offset=1)) is first


def test_a_view_shares_its_storage():
    handles = holding_one()
    handles.view(ref(1, sizes=(2,), offset=2)).fill_(7.0)
    assert handles.get(1).anchor.tolist() == [0.0, 0.0, 7.0, 7.0]


def test_a_view_under_another_dtype_reads_the_same_bytes():
    handles = table()
    handles.add(1, torch.tensor([1.0, -2.0]))
    as_ints = handles.view(ref(1, sizes=(2,), dtype=torch.int32))
    assert as_ints.tolist() == torch.tensor([1.0, -2.0]).view(torch.int32).tolist()


def test_a_view_past_the_end_of_its_storage_is_an_index_error():
    handles = holding_one()
    with fails(ErrorKind.INDEX, "view of 20 bytes is out of bounds for a storage of 16 bytes"):
        handles.view(ref(1, sizes=(5,)))


def test_a_negative_offset_is_an_index_error():
    handles = holding_one()
    with fails(ErrorKind.INDEX, "negative size, stride or offset"):
        handles.view(ref(1, offset=-1))


def test_a_view_of_an_unknown_handle_is_invalid():
    with fails(ErrorKind.INVALID_HANDLE, "no tensor with handle 9 here"):
        table().view(ref(9))


def test_the_views_kept_per_storage_are_bounded():
    handles = table()
    handles.add(1, torch.zeros(MAX_VIEWS_PER_STORAGE + 1))
    for offset in range(MAX_VIEWS_PER_STORAGE + 1):
        handles.view(ref(1, sizes=(1,), offset=offset))
    assert len(handles.get(1).views) <= MAX_VIEWS_PER_STORAGE


def test_release_frees_the_capacity_and_keeps_the_peak():
    handles = holding_one()
    handles.add(2, torch.zeros(2))
    handles.release(1)
    assert 1 not in handles
    stats = handles.stats
    assert (stats.bytes_in_use, stats.peak_bytes, stats.storages) == (8, 24, 1)


def test_release_of_an_unknown_handle_changes_nothing():
    handles = holding_one()
    for handle in (2, "1", None):
        handles.release(handle)
    assert (handles.bytes_in_use, len(handles)) == (16, 1)


def test_a_handle_registered_again_after_release_has_no_old_views():
    handles = holding_one()
    handles.view(ref(1))
    handles.release(1)
    handles.add(1, torch.zeros(2))
    with fails(ErrorKind.INDEX, "out of bounds for a storage of 8 bytes"):
        handles.view(ref(1))


def test_clear_releases_every_handle():
    handles = holding_one()
    handles.poison(2, "its op failed")
    handles.clear()
    assert (len(handles), handles.bytes_in_use, handles.stats.storages) == (0, 0, 0)
    assert handles.poisoned(2) is None


def test_the_quota_counts_the_live_storages():
    handles = table(quota_bytes=20)
    handles.add(1, torch.zeros(4))
    handles.check_quota(4)
    with fails(ErrorKind.OUT_OF_MEMORY, "24 bytes needed, quota is 20 bytes"):
        handles.check_quota(8)
    handles.release(1)
    handles.check_quota(20)


def test_a_view_of_a_poisoned_handle_says_why():
    handles = table()
    handles.poison(3, "aten.foo failed (RuntimeError: no)")
    with fails(ErrorKind.RUNTIME, r"input is unavailable: aten.foo failed \(RuntimeError: no\)"):
        handles.view(ref(3))


def test_registering_a_poisoned_handle_clears_the_poison():
    handles = table()
    handles.poison(3, "its op failed")
    handles.add(3, torch.zeros(4))
    assert handles.poisoned(3) is None


def test_release_clears_the_poison():
    handles = table()
    handles.poison(3, "its op failed")
    handles.release(3)
    with fails(ErrorKind.INVALID_HANDLE, "no tensor with handle 3 here"):
        handles.view(ref(3))


def test_a_live_handle_is_never_poisoned():
    handles = holding_one()
    handles.poison(1, "a later op failed")
    assert handles.poisoned(1) is None
    assert handles.view(ref(1)).tolist() == [0.0] * 4


def test_moving_the_storages_keeps_their_bytes_and_forgets_the_views():
    handles = table()
    handles.add(1, torch.arange(4.0))
    before = handles.view(ref(1))
    handles.move_to(CPU)
    after = handles.view(ref(1))
    assert after is not before and after.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert after.untyped_storage().data_ptr() != before.untyped_storage().data_ptr()


def test_forgetting_the_views_rebuilds_them_on_the_same_storage():
    handles = holding_one()
    before = handles.view(ref(1))
    handles.forget_views()
    after = handles.view(ref(1))
    assert after is not before
    assert after.untyped_storage().data_ptr() == before.untyped_storage().data_ptr()


def test_a_storage_resized_to_nothing_gives_its_memory_back_and_keeps_its_handle():
    handles = holding_one()
    handles.resize(1, 0)
    assert 1 in handles and handles.get(1).capacity == 0
    assert handles.bytes_in_use == 0 and handles.stats.storages == 1
    with fails(ErrorKind.INDEX, "out of bounds for a storage of 0 bytes"):
        handles.view(ref(1))


def test_a_storage_resized_back_takes_its_memory_again_under_the_same_handle():
    handles = holding_one()
    handles.resize(1, 0)
    handles.resize(1, 16)
    handles.view(ref(1)).copy_(torch.arange(4.0))
    assert handles.view(ref(1)).tolist() == [0.0, 1.0, 2.0, 3.0]
    assert handles.bytes_in_use == 16 and handles.stats.peak_bytes == 16


def test_a_resized_storage_keeps_the_bytes_both_sizes_hold():
    handles = table()
    handles.add(1, torch.arange(4.0))
    handles.resize(1, 24)
    assert handles.view(ref(1)).tolist() == [0.0, 1.0, 2.0, 3.0]
    handles.resize(1, 8)
    assert handles.view(ref(1, sizes=(2,))).tolist() == [0.0, 1.0]


def test_a_storage_growing_past_the_quota_is_refused_and_keeps_its_size():
    handles = table(quota_bytes=32)
    handles.add(1, torch.arange(4.0))
    with fails(ErrorKind.OUT_OF_MEMORY, "quota exceeded: 48 bytes needed"):
        handles.resize(1, 48)
    assert handles.get(1).capacity == 16 and handles.bytes_in_use == 16
    assert handles.view(ref(1)).tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize(
    ("handle", "nbytes", "kind", "match"),
    [
        (2, 16, ErrorKind.INVALID_HANDLE, "no tensor with handle 2"),
        (1, -1, ErrorKind.VALUE, "cannot resize a storage to -1 bytes"),
    ],
    ids=["unknown-handle", "negative-size"],
)
def test_a_resize_the_table_cannot_do_is_refused(handle, nbytes, kind, match):
    handles = holding_one()
    with fails(kind, match):
        handles.resize(handle, nbytes)
    assert handles.bytes_in_use == 16


def restored(handles: HandleTable, handle: int, start: int, piece: bytes) -> None:
    anchor = handles.restore_target(handle, torch.uint8, 4, start)
    raw_bytes(anchor, start, len(piece)).copy_(
        torch.frombuffer(bytearray(piece), dtype=torch.uint8)
    )
    handles.restored(handle, start + len(piece))


def test_a_restore_takes_its_pieces_in_order():
    handles = table()
    handles.add(1, torch.zeros(4, dtype=torch.uint8))
    restored(handles, 1, 0, b"\x01\x02")
    restored(handles, 1, 2, b"\x03\x04")
    assert handles.get(1).anchor.tolist() == [1, 2, 3, 4]


@pytest.mark.parametrize(
    ("first_piece", "refusal"),
    [
        pytest.param(b"\x01", "starts at byte 1, not 2", id="out-of-order"),
        pytest.param(b"\x01\x02\x03\x04", "storage 1 is not being restored", id="storage-full"),
    ],
)
def test_a_restore_piece_that_does_not_continue_the_restore_is_refused(first_piece, refusal):
    handles = table()
    handles.add(1, torch.zeros(4, dtype=torch.uint8))
    restored(handles, 1, 0, first_piece)
    with fails(ErrorKind.PROTOCOL_ERROR, refusal):
        handles.restore_target(1, torch.uint8, 4, 2)


def test_a_restore_piece_must_match_its_storage():
    handles = table()
    handles.add(1, torch.zeros(4, dtype=torch.uint8))
    with fails(ErrorKind.VALUE, "holds 4 bytes of torch.uint8, not 4 bytes of torch.int8"):
        handles.restore_target(1, torch.int8, 4, 0)


def test_a_restore_piece_needs_its_storage():
    with fails(ErrorKind.INVALID_HANDLE, "storage 1 must start at byte 0"):
        table().restore_target(1, torch.uint8, 4, 2)
