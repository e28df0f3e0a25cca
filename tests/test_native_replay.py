"""The native executor's replay loop (``csrc/replay.cpp``): what it runs, what it refuses.

Batches are written with ``records.encode``, so that the tests can feed the executor
what the device never writes: forged handles, unknown ops, truncations, quota
overruns. The replay library registers nothing with the dispatcher, so these tests run
in the suite's own process.
"""

from __future__ import annotations

import dataclasses
import struct

import pytest
import torch

from cumulus_p2p.native.errors import ReplayError
from cumulus_p2p.native.records import (
    CONJ_BIT,
    NEG_BIT,
    Alloc,
    Dyn,
    Free,
    HostTensor,
    Op,
    Readback,
    Resize,
    RngGet,
    RngSet,
    Seed,
    TensorRef,
    Upload,
    encode,
)

pytestmark = pytest.mark.native


def _ref(handle: int, sizes=(2, 3), strides=None, offset=0, dtype="float32") -> TensorRef:
    if strides is None:
        strides, step = [], 1
        for size in reversed(sizes):
            strides.insert(0, step)
            step *= size
    return TensorRef(handle, offset, dtype, tuple(sizes), tuple(strides))


def _host(t: torch.Tensor) -> HostTensor:
    t = t.contiguous()
    return HostTensor(str(t.dtype).removeprefix("torch."), tuple(t.shape), t.numpy().tobytes())


def _floats(data: bytes, *shape: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.float32).reshape(shape)


class Session:
    """A replayer and the name table its batches were encoded against."""

    def __init__(self, quota_bytes: int = 1 << 20) -> None:
        from cumulus_p2p.native.executor import new_replayer

        self.replayer = new_replayer("cpu", quota_bytes)
        self.names: list[str] = []
        self._sent = 0

    def run(self, *records) -> list[bytes]:
        return self.run_bytes(encode(records, self.names))

    def run_bytes(self, batch: bytes) -> list[bytes]:
        new, self._sent = self.names[self._sent :], len(self.names)
        return self.replayer.replay(batch, new)

    def upload(self, handle: int, t: torch.Tensor) -> TensorRef:
        ref = _ref(handle, tuple(t.shape))
        self.run(Alloc(handle, t.nbytes), Upload(ref, _host(t)))
        return ref

    def read(self, ref: TensorRef) -> torch.Tensor:
        (data,) = self.run(Readback(ref))
        return _floats(data, *ref.sizes)


A = torch.arange(6, dtype=torch.float32).reshape(2, 3)
B = torch.full((2, 3), 0.5)


# ---- running ---------------------------------------------------------------------------


def test_ops_run_in_order_and_readbacks_come_back_in_batch_order():
    s = Session()
    a, b, c = s.upload(1, A), s.upload(2, B), _ref(3)
    first, second = s.run(
        Op("aten::add.Tensor", (a, b, 1), (c,)),
        Readback(c),
        Op("aten::mul_.Tensor", (c, b), (c,)),
        Readback(c),
    )
    assert torch.equal(_floats(first, 2, 3), A + B)
    assert torch.equal(_floats(second, 2, 3), (A + B) * B)
    assert s.replayer.handles() == [1, 2, 3]
    assert s.replayer.ops_run == 2


def test_arguments_are_views_built_from_the_references_geometry():
    s = Session()
    s.upload(1, torch.arange(12, dtype=torch.float32))
    transposed = _ref(1, sizes=(3, 2), strides=(1, 3), offset=1)  # a[1:7].view(2, 3).t()
    out = _ref(2, sizes=(3, 2))
    s.run(Op("aten::clone", (transposed, None), (out,)))
    assert torch.equal(s.read(out), torch.arange(12.0)[1:7].view(2, 3).t())
    assert s.read(_ref(1, sizes=(12,))).tolist() == list(range(12))


def test_none_where_the_schema_wants_a_tensor_reaches_the_op_as_an_undefined_one():
    # As autograd calls backward kernels: here batch norm's reserve space, which the
    # native path never uses.
    gen = torch.Generator().manual_seed(0)
    x, grad = torch.randn(8, 4, generator=gen), torch.randn(8, 4, generator=gen)
    _, mean, invstd = torch.native_batch_norm(x, None, None, None, None, True, 0.1, 1e-5)
    expected = torch.ops.aten.native_batch_norm_backward(
        grad, x, None, None, None, mean, invstd, True, 1e-5, [True, False, False]
    )[0]
    s = Session()
    refs = [s.upload(h, t) for h, t in enumerate((x, grad, mean, invstd), start=1)]
    args = (0, *refs[:2], None, None, None, *refs[2:], True, 1e-5, [True, False, False], None)
    out = _ref(5, sizes=(8, 4))
    s.run(Op("aten::_batch_norm_impl_index_backward", args, (out, None, None)))
    assert torch.equal(s.read(out), expected)


def test_an_output_that_aliases_an_input_gets_a_storage_of_its_own():
    s = Session()
    a = s.upload(1, A)
    s.run(Op("aten::alias", (a,), (_ref(2),)))  # declared as a new storage
    s.run(Op("aten::zero_", (a,), (a,)))
    assert torch.equal(s.read(_ref(2)), A)  # the client's picture: two storages


def test_a_negated_reference_is_viewed_negated_by_ops_and_readbacks():
    s = Session()
    s.upload(1, A)
    negated, out = dataclasses.replace(_ref(1), bits=NEG_BIT), _ref(2)
    s.run(Op("aten::clone", (negated, None), (out,)))
    assert torch.equal(s.read(out), -A)
    assert torch.equal(s.read(negated), -A)


def test_a_conjugated_reference_reads_back_conjugated():
    s = Session()
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    ref = _ref(1, sizes=(2,), dtype="complex64")
    s.run(Alloc(1, z.nbytes), Upload(ref, _host(z)))
    (data,) = s.run(Readback(dataclasses.replace(ref, bits=CONJ_BIT)))
    assert torch.equal(torch.frombuffer(bytearray(data), dtype=torch.complex64), z.conj())


def test_unknown_tensor_bits_are_malformed():
    s = Session()
    s.upload(1, A)
    with pytest.raises(ReplayError, match="unknown tensor bits 4"):
        s.run(Readback(dataclasses.replace(_ref(1), bits=4)))


def test_an_op_only_running_can_shape_binds_its_results_and_describes_them():
    s = Session()
    s.upload(1, torch.tensor([0.0, 2.0, 0.0, 3.0]).reshape(2, 2))
    values = _ref(1, sizes=(2, 2))
    (answer,) = s.run(Dyn("aten::nonzero", (values,), (7,)))
    tag, dtype, ndim = struct.unpack_from("<BBB", answer)
    sizes = struct.unpack_from(f"<{ndim}q", answer, 3)
    assert (tag, dtype, ndim, sizes) == (1, 4, 2, (2, 2))  # a tensor: int64, 2 x 2
    assert 7 in s.replayer.handles()
    (data,) = s.run(Readback(_ref(7, sizes=(2, 2), dtype="int64")))
    assert torch.frombuffer(bytearray(data), dtype=torch.int64).tolist() == [0, 1, 1, 1]


def test_an_op_only_running_can_shape_may_not_reuse_a_live_handle():
    s = Session()
    s.upload(1, A)
    with pytest.raises(ReplayError, match="handle 1 is already in use"):
        s.run(Dyn("aten::nonzero", (_ref(1),), (1,)))


def test_free_and_resize_keep_the_byte_count_true():
    s = Session()
    s.upload(1, A)
    assert s.replayer.live_bytes == 24
    s.run(Resize(1, 48))
    assert s.replayer.live_bytes == 48
    assert torch.equal(s.read(_ref(1)), A)  # grown in place, contents kept
    s.run(Free(1))
    assert (s.replayer.live_bytes, s.replayer.handles()) == (0, [])


def test_unset_generators_draw_from_the_sessions_generator():
    s = Session()
    x = _ref(1, sizes=(1000,))
    s.run(Alloc(1, 4000), Op("aten::uniform_", (x, 0.0, 1.0, None), (x,)))
    values = s.read(x)
    assert 0.0 <= values.min() and values.max() <= 1.0 and values.std() > 0.1


def test_the_generators_state_reads_back_and_a_set_state_replays_the_same_draws():
    s = Session()
    x = _ref(1, sizes=(8,))
    draw = Op("aten::uniform_", (x, 0.0, 1.0, None), (x,))
    (state,) = s.run(Alloc(1, 32), Seed(7), RngGet())
    assert state == torch.Generator().manual_seed(7).get_state().numpy().tobytes()
    s.run(draw)
    first = s.read(x)
    s.run(RngSet(state), draw)
    assert torch.equal(s.read(x), first)


def test_a_generator_state_that_is_not_one_is_malformed():
    with pytest.raises(ReplayError, match="not a generator state") as error:
        Session().run(RngSet(b"\x01\x02\x03"))
    assert error.value.kind == "malformed"


def test_a_seed_starts_the_sessions_generator_over():
    s = Session()
    x = _ref(1, sizes=(8,))
    draw = Op("aten::uniform_", (x, 0.0, 1.0, None), (x,))
    s.run(Alloc(1, 32), Seed(7), draw)
    first = s.read(x)
    s.run(Seed(7), draw)
    assert torch.equal(s.read(x), first)
    torch.manual_seed(7)
    assert torch.equal(first, torch.empty(8).uniform_(0.0, 1.0))


# ---- refusing --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tail, why",
    [
        (encode([Alloc(2, 24)], [])[:-3], "record 1: body of 16 bytes truncated to 13"),
        (b"\x02\x00", "record 1: truncated header"),
        (b"\x2a\x00\x00\x00\x00", "record 1: unknown kind 42"),
    ],
    ids=["truncated body", "truncated header", "unknown kind"],
)
def test_a_batch_whose_framing_is_broken_runs_nothing(tail, why):
    s = Session()
    with pytest.raises(ReplayError, match=why) as error:
        s.run_bytes(encode([Alloc(1, 24)], s.names) + tail)
    assert (error.value.kind, error.value.record) == ("malformed", 1)
    assert s.replayer.handles() == []


@pytest.mark.parametrize(
    "body, why",
    [
        (b"\x02\x08\x00\x00\x00" + b"\x01" * 8, "truncated"),  # ALLOC missing its nbytes
        (b"\x05\x09\x00\x00\x00" + b"\x01" + b"\x00" * 8, "1 stray bytes"),  # FREE 1, + 1
        (b"\x04\x01\x00\x00\x00\x0e", "value tag 14"),
        (b"\x01\x06\x00\x00\x00\x07\x00\x00\x00\x00\x00", "op index 7"),
    ],
    ids=["truncated body", "stray bytes", "unknown tag", "op not in the table"],
)
def test_a_malformed_record_is_named_and_the_records_before_it_stay_applied(body, why):
    s = Session()
    before = encode([Alloc(1, 8)], s.names)
    with pytest.raises(ReplayError, match=why) as error:
        s.run_bytes(before + body + encode([Alloc(2, 8)], s.names))
    assert (error.value.kind, error.value.record) == ("malformed", 1)
    assert s.replayer.handles() == [1]


def test_an_unknown_handle_fails_the_op_and_registers_none_of_its_outputs():
    s = Session()
    a = s.upload(1, A)
    with pytest.raises(ReplayError, match=r"record 0 \(op aten::add.Tensor\).*handle 9") as error:
        s.run(Op("aten::add.Tensor", (a, _ref(9), 1), (_ref(3),)))
    assert error.value.kind == "unknown_handle"
    assert s.replayer.handles() == [1]
    with pytest.raises(ReplayError, match="no storage with handle 9"):
        s.run(Free(9))


def test_a_view_beyond_its_storage_is_refused():
    s = Session()
    s.upload(1, A)
    with pytest.raises(ReplayError, match="a view of 28 bytes of storage 1, which holds 24"):
        s.run(Readback(_ref(1, offset=1)))
    with pytest.raises(ReplayError, match="negative"):
        s.run(Readback(_ref(1, strides=(-3, 1))))


@pytest.mark.parametrize(
    "name, why",
    [
        ("prims::add", "is not an aten op"),
        ("aten::from_file", "not allowed on an executor"),
        ("aten::set_.source_Storage", "not allowed on an executor"),
        ("aten::no_such_op", "no aten op named"),
        ("aten::add.NoSuchOverload", "no aten op named"),
    ],
)
def test_only_aten_ops_outside_the_blocklist_run(name, why):
    s = Session()
    with pytest.raises(ReplayError, match=why) as error:
        s.run(Op(name, (), ()))
    assert error.value.kind == "unknown_op"


def test_an_op_that_raises_registers_none_of_its_outputs():
    s = Session()
    a = s.upload(1, A)
    with pytest.raises(ReplayError, match=r"aten::mm.*mat1 and mat2 shapes") as error:
        s.run(Op("aten::mm", (a, a), (_ref(2, sizes=(2, 2)),)))
    assert error.value.kind == "op_failed"
    assert s.replayer.handles() == [1]


def test_the_wrong_argument_count_is_malformed():
    s = Session()
    a = s.upload(1, A)
    with pytest.raises(ReplayError, match="2 arguments where the schema has 3"):
        s.run(Op("aten::add.Tensor", (a, a), (_ref(2),)))


def test_a_host_tensor_whose_bytes_do_not_fit_its_shape_is_malformed():
    s = Session()
    s.run(Alloc(1, 24))
    with pytest.raises(ReplayError, match="20 bytes where its shape needs 24"):
        s.run(Upload(_ref(1), HostTensor("float32", (2, 3), b"\x00" * 20)))


def test_a_handle_cannot_be_allocated_twice():
    s = Session()
    s.run(Alloc(1, 8))
    with pytest.raises(ReplayError, match="already in use"):
        s.run(Alloc(1, 8))
    assert s.replayer.live_bytes == 8


# ---- the quota -------------------------------------------------------------------------


def test_the_quota_refuses_allocations_resizes_and_op_outputs_that_exceed_it():
    s = Session(quota_bytes=64)
    a = s.upload(1, A)  # 24 bytes
    with pytest.raises(ReplayError, match="needs 48 more bytes; the session holds 24") as error:
        s.run(Alloc(2, 48))
    assert error.value.kind == "out_of_memory"
    with pytest.raises(ReplayError, match="out_of_memory|needs 48 more"):
        s.run(Resize(1, 72))
    big = _ref(2, sizes=(4, 3))
    with pytest.raises(ReplayError, match="needs 48 more bytes") as error:
        s.run(Op("aten::cat", ((a, a), 0), (big,)))
    assert error.value.kind == "out_of_memory"
    assert (s.replayer.live_bytes, s.replayer.handles()) == (24, [1])
    s.run(Op("aten::add.Tensor", (a, a, 1), (_ref(2),)))  # 24 more still fits
    assert s.replayer.live_bytes == 48


def test_a_restore_naming_a_live_handle_makes_none_of_its_storages():
    from cumulus_p2p.native.executor import ReplaySession

    session = Session()
    session.upload(2, A)
    replaying = ReplaySession(session.replayer)
    with pytest.raises(ReplayError):
        replaying.open_restore([(1, 8, ["aa" * 32]), (2, 8, ["bb" * 32])])
    assert session.replayer.handles() == [2]
    assert torch.equal(session.read(_ref(2)), A)


def test_a_restores_pieces_land_in_its_storages_once_checked():
    from cumulus_p2p._errors import BlobMismatchError
    from cumulus_p2p.blobs.names import digest
    from cumulus_p2p.native.executor import ReplaySession

    session = Session()
    data = A.numpy().tobytes()
    targets = ReplaySession(session.replayer).open_restore([(1, len(data), [digest(data)])])
    with pytest.raises(BlobMismatchError):
        targets.put(digest(data), memoryview(bytes(len(data))))  # not the named bytes
    targets.put(digest(data), memoryview(bytearray(data)))
    assert targets.missing() == []
    assert torch.equal(session.read(_ref(1)), A)
