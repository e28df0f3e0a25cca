"""The native C++ ``cumulus`` device: geometry, local views, and the records it appends.

The device only records in this slice, so each test checks what the batch holds,
decoded by ``cumulus_p2p.native.records``. The device needs its own process
(``cumulus_p2p.testing.native_process``); tests that need the built extension skip only
where no compiler exists to build it.
"""

from __future__ import annotations

import struct

import pytest
import torch
import torch.nn.functional as F

from cumulus_p2p import native
from cumulus_p2p._errors import MalformedMessageError
from cumulus_p2p.native import records
from cumulus_p2p.native.records import Alloc, Free, HostTensor, Op, Readback, TensorRef, Upload
from cumulus_p2p.testing.native_process import in_native_process

pytestmark = pytest.mark.usefixtures("native_child")


def _take() -> list:
    """The records appended since the last take, decoded."""
    ext = native.load()
    data, count = ext.take_batch()
    decoded = records.decode(data, ext.op_names())
    assert len(decoded) == count
    return decoded


def _ops(decoded: list) -> list[Op]:
    return [r for r in decoded if isinstance(r, Op)]


def _ref(t: torch.Tensor) -> TensorRef:
    return TensorRef(
        native.load().handle(t),
        t.storage_offset(),
        str(t.dtype).removeprefix("torch."),
        tuple(t.shape),
        t.stride(),
    )


# ---- geometry -----------------------------------------------------------------------


@pytest.mark.native
@in_native_process
def test_factories_give_the_requested_geometry():
    _take()
    x = torch.empty(3, 4, device="cumulus")
    s = torch.empty_strided((2, 3), (1, 2), dtype=torch.float16, device="cumulus")
    z = torch.zeros(5, dtype=torch.int64, device="cumulus")
    assert (x.shape, x.stride(), x.dtype, str(x.device)) == (
        (3, 4),
        (4, 1),
        torch.float32,
        "cumulus:0",
    )
    assert (s.shape, s.stride(), s.dtype) == ((2, 3), (1, 2), torch.float16)
    assert (z.shape, z.dtype, z.is_cumulus) == ((5,), torch.int64, True)
    decoded = _take()
    allocs = [r for r in decoded if isinstance(r, Alloc)]
    assert [a.nbytes for a in allocs] == [48, 12, 40]
    assert [op.op for op in _ops(decoded)] == ["aten::zero_"]


@pytest.mark.native
@in_native_process
def test_views_transposes_and_detach_append_nothing():
    x = torch.empty(4, 6, device="cumulus")
    cpu = torch.empty(4, 6)
    _take()
    views = {
        "t": lambda t: t.t(),
        "transpose": lambda t: t.transpose(0, 1),
        "view": lambda t: t.view(2, 12),
        "reshape": lambda t: t.reshape(24),
        "detach": lambda t: t.detach(),
        "expand": lambda t: t[:1].expand(3, 6),
        "permute": lambda t: t.permute(1, 0),
        "select": lambda t: t[2],
        "slice": lambda t: t[1:3, ::2],
        "unsqueeze": lambda t: t.unsqueeze(0),
        "as_strided": lambda t: t.as_strided((2, 2), (1, 6), 3),
    }
    for name, view in views.items():
        got, want = view(x), view(cpu)
        assert (got.shape, got.stride(), got.storage_offset()) == (
            want.shape,
            want.stride(),
            want.storage_offset(),
        ), name
        assert native.load().handle(got) == native.load().handle(x), name
    assert _take() == []


# ---- ops ----------------------------------------------------------------------------


@pytest.mark.native
@in_native_process
def test_add_appends_one_op_whose_output_has_the_meta_shape():
    a = torch.empty(3, 1, device="cumulus")
    b = torch.empty(1, 4, device="cumulus")
    _take()
    c = a + b
    want = torch.empty(3, 1, device="meta") + torch.empty(1, 4, device="meta")
    assert (c.shape, c.stride()) == (want.shape, want.stride())
    (op,) = _take()
    assert op.op == "aten::add.Tensor"
    assert op.args == (_ref(a), _ref(b), 1)
    assert op.outs == (_ref(c),)


@pytest.mark.native
@in_native_process
def test_mm_output_is_a_new_storage_with_the_meta_shape():
    a = torch.empty(3, 4, device="cumulus")
    b = torch.empty(4, 5, device="cumulus").t().contiguous().t()
    _take()
    c = torch.mm(a, b)
    (op,) = _ops(_take())
    assert op.op == "aten::mm"
    assert op.outs == (_ref(c),)
    assert (c.shape, c.stride()) == ((3, 5), (5, 1))
    assert op.outs[0].handle not in {_ref(a).handle, _ref(b).handle}


@pytest.mark.native
@in_native_process
def test_an_in_place_op_records_its_argument_as_its_output():
    x = torch.empty(2, 3, device="cumulus")
    _take()
    y = x.mul_(2.0)
    (op,) = _take()
    assert y is x
    assert op.op == "aten::mul_.Tensor"
    assert op.outs == (_ref(x),)


@pytest.mark.native
@in_native_process
def test_an_in_place_foreach_op_is_one_record_over_its_lists():
    params = [torch.empty(n, device="cumulus") for n in (3, 4, 5)]
    grads = [torch.empty(n, device="cumulus") for n in (3, 4, 5)]
    _take()
    with torch.no_grad():
        torch._foreach_add_(params, grads, alpha=0.5)
    (op,) = _ops(_take())
    assert op.op == "aten::_foreach_add_.List"
    assert op.args == (tuple(map(_ref, params)), tuple(map(_ref, grads)), 0.5)
    assert op.outs == ()


@pytest.mark.native
@in_native_process
def test_an_out_of_place_foreach_op_is_one_record_shaped_as_each_elements_op():
    lists = [[torch.empty(n, device="cumulus") for n in (3, 4, 5)] for _ in range(2)]
    cpu = [[torch.empty(n) for n in (3, 4, 5)] for _ in range(2)]
    calls = {
        "aten::_foreach_sqrt": lambda a, b: torch._foreach_sqrt(a),
        "aten::_foreach_add.List": lambda a, b: torch._foreach_add(a, b, alpha=0.5),
        "aten::_foreach_mul.Scalar": lambda a, b: torch._foreach_mul(a, 2.0),
        "aten::_foreach_div.ScalarList": lambda a, b: torch._foreach_div(a, [1.0, 2.0, 3.0]),
        "aten::_foreach_addcdiv.Scalar": lambda a, b: torch._foreach_addcdiv(a, a, b, 0.1),
        "aten::_foreach_norm.Scalar": lambda a, b: torch._foreach_norm(a),
    }
    _take()
    for name, call in calls.items():
        with torch.no_grad():
            outs = call(*lists)
        (op,) = _ops(_take())
        assert op.op == name
        assert op.outs == (tuple(map(_ref, outs)),)
        assert _shapes(outs) == _shapes(call(*cpu)), name


@pytest.mark.native
@in_native_process
def test_a_foreach_op_on_integers_promotes_each_element_as_its_own_op_would():
    ints = [torch.ones(n, dtype=torch.int64, device="cumulus") for n in (2, 3)]
    _take()
    outs = torch._foreach_mul(ints, 0.5) + torch._foreach_sqrt(ints)
    assert [t.dtype for t in outs] == [torch.get_default_dtype()] * 4
    assert len(_ops(_take())) == 2


@pytest.mark.native
@in_native_process
def test_histogramdd_records_its_edges_and_histogram_shaped_by_the_bins():
    samples = torch.empty(10, 3, device="cumulus")
    _take()
    hist, edges = torch.histogramdd(samples, bins=[2, 3, 4])
    ops = _ops(_take())
    assert [op.op for op in ops] == [
        "aten::_histogramdd_bin_edges",
        "aten::_histogramdd_from_bin_cts",
    ]
    assert hist.shape == (2, 3, 4)
    assert [tuple(e.shape) for e in edges] == [(3,), (4,), (5,)]


@pytest.mark.native
@in_native_process
def test_histogramdd_with_a_bin_count_per_dimension_missing_says_so_as_on_a_cpu():
    message = "size of bins must be equal to the innermost dimension"
    # Zeros, not empty memory: a NaN found there fails the range check first.
    x = torch.zeros(10, 3, device="cumulus")
    with pytest.raises(RuntimeError, match=message):
        torch.histogramdd(torch.zeros(10, 3), bins=[2, 3])
    _take()
    with pytest.raises(RuntimeError, match=message):
        torch.histogramdd(x, bins=[2, 3])
    assert _ops(_take()) == []


@pytest.mark.native
@in_native_process
def test_host_bytes_travel_in_the_upload_record():
    host = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    _take()
    x = host.to("cumulus")
    decoded = _take()
    uploads = [r for r in decoded if isinstance(r, Upload)]
    assert [u.dst for u in uploads] == [_ref(x)]
    assert uploads[0].src == HostTensor("float32", (2, 3), host.numpy().tobytes())


@pytest.mark.native
@in_native_process
def test_reading_back_records_the_request_and_asks_the_hook():
    ext = native.load()
    x = torch.empty(2, device="cumulus")
    _take()
    with pytest.raises(RuntimeError, match="needs an executor"):
        x.cpu()
    assert _take() == [Readback(_ref(x))]
    seen = []

    def fill(src, dst):
        seen.append(src.shape)
        dst.fill_(7.0)

    ext.set_readback_hook(fill)
    try:
        assert x.cpu().tolist() == [7.0, 7.0]
        assert x.sum().item() == 7.0
    finally:
        ext.set_readback_hook(None)
    assert seen == [(2,), ()]


@pytest.mark.native
@in_native_process
def test_a_storage_is_freed_when_its_last_tensor_dies():
    x = torch.empty(8, device="cumulus")
    view = x[2:]
    handle = native.load().handle(x)
    _take()
    del x
    assert _take() == []
    del view
    assert _take() == [Free(handle)]


@pytest.mark.native
@in_native_process
def test_memory_allocated_counts_live_storages_as_they_grow_and_die():
    cumulus = torch.cumulus
    before = cumulus.memory_allocated()
    cumulus.reset_peak_memory_stats()
    x = torch.empty(1000, device="cumulus")
    assert cumulus.memory_allocated() == before + 4000
    x.resize_(3000)  # the storage grows in place, keeping its handle
    assert cumulus.memory_allocated() == before + 12000
    y = x[:10].clone()
    assert cumulus.memory_allocated() == before + 12040
    del x, y
    assert cumulus.memory_allocated() == before
    assert cumulus.max_memory_allocated() == before + 12040
    _take()


@pytest.mark.native
@in_native_process
def test_a_batchs_growth_is_the_peak_of_its_storages_over_the_last_batchs_end():
    ext = native.load()
    _take()
    ext.take_growth()
    kept = torch.empty(1000, device="cumulus")
    passing = torch.empty(3000, device="cumulus")
    del passing  # freed within the batch: the executor still holds it for a while
    assert ext.take_growth() == 16000
    grown = torch.empty(500, device="cumulus")
    del kept
    assert ext.take_growth() == 2000  # 6000 live at the peak, over 4000 at the last take
    assert ext.take_growth() == 0
    del grown
    _take()


@pytest.mark.native
@in_native_process
def test_set_to_a_host_storage_is_refused_with_what_to_do():
    x = torch.empty(0, device="cumulus")
    with pytest.raises(RuntimeError, match="set_ to a storage on cpu .copy it to the device"):
        x.set_(torch.UntypedStorage(16))
    _take()


def test_compiled_graphs_on_other_devices_still_go_to_the_backend_asked_for():
    from cumulus_p2p.native.compile import OnCumulus

    seen = []
    backend = OnCumulus(lambda gm, inputs: seen.append(inputs) or gm)
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    assert backend(gm, [torch.ones(2)]) is gm
    assert len(seen) == 1


# ---- a training step ----------------------------------------------------------------


def _meta_args(op: torch._ops.OpOverload, values: tuple) -> tuple[list, dict]:
    """Rebuild a record's arguments as meta tensors, positional and keyword per schema."""

    def rebuild(value):
        if isinstance(value, TensorRef):
            dtype = getattr(torch, value.dtype)
            return torch.empty_strided(value.sizes, value.strides, dtype=dtype, device="meta")
        if isinstance(value, HostTensor):
            return torch.empty(value.sizes, dtype=getattr(torch, value.dtype), device="meta")
        if isinstance(value, tuple):
            return [rebuild(v) for v in value]
        return value

    args, kwargs = [], {}
    for argument, value in zip(op._schema.arguments, values, strict=True):
        if argument.kwarg_only:
            kwargs[argument.name] = rebuild(value)
        else:
            args.append(rebuild(value))
    return args, kwargs


def _shapes(values) -> list:
    flat = []
    for value in values:
        if isinstance(value, TensorRef):
            flat.append((value.sizes, value.dtype))
        elif isinstance(value, torch.Tensor):
            flat.append((tuple(value.shape), str(value.dtype).removeprefix("torch.")))
        elif isinstance(value, (tuple, list)):
            flat.extend(_shapes(value))
    return flat


def _meta_outputs(op: Op):
    name, _, overload = op.op.removeprefix("aten::").partition(".")
    overload_packet = getattr(torch.ops.aten, name)
    func = getattr(overload_packet, overload or "default")
    args, kwargs = _meta_args(func, op.args)
    out = func(*args, **kwargs)
    return out if isinstance(out, (tuple, list)) else (out,)


@pytest.mark.native
@in_native_process
def test_a_transformer_training_step_records_ops_with_meta_shapes():
    from cumulus_p2p.testing.models import TinyTransformer

    torch.manual_seed(0)
    model = TinyTransformer(vocab=16, dim=8, heads=2, layers=2, ctx=4).to("cumulus")
    x = torch.randint(0, 16, (1, 4)).to("cumulus")
    y = torch.randint(0, 16, (4,)).to("cumulus")
    opt = torch.optim.Adam(model.parameters(), foreach=True)
    _take()
    loss = F.cross_entropy(model(x).reshape(-1, 16), y)
    loss.backward()
    opt.step()
    assert loss.shape == () and loss.is_cumulus
    for param in model.parameters():
        assert param.grad.shape == param.shape and param.grad.is_cumulus
    ops = _ops(_take())
    assert len(ops) > 100
    names = {op.op for op in ops}
    # Adam's foreach ops are one record each, in place or not.
    optimizer = {
        "aten::_foreach_addcdiv_.ScalarList",
        "aten::_foreach_lerp_.Scalar",
        "aten::_foreach_sqrt",
    }
    assert {"aten::mm", "aten::native_layer_norm_backward", *optimizer} <= names
    assert not {"aten::addcdiv_", "aten::sqrt"} & names
    for op in ops:
        if op.op == "aten::copy_":
            continue  # device-to-device copies: the output is the destination
        assert _shapes(op.outs) == _shapes(_meta_outputs(op)), op.op


# ---- one owner per process ----------------------------------------------------------


@pytest.mark.native
@in_native_process
def test_the_wrapper_device_cannot_be_imported_beside_the_native_one():
    with pytest.raises(ImportError, match="owns the PrivateUse1 device"):
        import cumulus_p2p.remote  # noqa: F401


def test_the_native_device_refuses_a_process_with_the_wrapper_device():
    import cumulus_p2p.remote  # noqa: F401 - what the suite's conftest does anyway

    with pytest.raises(RuntimeError, match="cumulus_p2p.remote"):
        native.load()


# ---- the record decoder (no extension needed) ----------------------------------------


def _record(kind: int, body: bytes) -> bytes:
    return struct.pack("<BI", kind, len(body)) + body


def test_the_decoder_reads_each_record_kind():
    ref = struct.pack("<QqBB", 7, 2, 6, 1) + struct.pack("<qq", 3, 1)
    host = struct.pack("<BB", 4, 0) + struct.pack("<Q", 8) + struct.pack("<q", 5)
    op = struct.pack("<IH", 1, 3) + b"\x01" + ref + b"\x09" + struct.pack("<Iqq", 2, 4, 5)
    op += b"\x08" + struct.pack("<I", 2) + b"\x00\x05\x01" + struct.pack("<H", 1) + b"\x01" + ref
    batch = b"".join(
        [
            _record(1, op),
            _record(2, struct.pack("<QQ", 9, 64)),
            _record(3, b"\x01" + ref + b"\x02" + host),
            _record(4, b"\x01" + ref),
            _record(5, struct.pack("<Q", 9)),
            _record(9, b""),
            _record(10, struct.pack("<I", 2) + b"\x07\x08"),
        ]
    )
    want_ref = TensorRef(7, 2, "float32", (3,), (1,))
    assert records.decode(batch, ["aten::mm", "aten::add.Tensor"]) == [
        Op("aten::add.Tensor", (want_ref, (4, 5), (None, True)), (want_ref,)),
        Alloc(9, 64),
        Upload(want_ref, HostTensor("int64", (), struct.pack("<q", 5))),
        Readback(want_ref),
        Free(9),
        records.RngGet(),
        records.RngSet(b"\x07\x08"),
    ]


@pytest.mark.parametrize(
    "batch",
    [
        _record(5, b"\x01\x02"),
        _record(42, b""),
        _record(5, struct.pack("<Q", 1) + b"\x00"),
        _record(1, struct.pack("<IH", 5, 0) + struct.pack("<H", 0)),
        _record(4, b"\x0c"),
    ],
    ids=["truncated", "unknown kind", "stray bytes", "op not in the table", "unknown tag"],
)
def test_the_decoder_rejects_malformed_batches(batch):
    with pytest.raises(MalformedMessageError):
        records.decode(batch, ["aten::mm"])


@pytest.mark.native
@in_native_process
def test_moving_a_module_keeps_its_tied_weights_tied():
    from cumulus_p2p.testing.models import TinyTransformer

    model = TinyTransformer(vocab=16, dim=8, heads=2, layers=1, ctx=4).to("cumulus")
    assert model.head.weight is model.tok.weight
    assert model.tok.weight.is_cumulus
