"""``torch.compile`` on the native device: dynamo captures, each graph goes to the host whole.

Theory of operation
-------------------
Dynamo traces code on ``cumulus`` tensors as on any other device (the device is a real
PrivateUse1 backend whose kernels shape outputs on meta), but inductor has no code
generator for it. So once the device is loaded, ``torch.compile``'s default backend
becomes ``OnCumulus``: graphs on other devices go to inductor as before, and a graph
with ``cumulus`` tensors goes through AOT autograd, which splits it into a forward and a
backward aten graph over fake tensors. Each of those becomes a ``ShippedGraph``:

- its definition (``wire/graph_def.py``, the Python device's format) is sent once per
  session as a GRAPH record, and kept, so that a session that moves to another host
  sends it there again (``NativeSession.graphs``);
- each call is one RUN record: the inputs by reference, and a new storage for each
  output, laid out as the capture said. An output that is an input's storage (a value
  saved for backward is often a parameter) is a view of that input instead, made here.

The executor runs the graph with the host's ``--graph-compiler`` (``host/graphs.py``,
``graph_compiler.py``). A steady training step then costs the client two records
(forward and backward) plus AOT autograd's own bookkeeping, whatever the model's depth.
AOT autograd's runtime keeps what it keeps on other backends: the graphs are
functional, and inputs the code mutates (BatchNorm's running statistics) are written
back by ordinary ``copy_`` ops after the call.

A graph with symbolic sizes (dynamo makes sizes symbolic once it sees them change, as
with a shorter last batch or a new sequence length) cannot be shipped as captured: the
host runs fixed sizes, and the client must know each output's size before the host
answers. So each call's concrete sizes get a graph of their own (``PerShape``), traced
once from the symbolic one on fake tensors and shipped as any other: a run of steps at
one sequence length costs one definition and then a record a call, as with static sizes.
Past ``MAX_SHAPES`` sizes a graph runs op by op.

A graph that cannot travel as data (a node that is not an aten op) runs its aten ops one
by one as eager ones are, with a one-line warning; the results are the same.
"""

from __future__ import annotations

import functools
import itertools
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..wire.graph_def import GraphEncodingError, encode_graph, pack_definition
from . import NAME

#: Said once per reason, the first time a graph on the device cannot be shipped whole.
EAGER_WARNING = "torch.compile on the native cumulus device: a graph runs op by op on the host"

_ids = itertools.count(1)
#: Every graph's definition by id, for a session that sends them to a new host.
DEFINITIONS: dict[int, bytes] = {}
_warned: set[str] = set()


class OnCumulus:
    """A dynamo backend: AOT autograd with graphs shipped whole for a graph with
    ``cumulus`` tensors, ``other`` (inductor, with the caller's mode and options) for the
    rest."""

    def __init__(self, other: Any) -> None:
        self.other = other

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        if not _on_cumulus(gm, example_inputs):
            return self.other(gm, example_inputs)
        from torch._dynamo.backends.common import aot_autograd

        return aot_autograd(fw_compiler=ship)(gm, example_inputs)

    def __getattr__(self, name: str) -> Any:
        # torch.compile asks its backend for inductor's config and the like.
        return getattr(self.other, name)


def ship(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
    """AOT autograd's compiler for each graph: a ``ShippedGraph``, or the graph's own
    code (op by op) when it cannot travel."""
    if _symbolic(gm):
        return PerShape(gm)
    try:
        return ShippedGraph(gm)
    except GraphEncodingError as exc:
        return _op_by_op(gm, str(exc))


def _op_by_op(gm: torch.fx.GraphModule, reason: str) -> Any:
    """The graph's own code, its ops recorded one by one; ``reason`` said once."""
    from torch._functorch.aot_autograd import make_boxed_func

    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"{EAGER_WARNING}: {reason}", UserWarning, stacklevel=3)
    return make_boxed_func(gm.forward)


@dataclass(frozen=True, slots=True)
class _OnInput:
    """An output over input ``index``'s storage: a view of it, made on the client."""

    index: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int


class ShippedGraph:
    """One captured aten graph: sent once per session, then run by one record per call
    (AOT autograd's boxed calling convention: a list of inputs, which it empties)."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        # On the instance: the wrappers AOT autograd puts around a backward copy __dict__.
        self._boxed_call = True
        definition, inputs, outputs = encode_graph(gm)
        if not all(isinstance(v, torch.Tensor) for v in inputs):
            raise GraphEncodingError("the graph takes a symbolic size or another non-tensor")
        self.id = next(_ids)
        self.definition = pack_definition(definition)
        DEFINITIONS[self.id] = self.definition
        by_storage = {StorageWeakRef(v.untyped_storage()): i for i, v in enumerate(inputs)}
        self._plan = [_planned(value, by_storage) for value in outputs]
        self._layouts = [p if isinstance(p, torch.Tensor) else None for p in self._plan]

    def __call__(self, args: list) -> list:
        from . import load
        from .session import current

        ext = load()
        session = current()
        if session is None or self.id not in session.graphs:
            ext.define_graph(self.id, self.definition)
            if session is not None:
                session.graphs.add(self.id)
        outputs = ext.run_graph(self.id, args, self._layouts)
        for index, plan in enumerate(self._plan):
            if isinstance(plan, _OnInput):
                outputs[index] = args[plan.index].as_strided(plan.sizes, plan.strides, plan.offset)
        args.clear()
        return outputs


#: The most concrete shapes one symbolic graph is traced for; past them it runs op by op
#: (a host keeps 256 graphs per session).
MAX_SHAPES = 16


class PerShape:
    """A graph with symbolic sizes, run as one ``ShippedGraph`` per concrete shape: each
    traced on the first call with that shape, from the symbolic graph with the call's
    sizes, on fake tensors (nothing is recorded or sent while tracing)."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self._boxed_call = True
        self.gm = gm
        self.shapes: dict[tuple, _AtShape] = {}
        #: Why the graph cannot travel at any shape (a node that is not an aten op).
        self.untraceable: str | None = None

    def __call__(self, args: list) -> list:
        key = tuple(_shape(a) for a in args)
        at = self.shapes.get(key)
        if at is None:
            if self.untraceable is None and len(self.shapes) < MAX_SHAPES:
                try:
                    at = self.shapes[key] = _AtShape.traced(self.gm, args)
                except GraphEncodingError as exc:
                    self.untraceable = str(exc)
                except Exception as exc:  # noqa: BLE001 - any tracing failure: op by op
                    # (fake tensors lack a kernel, a size check fails): the graph's own
                    # code still runs, as it did before shapes were traced.
                    self.untraceable = f"tracing it at new sizes failed: {exc!r}"
            if at is None:
                reason = self.untraceable or f"more than {MAX_SHAPES} shapes of one graph"
                return _op_by_op(self.gm, reason)(args)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        args.clear()
        return at(tensors)


@dataclass(frozen=True, slots=True)
class _AtShape:
    """A symbolic graph at one shape: a shipped graph over its tensors, and the outputs
    that became constants (sizes AOT autograd saves for the backward)."""

    graph: ShippedGraph
    constants: dict[int, Any]
    n_outputs: int

    @classmethod
    def traced(cls, gm: torch.fx.GraphModule, args: list) -> _AtShape:
        """``gm`` with the sizes of ``args``: its tensors become the inputs, anything else
        (a size dynamo made an input) a constant."""
        from torch.fx.experimental.proxy_tensor import make_fx

        where = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        constants: dict[int, Any] = {}
        n_outputs = 0

        def at_these_sizes(*tensors: torch.Tensor) -> list:
            nonlocal n_outputs
            full = list(args)
            for i, t in zip(where, tensors, strict=True):
                full[i] = t
            outputs = gm(*full)
            n_outputs = len(outputs)
            constants.update({i: v for i, v in enumerate(outputs) if not _travels(v)})
            return [v for v in outputs if _travels(v)]

        traced = make_fx(at_these_sizes, tracing_mode="fake")(*(args[i] for i in where))
        return cls(ShippedGraph(_without_detach(traced)), constants, n_outputs)

    def __call__(self, tensors: list) -> list:
        shipped = iter(self.graph(tensors))
        return [
            self.constants[i] if i in self.constants else next(shipped)
            for i in range(self.n_outputs)
        ]


def _without_detach(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` with its ``detach`` nodes replaced by their inputs. Tracing adds one per
    input that requires grad (a quarter of a small model's forward graph); on the host,
    which runs the graph without autograd, each would only be a view to make."""
    for node in list(gm.graph.find_nodes(op="call_function", target=torch.ops.aten.detach.default)):
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
    gm.recompile()
    return gm


def _travels(value: Any) -> bool:
    return value is None or isinstance(value, torch.Tensor)


def _shape(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.stride(), value.storage_offset())
    return value


def _symbolic(gm: torch.fx.GraphModule) -> bool:
    """Whether any of the graph's inputs is a symbolic size or has one."""
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return True
        if isinstance(value, torch.Tensor) and not all(
            isinstance(n, int) for n in (*value.shape, *value.stride(), value.storage_offset())
        ):
            return True
    return False


def _planned(value: Any, by_storage: dict) -> torch.Tensor | _OnInput | None:
    """How the client makes one output: a meta tensor laid out as captured (a new
    storage), a view of the input whose storage it is (``by_storage``), or nothing."""
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        raise GraphEncodingError(f"the graph returns a {type(value).__name__}, not a tensor")
    sizes, strides = tuple(value.shape), tuple(value.stride())
    index = by_storage.get(StorageWeakRef(value.untyped_storage()))
    if index is not None:
        return _OnInput(index, sizes, strides, value.storage_offset())
    return torch.empty_strided(sizes, strides, dtype=value.dtype, device="meta")


def _on_cumulus(gm: torch.fx.GraphModule, example_inputs: list) -> bool:
    tensors = [t for t in example_inputs if isinstance(t, torch.Tensor)]
    tensors += list(gm.parameters()) + list(gm.buffers())
    return any(t.device.type == NAME for t in tensors)


def patch_torch_compile() -> None:
    """Make ``torch.compile``'s default (inductor) backend ``OnCumulus`` (idempotent)."""
    original = torch.compile
    if getattr(original, "_cumulus_native", False):
        return

    @functools.wraps(original)
    def compile_on_cumulus(model: Any = None, **kwargs: Any) -> Any:
        if kwargs.get("backend") in (None, "inductor"):
            mode, options = kwargs.pop("mode", None), kwargs.pop("options", None)
            inductor = torch._TorchCompileInductorWrapper(mode, options, kwargs.get("dynamic"))
            kwargs["backend"] = OnCumulus(inductor)
        return original(model, **kwargs)

    compile_on_cumulus._cumulus_native = True  # type: ignore[attr-defined]
    torch.compile = compile_on_cumulus
