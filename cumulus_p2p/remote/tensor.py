"""``RemoteTensor``: a tensor whose data lives on an executor, and how its ops are sent.

Theory of operation
-------------------
A ``RemoteTensor`` is a wrapper subclass with no local data: dtype, shape and strides are
real, the storage is a ``RemoteStorage`` (a handle in the session, shared by all views of
it, freed on the executor when the last view dies).

``__torch_dispatch__`` sees every aten op below autograd. For each op it builds a *plan*
once per signature (op, argument dtypes/shapes/strides, scalar arguments): it runs the op
on meta tensors to learn the outputs' metadata and reads the op's schema to learn which
outputs alias which inputs. Replaying a cached plan costs a dictionary lookup plus the
output wrappers, which is what keeps the per-op client cost low. Plans come in three kinds:

- *views only*: every output aliases an input (``view``, ``t``, ``detach``...). Nothing is
  sent; the executor rebuilds views from the references of later ops.
- *async*: outputs needing memory get fresh handles; the op is queued, not awaited.
- *sync*: the output depends on data (``nonzero``, ``item``, boolean masks) or has no
  meta kernel; the op is sent at once and the executor describes the outputs.

An op from outside aten (FSDP2's ``torch.ops.fsdp``, the functional collectives) is never
sent: the executor runs aten ops only, so its kernel for this device runs here and the
aten ops it calls come back as above (``_kernel_here_plan``).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import torch
from torch.optim import optimizer as _torch_optimizer
from torch.utils import _foreach_utils

from .._errors import SessionClosedError
from ..blobs.names import BLOB_MIN, MAX_HAVE, digest
from ..wire.ops import op_name, written_arguments
from ..wire.protocol import EXT_TENSOR, TensorRef, aligned_bytes, pack_tensor_ref, storage_extent
from .client import RemoteSession, current_session, device_session, stream_chunk
from .transfer import STREAM_CHUNK, pieces

#: Named by PrivateUse1's own name so it exists before ``device.register()``; torch calls
#: it ``cumulus:0`` from then on.
DEVICE = torch.device("privateuseone", 0)
_META = torch.device("meta")
_META_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.Meta)
_PRIVATEUSE1_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1)
_SCALARS = (int, float, bool, str, type(None), complex)
_MAX_PLANS = 50_000


class RemoteStorage:
    """One storage on the executor. Its death frees the remote memory."""

    __slots__ = ("handle", "nbytes", "session")

    def __init__(self, session: RemoteSession, handle: int, nbytes: int) -> None:
        self.session = session
        self.handle = handle
        self.nbytes = nbytes
        session.allocated(nbytes)

    def __del__(self) -> None:
        session = self.session
        if session is not None and not session.closed:
            session.free(self.handle, self.nbytes)

    def resize(self, tensor: RemoteTensor, nbytes: int) -> None:
        """Make this storage hold ``nbytes`` bytes on the executor, queued like an op: the
        bytes both sizes hold are kept, and 0 frees the remote memory while the handle,
        and every view of it, lives on (``HandleTable.resize``).

        ``tensor`` is one of its views: the record names the storage through it.
        """
        session = self.session
        if nbytes > self.nbytes:
            session.allocated(nbytes - self.nbytes)
        else:
            session.bytes_allocated -= self.nbytes - nbytes
        self.nbytes = nbytes
        session.submit(["@resize_storage", [tensor._wire(), nbytes], {}, None])


class RemoteTensor(torch.Tensor):
    """A tensor on the ``cumulus`` device. Create it through torch, never directly."""

    _rs: RemoteStorage
    _sig: tuple
    _ext: msgpack.ExtType | None  # the wire reference, built on first send

    # Skip the Python-level __torch_function__ layer: dispatch is all we need.
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, storage, dtype, sizes, strides, offset):  # noqa: D102
        t = torch.Tensor._make_wrapper_subclass(
            cls, sizes, strides=strides, storage_offset=offset, dtype=dtype,
            device=storage.session.device,
        )  # fmt: skip
        t._rs = storage
        t._sig = (dtype, sizes, strides, offset)
        t._ext = None
        return t

    def _wire(self) -> msgpack.ExtType:
        """This tensor's wire reference: built once per wrapper (``_restride`` drops it)."""
        ext = self._ext
        if ext is None:
            ext = self._ext = msgpack.ExtType(EXT_TENSOR, pack_tensor_ref(self._ref()))
        return ext

    def _restride(self, sizes, strides, offset) -> None:
        """Change this tensor's layout in place (``squeeze_``, ``t_``...), locally only."""
        torch.ops.aten.as_strided_.default.redispatch(
            _META_KEYS, self, list(sizes), list(strides), offset
        )
        self._sig = (self._sig[0], sizes, strides, offset)
        self._ext = None

    def _ref(self) -> TensorRef:
        dtype, sizes, strides, offset = self._sig
        return TensorRef(self._rs.handle, dtype, offset, sizes, strides)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        special = _SPECIAL.get(func)
        if special is not None:
            result = special(func, args, kwargs)
            if result is not NotImplemented:
                return result
        loose = _LOOSE.get(func)
        if loose is None:
            loose = _LOOSE[func] = _loose_arguments(func)
        if loose:
            key = (func, _loose_sig(args, kwargs, loose))
        else:
            key = (func, _sig(args), _sig(kwargs) if kwargs else ())
        plan = _PLANS.get(key)
        if plan is None:
            if len(_PLANS) > _MAX_PLANS:
                _PLANS.clear()
            plan = _PLANS[key] = _make_plan(func, args, kwargs)
            _PLANS_BUILT[0] += 1
        return plan(args, kwargs)

    # Declaring the flatten protocol makes torch treat this as a traceable wrapper
    # subclass, so ``Module._apply`` swaps each parameter in place instead of wrapping a
    # new one: a weight tied between two modules stays one object after ``.to("cumulus")``.
    def __tensor_flatten__(self):
        return [], self._sig

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        raise NotImplementedError(
            "torch.compile cannot trace cumulus tensors yet. It runs a compiled module or "
            "function eagerly when its parameters or arguments are on cumulus; this tensor "
            "reached the compiled code another way (a closure or a global): pass it as an "
            "argument, or call the code without torch.compile"
        )

    def __repr__(self, *, tensor_contents=None) -> str:
        body = repr(self.detach().cpu())[:-1]
        extras = [f"device='{self.device}'"]
        if self.grad_fn is not None:
            extras.append(f"grad_fn=<{type(self.grad_fn).__name__}>")
        elif self.requires_grad:
            extras.append("requires_grad=True")
        return f"{body}, {', '.join(extras)})"

    def tolist(self):
        return self.cpu().tolist()

    def __format__(self, spec: str) -> str:
        if self.dim() == 0:
            return self.item().__format__(spec)
        return self.__repr__().__format__(spec)

    def __reduce_ex__(self, protocol):
        # torch.save of a cumulus tensor writes an ordinary CPU tensor: a checkpoint must
        # load anywhere, with or without a session.
        return self.detach().cpu().__reduce_ex__(protocol)


_PLANS: dict[tuple, Callable] = {}
_LOOSE: dict = {}
_PLANS_BUILT = [0]
_VALUE_FREE_TYPES = {"float", "Scalar", "Optional[float]", "Optional[Scalar]", "List[number]"}


def plan_count() -> int:
    """Op plans built so far in this process (a steady training step should build none)."""
    return _PLANS_BUILT[0]


def _loose_arguments(func) -> frozenset:
    """Arguments whose *value* never changes an op's output metadata, only their type.

    A float or Scalar argument (``alpha``, ``value``, a dropout ``p``, Adam's step size)
    decides numbers, not shapes, and type promotion looks at its kind, not its value. Keying
    plans on their kind lets an optimizer with a changing step size reuse one plan; a list
    of Scalars (the foreach optimizers' per-parameter step sizes) is keyed by its items'
    kinds. Lists of floats (``scale_factors``) do shape outputs and stay keyed by value.
    """
    return frozenset(
        (i, arg.name)
        for i, arg in enumerate(func._schema.arguments)
        if str(arg.type) in _VALUE_FREE_TYPES
    )


def _loose_sig(args, kwargs, loose: frozenset) -> tuple:
    positions = {i for i, _ in loose}
    names = {name for _, name in loose}
    sig_args = tuple(
        _kind(a) if i in positions and type(a) is not RemoteTensor else _sig(a)
        for i, a in enumerate(args)
    )
    sig_kwargs = tuple(
        (k, _kind(v) if k in names and type(v) is not RemoteTensor else _sig(v))
        for k, v in kwargs.items()
    )
    return sig_args, sig_kwargs


def _kind(x: Any) -> tuple:
    """What of a value-free argument can change an op's outputs: its type (per item)."""
    t = type(x)
    if t is list or t is tuple:
        return (t, *map(type, x))
    return (t,)


def _sig(x: Any) -> Any:
    """A hashable signature of an argument: what decides the outputs' metadata."""
    t = type(x)
    if t is RemoteTensor:
        return x._sig
    if t in _SCALARS:
        return (t, x)
    if t is list or t is tuple:
        return tuple([_sig(v) for v in x])
    if t is dict:
        return tuple([(k, _sig(v)) for k, v in x.items()])
    if isinstance(x, torch.Tensor):
        return ("cpu", x.dtype, tuple(x.shape), x.dim() == 0)
    return x


# --- plans ----------------------------------------------------------------------------


class OutKind(enum.Enum):
    """How a plan produces one output of an op."""

    NEW = "new"  # fresh remote memory under a new handle
    VIEW = "view"  # a view of an argument's storage: nothing to send
    SAME = "same"  # the argument itself, written in place
    RESTRIDE = "restride"  # the argument itself, its layout changed in place (``t_``)
    NONE = "none"  # no tensor (an optional output left out)
    CONST = "const"  # an integer the meta kernel knew (a fused kernel's ``max_q``)


# Bound once: the hot path compares kinds by identity against module globals.
_NEW, _VIEW, _SAME, _RESTRIDE, _NONE, _CONST = OutKind
_SEND_NOTHING = frozenset((_VIEW, _SAME, _NONE, _CONST))


@dataclass(frozen=True, slots=True)
class _Out:
    """How to produce one output: fresh memory, a view of an argument, or the argument."""

    kind: OutKind
    arg: tuple | None  # where the aliased argument sits: (in_kwargs, key, list_index)
    dtype: torch.dtype | None = None
    sizes: tuple = ()
    strides: tuple = ()
    offset: int = 0
    nbytes: int = 0
    value: int = 0  # a CONST output's integer


#: Ops whose integer results are sizes their meta kernels compute from shapes alone (the
#: fused attention kernels' ``max_q``/``max_k``): planned like tensor-only ops, not synced.
_META_SIZED_INTS = {
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_cudnn_attention",
}


def _make_plan(func, args, kwargs) -> Callable:
    if func.namespace != "aten":
        return _kernel_here_plan(func)
    if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
        return _decomposed_plan(func)
    plan = _plan_outputs(func, args, kwargs)
    # The tensor lists it writes (``_foreach_add_``'s self), by position and name.
    written = [
        (i, a.name) for i, a in written_arguments(func) if isinstance(a.type, torch.ListType)
    ]
    return _bumping_versions(plan, written) if written else plan


def _decomposed_plan(func) -> Callable:
    """Run an op that autograd would have decomposed, decomposed.

    Such ops reach dispatch only below autograd (inside another op's handling here, or a
    library kernel run here). Their schemas may not say what they return: ``contiguous``
    and ``reshape`` claim to return a view of their argument, and return a copy when no
    view can do.
    """

    def run(args, kwargs):
        return func.decompose(*args, **kwargs)

    return run


def _kernel_here_plan(func) -> Callable:
    """Run an op from outside aten with its kernel for this device, here.

    The executor runs aten ops only (``wire/ops.py``). Libraries' own ops (FSDP2's
    ``torch.ops.fsdp``, the functional collectives of ``_c10d_functional``) come with a
    kernel for PrivateUse1, theirs or a CompositeExplicitAutograd one, written in aten ops
    and collectives: run here, each of those comes back to ``__torch_dispatch__`` as an
    aten op, or reaches the ``cumulus`` process group. ``wait_tensor`` waits on the
    group's work, complete as soon as queued (``distributed.py``): the session runs its
    ops in order.
    """
    name = func.name()
    if not torch._C._dispatch_has_computed_kernel_for_dispatch_key(name, "PrivateUse1"):
        raise NotImplementedError(
            f"{name} has no kernel for the cumulus device: the executor runs aten ops, and "
            "an op of another library runs here only through its kernel for PrivateUse1 "
            "(or a CompositeExplicitAutograd one)"
        )

    def run(args, kwargs):
        return func.redispatch(_PRIVATEUSE1_KEYS, *args, **kwargs)

    return run


def _bumping_versions(plan: Callable, written: list[tuple[int, str]]) -> Callable:
    """``plan``, then a version bump of every tensor in the lists the op writes.

    A single in-place op bumps its tensor's version below autograd, but torch leaves that
    to each backend's kernel for ops writing tensor lists (CUDA's foreach kernels do it):
    without it, autograd would not notice an optimizer step that changed a tensor saved
    for a backward still to run.
    """

    def run(args, kwargs):
        result = plan(args, kwargs)
        for position, name in written:
            tensors = args[position] if position < len(args) else kwargs.get(name)
            if tensors:
                torch.autograd.graph.increment_version(tensors)
        return result

    return run


def _plan_outputs(func, args, kwargs) -> Callable:
    schema = func._schema
    sized = schema.name in _META_SIZED_INTS
    if not sized and any(_non_tensor_return(r) for r in schema.returns):
        return _sync_plan(func)
    try:
        meta_out = func(*_to_meta(args), **_to_meta(kwargs))
    except Exception:  # no meta kernel, data-dependent shape: let the executor decide
        return _sync_plan(func)
    try:
        outs = _out_specs(schema, meta_out, args, kwargs)
    except _UnknownListAlias:  # the executor describes such outputs, as before lists planned
        return _sync_plan(func)
    shape = _structure(meta_out)
    name = op_name(func)
    if any(o.kind is _RESTRIDE for o in outs):
        return _restride_plan(outs, shape)
    if all(o.kind in _SEND_NOTHING for o in outs):
        mutates = any(o.kind is _SAME for o in outs) or _mutates(schema)
        if not mutates:
            return lambda a, k: shape([_build(o, a, k, None, None) for o in outs])
    return _async_plan(name, outs, shape)


def _restride_plan(outs, shape) -> Callable:
    def run(args, kwargs):
        results = []
        for out in outs:
            tensor = _argument(args, kwargs, out.arg)
            tensor._restride(out.sizes, out.strides, out.offset)
            results.append(tensor)
        return shape(results)

    return run


def _async_plan(name, outs, shape) -> Callable:
    def run(args, kwargs):
        session = _session_of(args, kwargs)
        wire: list = []
        results = [_build(o, args, kwargs, session, wire) for o in outs]
        session.submit([name, *wire_arguments(session, args, kwargs), wire])
        return shape(results)

    return run


def _sync_plan(func) -> Callable:
    name = op_name(func)

    def run(args, kwargs):
        session = _session_of(args, kwargs)
        first = session.new_dynamic_block()
        result = session.call([name, *wire_arguments(session, args, kwargs), ["dyn", first]])
        storages = _storages_by_handle(args, kwargs)
        return _from_description(result, session, storages)

    return run


def _session_of(args, kwargs) -> RemoteSession:
    """The session an op runs on: its first cumulus tensor's, as a CUDA op runs on its
    tensors' device; the current device's for an op without one."""
    for arg in args:
        if type(arg) is RemoteTensor:
            return _open(arg._rs.session)
        if (type(arg) is list or type(arg) is tuple) and arg and type(arg[0]) is RemoteTensor:
            return _open(arg[0]._rs.session)
    for arg in kwargs.values():
        if type(arg) is RemoteTensor:
            return _open(arg._rs.session)
    return current_session()


def _open(session: RemoteSession) -> RemoteSession:
    if session.closed:
        raise SessionClosedError(
            f"the session of this {session.device} tensor is closed: its memory is gone; "
            "attach a session and create the tensor again"
        )
    return session


def _build(out: _Out, args, kwargs, session, wire) -> Any:
    kind = out.kind
    if kind is _NONE:
        return None
    if kind is _CONST:
        return out.value
    if kind is _NEW:
        tensor, spec = fresh_tensor(
            session, out.dtype, out.sizes, out.strides, out.offset, nbytes=out.nbytes
        )
        wire.append(spec)
        return tensor
    base = _argument(args, kwargs, out.arg)
    if type(base) is not RemoteTensor:
        raise RuntimeError(
            "Expected all tensors to be on the same device, but found a "
            f"{base.device} tensor where a cumulus tensor was required"
        )
    if wire is not None:
        wire.append(None)
    if kind is _SAME:
        return base
    return RemoteTensor(base._rs, out.dtype, out.sizes, out.strides, out.offset)


def _argument(args, kwargs, where: tuple) -> Any:
    in_kwargs, key, index = where
    value = kwargs[key] if in_kwargs else args[key]
    return value if index is None else value[index]


def _out_specs(schema, meta_out, args, kwargs) -> list[_Out]:
    """Pair each meta output with its schema return: fresh memory or an alias of an arg."""
    specs: list[_Out] = []
    if len(schema.returns) == 1:
        leaves = [meta_out]
    else:
        leaves = list(meta_out) if schema.returns else []
    for ret, value in zip(schema.returns, leaves, strict=True):
        alias = ret.alias_info
        where = _alias_source(schema, alias, args) if alias is not None else None
        items = value if isinstance(value, (list, tuple)) else [value]
        for i, item in enumerate(items):
            if item is None:
                specs.append(_Out(_NONE, None))
                continue
            if type(item) is int:
                specs.append(_Out(_CONST, None, value=item))
                continue
            meta = (item.dtype, tuple(item.shape), tuple(item.stride()), item.storage_offset())
            if where is None:
                nbytes = storage_extent(meta[1], meta[2], meta[3]) * item.dtype.itemsize
                specs.append(_Out(_NEW, None, *meta, nbytes))
                continue
            sub = _list_item(where, i, args, kwargs) if isinstance(value, (list, tuple)) else where
            kind = _SAME if alias.is_write else _VIEW
            if kind is _SAME and _restrides(_argument(args, kwargs, sub), meta, schema.name):
                kind = _RESTRIDE
            specs.append(_Out(kind, sub, *meta))
    return specs


def _list_item(where: tuple, i: int, args, kwargs) -> tuple:
    """Where output ``i`` of a list return aliases: item ``i`` of a list argument
    (``_foreach_*_``), or the one tensor argument all items are views of (``split``)."""
    source = _argument(args, kwargs, where)
    return (*where[:2], i) if isinstance(source, (list, tuple)) else where


def _alias_source(schema, alias, args) -> tuple:
    # A list of views (``Tensor(a)[]``) shows no alias set on the list itself: its items
    # come from the argument written ``Tensor(a -> *)``.
    wanted = alias.before_set or {"*"}
    for i, arg in enumerate(schema.arguments):
        info = arg.alias_info
        if info is not None and (info.before_set if alias.before_set else info.after_set) & wanted:
            if i < len(args) and not arg.kwarg_only:
                return (False, i, None)
            return (True, arg.name, None)
    if not alias.before_set:
        raise _UnknownListAlias(schema.name)
    raise NotImplementedError(f"cumulus cannot tell which input {schema.name} aliases")


class _UnknownListAlias(Exception):
    """A list of views whose source argument the schema does not name with ``-> *``."""


#: In-place ops that only change a tensor's shape/strides: the executor need not hear of
#: them, since every later op names its tensors by layout anyway.
_RESTRIDE_OPS = {
    "aten::squeeze_",
    "aten::unsqueeze_",
    "aten::t_",
    "aten::transpose_",
    "aten::as_strided_",
    "aten::swapdims_",
    "aten::swapaxes_",
}


def _restrides(arg, meta, name) -> bool:
    """Whether an in-place op changes ``arg``'s layout; refuses layout changes we cannot mirror."""
    if not isinstance(arg, RemoteTensor) or arg._sig == meta:
        return False
    if name in _RESTRIDE_OPS:
        return True
    raise NotImplementedError(
        f"{name} changes the shape or strides of a tensor in place (resize or restride); "
        "the cumulus device does not support that yet. Use the out-of-place form."
    )


def _mutates(schema) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def _non_tensor_return(ret) -> bool:
    # Tensor lists (``split``, ``unbind``) have meta kernels like any op: planning them
    # keeps their views local instead of a round trip that stalls the pipeline.
    text = str(ret.type)
    return not (text.startswith("Tensor") or text in ("Optional[Tensor]", "List[Tensor]"))


def _structure(meta_out) -> Callable[[list], Any]:
    if meta_out is None:
        return lambda results: None
    if isinstance(meta_out, torch.Tensor):
        return lambda results: results[0]
    if isinstance(meta_out, list) and all(isinstance(m, torch.Tensor) for m in meta_out):
        return list
    if isinstance(meta_out, tuple) and all(isinstance(m, torch.Tensor) for m in meta_out):
        return tuple
    # A tuple holding lists (e.g. some foreach/ split ops): rebuild by lengths.
    lengths = [len(m) if isinstance(m, list) else None for m in meta_out]

    def rebuild(results: list) -> Any:
        out, pos = [], 0
        for n in lengths:
            if n is None:
                out.append(results[pos])
                pos += 1
            else:
                out.append(list(results[pos : pos + n]))
                pos += n
        return tuple(out)

    return rebuild


# --- arguments ------------------------------------------------------------------------


def _to_meta(x: Any) -> Any:
    t = type(x)
    if t is RemoteTensor:
        dtype, sizes, strides, offset = x._sig
        base = torch.empty(storage_extent(sizes, strides, offset), dtype=dtype, device=_META)
        return base.as_strided(sizes, strides, offset)
    if t is list or t is tuple:
        return t(_to_meta(v) for v in x)
    if t is dict:
        return {k: _to_meta(v) for k, v in x.items()}
    if isinstance(x, torch.Tensor):
        return x if x.dim() == 0 else x.to(_META)
    if t is torch.device and x.type == "cumulus":
        return _META
    return x


def wire_arguments(session: RemoteSession, args, kwargs) -> tuple[list, dict]:
    """An op's arguments as its queued record holds them: tensors by wire reference.

    A record must not hold tensor objects. ``Module._apply`` swaps a parameter's
    contents with another tensor's right after moving it (``swap_tensors``), and refuses
    while anything else holds a reference to it, as a queued view would through its base.
    A reference taken now also names the layout the op saw, whatever happens to the
    tensor before the batch leaves. CPU tensors become blobs of the batch.
    """
    return _to_wire(session, args), _to_wire(session, kwargs)


def _to_wire(session: RemoteSession, x: Any) -> Any:
    t = type(x)
    if t is RemoteTensor:
        if x._rs.session is not session:
            raise RuntimeError(
                "Expected all tensors to be on the same device, but found at least two "
                f"devices, {session.device} and {x.device}: move one with "
                f".to('{session.device}')"
            )
        return x._wire()
    if t is list or t is tuple:
        return [_to_wire(session, v) for v in x]
    if t is dict:
        return {k: _to_wire(session, v) for k, v in x.items()}
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise RuntimeError(f"cannot mix {x.device} and cumulus tensors in one op")
        return session.add_blob(x)
    return x


def _storages_by_handle(args, kwargs) -> dict[int, RemoteStorage]:
    found: dict[int, RemoteStorage] = {}
    _collect_storages(args, found)
    _collect_storages(kwargs, found)
    return found


def _collect_storages(x, found: dict[int, RemoteStorage]) -> None:
    # A module-level function, not a closure: a nested function that calls itself is a
    # reference cycle, which would keep ``found`` (and the op's result storages, added to it
    # later) alive until the garbage collector runs, and their remote memory with them.
    if type(x) is RemoteTensor:
        found[x._rs.handle] = x._rs
    elif isinstance(x, (list, tuple)):
        for v in x:
            _collect_storages(v, found)
    elif isinstance(x, dict):
        for v in x.values():
            _collect_storages(v, found)


def _from_description(value: Any, session: RemoteSession, storages: dict) -> Any:
    if isinstance(value, TensorRef):
        storage = storages.get(value.handle)
        if storage is None:
            nbytes = storage_extent(value.sizes, value.strides, value.offset) * value.dtype.itemsize
            storage = storages[value.handle] = RemoteStorage(session, value.handle, nbytes)
        return RemoteTensor(storage, value.dtype, value.sizes, value.strides, value.offset)
    if isinstance(value, list):
        return tuple(_from_description(v, session, storages) for v in value)
    return value


# --- ops with their own handling --------------------------------------------------------


def download(tensor: RemoteTensor) -> torch.Tensor:
    """Copy a remote tensor's data to a new contiguous CPU tensor (a sync point).

    A tensor larger than one piece (``transfer.py``) is read piece by piece straight into
    the result, so the client holds the result and one piece, never the tensor twice.
    """
    session = tensor._rs.session
    if tensor.numel() * tensor.element_size() > STREAM_CHUNK:
        return _download_in_pieces(session, tensor)
    data = session.fetch(tensor._ref())
    if len(data) == 0:
        return torch.empty(tensor.shape, dtype=tensor.dtype)
    flat = aligned_bytes(data).view(tensor.dtype)
    return flat.reshape(tensor.shape)


def _download_in_pieces(session: RemoteSession, tensor: RemoteTensor) -> torch.Tensor:
    dtype, sizes, strides, offset = tensor._sig
    out = torch.empty(sizes, dtype=dtype)
    budget = stream_chunk(session._channel)
    progress = session.progress("read", out.numel() * out.element_size())
    with session.streaming():
        for piece in pieces(sizes, strides, offset, dtype.itemsize, budget):
            ref = TensorRef(tensor._rs.handle, dtype, piece.offset, piece.sizes, piece.strides)
            data = session.fetch(ref)
            out[piece.index].copy_(aligned_bytes(data).view(dtype).reshape(piece.sizes))
            session.advance(progress, len(data))
            del data
    return out


def upload_into(dst: RemoteTensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for a large CPU ``src``: one ``copy_`` per piece, each its own
    frame, from the piece's own memory (``transfer.py``); to a host with a blob store, one
    ``@blob`` per piece instead (``_upload_named``).

    The first piece is a sync point, so a destination the executor could not allocate (over
    quota) fails before the rest is sent. Returns once every piece has left, so the caller
    may reuse ``src``. An upload that fills its whole storage also hands its bytes to the
    checkpoint store, so the next checkpoint need not read them back.
    """
    session = dst._rs.session
    src = src.detach().expand(dst.shape)
    dtype, sizes, strides, offset = dst._sig
    itemsize = max(dtype.itemsize, src.element_size())
    budget = stream_chunk(session._channel)
    plan = list(pieces(sizes, strides, offset, itemsize, budget))
    with session.streaming():  # one transfer for the checkpoint policy, the offer included
        if session.names_blobs:
            _upload_named(session, dst, src, plan)
        else:
            _upload_in_pieces(session, dst, src, plan)
        if _fills_its_storage(dst, src):
            session.offer_checkpoint_bytes(_contiguous_bytes(src))


def _fills_its_storage(dst: RemoteTensor, src: torch.Tensor) -> bool:
    """Whether ``src``'s bytes, in order, are now all of ``dst``'s storage."""
    return (
        src.dtype == dst.dtype
        and dst.is_contiguous()
        and dst.storage_offset() == 0
        and dst.numel() * dst.element_size() == dst._rs.nbytes
    )


def _upload_in_pieces(session: RemoteSession, dst: RemoteTensor, src: torch.Tensor, plan) -> None:
    dtype = dst.dtype
    progress = session.progress("upload", dst.numel() * dst.element_size())
    with session.streaming():
        for number, piece in enumerate(plan):
            target = RemoteTensor(dst._rs, dtype, piece.sizes, piece.strides, piece.offset)
            args = wire_arguments(session, [target, src[piece.index]], {})
            session.submit(["aten.copy_.default", *args, [None]])
            if number == 0:
                session.synchronize()
            else:
                session.flush()
            session.advance(progress, math.prod(piece.sizes) * dtype.itemsize)


def _upload_named(session: RemoteSession, dst: RemoteTensor, src: torch.Tensor, plan) -> None:
    """Upload by content: the host gets each piece's digest, and its bytes only when it
    does not hold them already (``blobs/names.py``).

    A tensor of one piece is queued like any op, its question asked with the rest of its
    batch (a model's hundreds of tensors cost a question per batch, not per tensor).
    Larger ones name all their pieces first and ask about them in one question.
    """
    dtype = dst.dtype
    if len(plan) == 1:
        session.upload(dst._wire(), src)
        return
    progress = session.progress("upload", dst.numel() * dst.element_size())
    with session.streaming():
        for start in range(0, len(plan), MAX_HAVE):
            group = plan[start : start + MAX_HAVE]
            names = [digest(_contiguous_bytes(src[p.index])) for p in group]
            held = session.have(names)
            for number, (piece, name, here) in enumerate(zip(group, names, held, strict=True)):
                target = RemoteTensor(dst._rs, dtype, piece.sizes, piece.strides, piece.offset)
                session.upload(target._wire(), src[piece.index], name=name, here=here)
                if start == number == 0:
                    session.synchronize()
                session.advance(progress, math.prod(piece.sizes) * dtype.itemsize)
        session.flush()


def _contiguous_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def streams_upload(dst: Any, src: Any) -> bool:
    """Whether ``dst.copy_(src)`` uploads from the CPU in pieces (more than one piece's
    worth), or by content (``BLOB_MIN`` or more of the same shape, to a host that keeps
    blobs)."""
    # A module's parameters reach here as themselves (``module.to`` copies each one).
    plain = type(src) is torch.Tensor or type(src) is torch.nn.Parameter
    if not (type(dst) is RemoteTensor and plain and src.device.type == "cpu"):
        return False
    nbytes = src.numel() * src.element_size()
    if nbytes > STREAM_CHUNK:
        return True
    return nbytes >= BLOB_MIN and src.shape == dst.shape and dst._rs.session.names_blobs


def _to_copy(func, args, kwargs):
    device = kwargs.get("device")
    if device is None:
        return NotImplemented
    device = torch.device(device)
    if device.type != "cpu":
        to = device_session(device)
        if to is args[0]._rs.session:
            return NotImplemented
        # A dtype or layout is changed on the source's host, before the bytes move.
        here = {k: v for k, v in kwargs.items() if k != "device"}
        return _moves().move(func(args[0], **here) if here else args[0], to)
    cpu = download(args[0])
    rest = {k: v for k, v in kwargs.items() if k in ("dtype", "memory_format")}
    return cpu.to(**rest) if rest else cpu


def _copy_(func, args, kwargs):
    dst, src = args[0], args[1]
    if type(dst) is RemoteTensor:
        if streams_upload(dst, src):
            upload_into(dst, src)
            return dst
        if type(src) is RemoteTensor and src._rs.session is not dst._rs.session:
            return dst.copy_(_moves().move(src, dst._rs.session), *args[2:], **kwargs)
        return NotImplemented
    dst.copy_(download(src), *args[2:], **kwargs)
    return dst


def _moves():
    # ``moves`` builds on this module: imported at first use, as ``distributed`` is.
    from . import moves

    return moves


_SPECIAL: dict = {
    torch.ops.aten._to_copy.default: _to_copy,
    torch.ops.aten.copy_.default: _copy_,
}


def fresh_tensor(
    session: RemoteSession, dtype, sizes, strides, offset: int, *, nbytes: int | None = None
) -> tuple[RemoteTensor, list]:
    """A tensor on new remote memory, and the output spec that names its handle on the wire."""
    if nbytes is None:
        nbytes = storage_extent(sizes, strides, offset) * dtype.itemsize
    handle = session.new_handle()
    tensor = RemoteTensor(RemoteStorage(session, handle, nbytes), dtype, sizes, strides, offset)
    return tensor, [handle, list(sizes), list(strides), offset]


def new_empty(
    sizes, strides, dtype: torch.dtype, session: RemoteSession | None = None
) -> RemoteTensor:
    """Allocate uninitialised remote memory (the device's ``empty_strided`` kernel), on
    ``session``'s device (the current one's by default)."""
    session = session if session is not None else current_session()
    tensor, spec = fresh_tensor(session, dtype, tuple(sizes), tuple(strides), 0)
    args = [list(sizes), list(strides)]
    session.submit(["aten.empty_strided.default", args, {"dtype": dtype, "device": DEVICE}, [spec]])
    return tensor


def contiguous_strides(sizes) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(sizes):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _admit_to_foreach_paths() -> None:
    """Let ``torch.optim``, ``clip_grad_norm_`` and friends take their foreach paths here.

    torch picks a multi-tensor (foreach) or fused kernel only for tensors whose exact type
    is on its lists, and a ``RemoteTensor`` is a subclass: without this, every optimizer
    falls back to its per-parameter loop on ``cumulus`` (3x the ops of a CUDA step) while
    the same code on CUDA takes foreach by default.
    """
    for admitted in (
        _torch_optimizer._foreach_supported_types,
        _foreach_utils._foreach_supported_types,
    ):
        if RemoteTensor not in admitted:
            admitted.append(RemoteTensor)


_admit_to_foreach_paths()
