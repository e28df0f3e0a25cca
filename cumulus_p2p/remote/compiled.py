"""Compiled steps: ``torch.compile`` of code on cumulus tensors sends each graph once.

Theory of operation
-------------------
``device.register()`` routes ``torch.compile`` through ``compile_routing``. A compiled
module or function whose parameters or arguments are on cumulus is run by a
``CompiledCode`` instead of dynamo; everything else compiles exactly as before.

On each call, ``CompiledCode`` builds a *guard key* from what decides the graphs: grad
mode, the module's training flag, the autocast dtype, every input tensor's dtype, shape,
strides, offset and ``requires_grad``, and the non-tensor arguments. The first call with
a key captures the code (``capture.py``: AOTAutograd over fake stand-ins) into a forward
and a backward aten graph. Each graph becomes a ``CompiledGraph``: its wire definition,
sent once per session as ``@graph``, and an output plan, read from the captured tensors'
metadata. A call of the graph is then one ``@run`` record: inputs by reference, and a
handle for each output that needs memory. Outputs that view an input are built on the
input's storage; outputs sharing a storage share a handle; values only the backward graph
reads stay wire references (``Saved``), not tensors. The executor runs the graph
(``graphs.py``).

``_CompiledStep`` is the autograd function between the two: forward runs the forward
graph and keeps its saved values; backward runs the backward graph on them. A steady
training step therefore costs two records, whatever the depth of the model.

Inputs the code writes to (BatchNorm's running statistics) are written back on the
executor: the graph's first outputs are their new values, and its definition says which
input each one replaces. Code that cannot be captured (data-dependent control flow,
``.item()`` in the forward, more than ``MAX_CAPTURES`` signatures) runs eagerly with a
one-line warning, and gives the same results. A module's submodules then run as regions
of their own (``_Region``), each captured where it can be: the module's own code is the
graph break, and the rest stays compiled.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..wire.graph_def import GraphEncodingError, encode_graph
from ..wire.protocol import tensor_ext, tensor_layout
from .capture import Captured, CaptureError, capture
from .client import RemoteSession, current_session
from .tensor import RemoteStorage, RemoteTensor

#: Signatures one compiled callable captures before it runs eagerly (dynamo's default).
MAX_CAPTURES = 8
#: The autograd node that accumulates a leaf's gradient into its ``.grad``.
_ACCUMULATE_GRAD = torch._C._functions.AccumulateGrad

_warned: set[str] = set()


def warn_eager(reason: str, fullgraph: bool = False) -> None:
    """Say once per reason why code on cumulus runs eagerly under ``torch.compile``.

    Raises:
        torch._dynamo.exc.Unsupported: with ``fullgraph``, as torch raises for code
            compiled with ``fullgraph=True`` that cannot be one graph.
    """
    if fullgraph:
        from torch._dynamo.exc import Unsupported  # loaded by torch.compile already

        raise Unsupported(f"torch.compile(fullgraph=True) on cumulus: {reason}")
    if reason not in _warned:
        _warned.add(reason)
        message = f"torch.compile on cumulus: {reason}; this code runs eagerly (same results)"
        warnings.warn(message, UserWarning, stacklevel=4)


# --- graphs on the wire ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Output:
    """How the client builds one graph output: on an input's storage or a new one."""

    on_input: bool
    where: int  # the input's index, or the new storage's group
    dtype: torch.dtype
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int
    nbytes: int
    spec_tail: tuple  # sizes, strides, offset as the wire spec lists them
    layout: bytes  # the wire reference after its handle (``protocol.tensor_ext``)


class Saved:
    """A graph output only a later graph reads (a value saved for backward): its wire
    reference and its storage, kept alive while it is, without a tensor around it."""

    __slots__ = ("_rs", "ext")

    def __init__(self, storage: RemoteStorage, ext) -> None:
        self._rs = storage
        self.ext = ext

    def _wire(self):
        return self.ext


class CompiledGraph:
    """One captured aten graph: its wire definition and how to build its outputs."""

    def __init__(self, gm: torch.fx.GraphModule, mutated: tuple[int, ...] = ()) -> None:
        definition, inputs, outputs = encode_graph(gm)
        # The first outputs are the new values of the inputs the graph mutates: the
        # executor writes them back, and the client needs nothing of them.
        writes = [[k, i] for k, i in enumerate(mutated)]
        self.definition = [*definition, writes] if writes else definition
        self.outputs = [None] * len(writes) + _output_plan(inputs, outputs[len(writes) :])
        self.groups = len({o.where for o in self.outputs if o is not None and not o.on_input})
        self._ids: weakref.WeakKeyDictionary[RemoteSession, int] = weakref.WeakKeyDictionary()

    def call(self, inputs: list, tensors: int | None = None) -> list:
        """Queue one run of the graph on the current session; return its outputs.

        ``inputs`` are ``RemoteTensor`` or ``Saved``. The first ``tensors`` outputs (all
        by default) come back as ``RemoteTensor``; the rest as ``Saved``.
        """
        session = current_session()
        graph_id = self._ids.get(session)
        if graph_id is None:
            graph_id = self._ids[session] = session.define_graph(self.definition)
        tensors = len(self.outputs) if tensors is None else tensors
        storages: list[RemoteStorage | None] = [None] * self.groups
        results: list = []
        specs: list[list | None] = []
        for index, out in enumerate(self.outputs):
            if out is None:
                results.append(None)
                specs.append(None)
                continue
            if out.on_input:
                storage, spec = inputs[out.where]._rs, None
            else:
                storage = storages[out.where]
                if storage is None:
                    handle = session.new_handle()
                    storage = storages[out.where] = RemoteStorage(session, handle, out.nbytes)
                spec = [storage.handle, *out.spec_tail]
            if index < tensors:
                results.append(RemoteTensor(storage, out.dtype, out.sizes, out.strides, out.offset))
            else:
                results.append(Saved(storage, tensor_ext(storage.handle, out.layout)))
            specs.append(spec)
        session.submit(["@run", [graph_id, [t._wire() for t in inputs]], {}, specs])
        return results


def _output_plan(inputs: list, outputs: list) -> list[_Output | None]:
    """Where each output's storage comes from: an input's, or a new one per group."""
    by_storage = {_storage(v): i for i, v in enumerate(inputs) if isinstance(v, torch.Tensor)}
    groups: dict[Any, int] = {}
    plan: list[_Output | None] = []
    for value in outputs:
        if value is None:
            plan.append(None)
            continue
        if not isinstance(value, torch.Tensor):
            raise CaptureError(f"the graph returns a {type(value).__name__}, not a tensor")
        key = _storage(value)
        on_input = key in by_storage
        where = by_storage[key] if on_input else groups.setdefault(key, len(groups))
        sizes, strides = tuple(value.shape), tuple(value.stride())
        offset = value.storage_offset()
        nbytes = value.untyped_storage().nbytes()
        tail = (list(sizes), list(strides), offset)
        layout = tensor_layout(value.dtype, offset, sizes, strides)
        plan.append(
            _Output(on_input, where, value.dtype, sizes, strides, offset, nbytes, tail, layout)
        )
    return plan


def _storage(value: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(value.untyped_storage())


# --- the step -------------------------------------------------------------------------


class _Step:
    """A captured signature: its graphs and what the function's outputs look like."""

    def __init__(self, captured: Captured, out_spec: Any, constants: dict) -> None:
        self.forward = CompiledGraph(captured.forward, captured.mutated)
        self.backward = None if captured.backward is None else CompiledGraph(captured.backward)
        self.first = len(captured.mutated)  # the function's outputs follow the write-backs
        self.n_outputs = captured.n_outputs
        self.differentiable = captured.differentiable
        self.out_spec = out_spec
        self.constants = constants  # output leaves that are not tensors, by position

    def run(self, inputs: list[RemoteTensor]) -> tuple:
        if self.backward is None:
            return tuple(self.forward.call(inputs)[self.first : self.first + self.n_outputs])
        return _CompiledStep.apply(self, *inputs)


class _CompiledStep(torch.autograd.Function):
    """Forward graph on the way in, backward graph on the way back."""

    @staticmethod
    def forward(ctx, step: _Step, *inputs: RemoteTensor):  # noqa: D102
        first, end = step.first, step.first + step.n_outputs
        outputs = step.forward.call(list(inputs), end)
        ctx.step = step
        # The saved values are outputs of the graph that only the backward graph reads:
        # kept as wire references, not tensors, and dropped after backward.
        ctx.saved = outputs[end:]
        returned = outputs[first:end]
        fixed = [o for o, d in zip(returned, step.differentiable, strict=True) if not d]
        ctx.mark_non_differentiable(*fixed)
        return tuple(returned)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):  # noqa: D102
        step, saved = ctx.step, ctx.saved
        if saved is None:
            raise RuntimeError(
                "a compiled step on cumulus was differentiated twice (retain_graph): its "
                "saved values are gone; call this code without torch.compile"
            )
        ctx.saved = None
        tangents = [g for g, d in zip(grads, step.differentiable, strict=True) if d]
        results = step.backward.call([*saved, *tangents])
        return (None, *_accumulate_directly(ctx.next_functions, results))


def _accumulate_directly(edges: tuple, grads: list) -> list:
    """Store each leaf's new gradient as its ``.grad`` here; return what autograd still
    has to accumulate.

    Autograd would accumulate each into its leaf itself, with a ``detach`` of the new
    gradient, which on cumulus is a dispatch into Python (~11 µs; a model's parameters
    make this a third of a compiled backward). Done here only where it is the same thing:
    the leaf has no gradient yet and no hooks, the gradient has the leaf's layout (else
    autograd copies it into that layout), and this backward accumulates into that leaf
    (``torch.autograd.grad`` and ``backward(inputs=...)`` leave some alone).
    """
    out = []
    for (node, _), grad in zip(edges, grads, strict=True):
        if type(node) is _ACCUMULATE_GRAD and grad is not None:
            leaf = node.variable
            if (
                leaf.grad is None
                and not leaf._backward_hooks
                and not leaf._post_accumulate_grad_hooks
                and type(leaf) is RemoteTensor
                and leaf._sig == grad._sig
                and _accumulates_into(node)
            ):
                leaf.grad = grad
                grad = None
        out.append(grad)
    return out


def _accumulates_into(node) -> bool:
    """Whether the running backward pass will run the ``AccumulateGrad`` ``node``."""
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:  # raised for leaves under torch.autograd.grad, which fills no .grad
        return False


class CompiledCode:
    """What ``torch.compile`` returns for code on cumulus: captures per guard key, runs
    the step's graphs, or the eager code when capture is not possible."""

    def __init__(
        self,
        fn: Callable,
        module: torch.nn.Module | None,
        device_type: str,
        fullgraph: bool = False,
    ) -> None:
        self.fn = fn
        self.module = module
        self.device_type = device_type
        self.fullgraph = fullgraph  # code that cannot be captured raises instead of warning
        self._steps: dict[tuple, _Step | str] = {}
        self._known_state: tuple[list[str], list, list] | None = None
        self._regions: list[_Region] | None = None  # the submodules, when this one splits
        self.inside = False  # capturing the code, or running it eagerly

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        names, state = self._state()
        leaves, in_spec = tree_flatten((args, kwargs))
        tensors = [*state, *(x for x in leaves if isinstance(x, torch.Tensor))]
        if not all(type(t) is RemoteTensor for t in tensors):
            return self._eager(None, args, kwargs)  # mixed devices: it raises as usual
        try:
            key = self._key(leaves, tensors)
        except TypeError:
            return self._eager("an argument is neither a tensor nor hashable", args, kwargs)
        step = self._steps.get(key)
        if step is None:
            step = self._capture(key, names, leaves, in_spec, tensors)
        if isinstance(step, str):
            return self._eager(step, args, kwargs)
        return _assemble(step, step.run(tensors))

    def _eager(self, reason: str | None, args: tuple, kwargs: dict) -> Any:
        """Run the code eagerly (saying why, once). A module's submodules then run as
        regions of their own: each captured where it can be, as dynamo keeps compiling
        around a graph break."""
        regions: list[_Region] = []
        if reason is not None:
            if self.module is not None and not self.fullgraph:
                if self._regions is None:
                    self._regions = _regions(self.module, self.device_type)
                regions = self._regions
            split = "; its submodules are captured one by one" if regions else ""
            warn_eager(reason + split, self.fullgraph)
        self.inside = True
        try:
            with _installed(regions):
                return self.fn(*args, **kwargs)
        finally:
            self.inside = False

    def _state(self) -> tuple[list[str], list[torch.Tensor]]:
        """The module's parameters and buffers, by name (as ``named_parameters`` then
        ``named_buffers`` list them). Walking the module tree every call would cost more
        than the rest of the call; the last walk is reused while every entry it read is
        still in place."""
        if self.module is None:
            return [], []
        known = self._known_state
        if known is not None and all(slots.get(key) is t for slots, key, t in known[2]):
            return known[0], known[1]
        names: list[str] = []
        entries: list[tuple[dict, str, torch.Tensor]] = []
        seen: set[int] = set()
        for kind in ("_parameters", "_buffers"):
            for prefix, module in self.module.named_modules():
                slots = getattr(module, kind)
                for key, tensor in slots.items():
                    if tensor is None or id(tensor) in seen:
                        continue
                    seen.add(id(tensor))
                    names.append(f"{prefix}.{key}" if prefix else key)
                    entries.append((slots, key, tensor))
        self._known_state = (names, [t for _, _, t in entries], entries)
        return self._known_state[0], self._known_state[1]

    def _key(self, leaves: list, tensors: list) -> tuple:
        training = self.module.training if self.module is not None else None
        statics = tuple(x for x in leaves if not isinstance(x, torch.Tensor))
        hash(statics)
        layout = tuple((t._sig, t.requires_grad) for t in tensors)
        autocast = torch.is_autocast_enabled(self.device_type) and torch.get_autocast_dtype(
            self.device_type
        )
        return (torch.is_grad_enabled(), training, autocast, statics, layout)

    def _capture(self, key: tuple, names: list[str], leaves: list, in_spec, tensors) -> _Step | str:
        if len(self._steps) >= MAX_CAPTURES:
            return f"more than {MAX_CAPTURES} input signatures (shapes, dtypes, modes)"
        outputs: dict[str, Any] = {}
        functional = self._functional(names, leaves, in_spec, outputs)
        self.inside = True
        try:
            captured = capture(functional, tensors)
            step: _Step | str = _Step(captured, outputs["spec"], outputs["constants"])
        except (CaptureError, GraphEncodingError) as exc:
            step = str(exc)
        finally:
            self.inside = False
        self._steps[key] = step
        return step

    def _functional(self, names: list[str], leaves: list, in_spec, outputs: dict) -> Callable:
        """The code as a function of its input tensors alone, returning a tuple of tensors."""
        n_state = len(names)
        positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]

        def functional(*tensors: torch.Tensor) -> tuple:
            filled = list(leaves)
            for i, t in zip(positions, tensors[n_state:], strict=True):
                filled[i] = t
            args, kwargs = tree_unflatten(filled, in_spec)
            if self.module is None:
                result = self.fn(*args, **kwargs)
            else:
                state = dict(zip(names, tensors[:n_state], strict=True))
                result = torch.func.functional_call(self.module, state, args, kwargs)
            out_leaves, outputs["spec"] = tree_flatten(result)
            outputs["constants"] = {
                i: x for i, x in enumerate(out_leaves) if not isinstance(x, torch.Tensor)
            }
            return tuple(x for x in out_leaves if isinstance(x, torch.Tensor))

        return functional


class _Region:
    """A submodule's ``forward`` while its parent runs eagerly: the submodule's own
    ``CompiledCode``, except while that code is capturing it or running it eagerly."""

    def __init__(self, module: torch.nn.Module, device_type: str) -> None:
        self.module = module
        self.original = module.forward
        self.code = CompiledCode(module, module, device_type)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.code.inside:
            return self.original(*args, **kwargs)
        return self.code(*args, **kwargs)


def _regions(module: torch.nn.Module, device_type: str) -> list[_Region]:
    """A region per submodule the module calls: its children, and the children of the
    containers (``ModuleList``, ``ModuleDict``) it only iterates."""
    regions = []
    for child in module.children():
        if type(child).forward is torch.nn.Module.forward:  # a container: never called
            regions += _regions(child, device_type)
        else:
            regions.append(_Region(child, device_type))
    return regions


@contextmanager
def _installed(regions: list[_Region]):
    """Each region in place of its submodule's ``forward`` while inside."""
    saved = [region.module.__dict__.get("forward") for region in regions]
    for region in regions:
        region.module.forward = region
    try:
        yield
    finally:
        for region, before in zip(regions, saved, strict=True):
            if before is None:
                del region.module.forward  # back to the class's
            else:
                region.module.forward = before


def _assemble(step: _Step, tensors: tuple) -> Any:
    it = iter(tensors)
    count = len(tensors) + len(step.constants)
    leaves = [step.constants[i] if i in step.constants else next(it) for i in range(count)]
    return tree_unflatten(leaves, step.out_spec)
