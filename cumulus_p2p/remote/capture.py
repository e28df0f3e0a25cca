"""Capture a function of tensors as aten graphs, on fake stand-ins, with AOTAutograd.

A compiled step on cumulus never traces the remote tensors themselves: each input gets a
*stand-in*, a fake tensor (``FakeTensorMode``: metadata, no data) on the same cumulus
device with the same dtype, shape, strides, storage offset and ``requires_grad``, and
AOTAutograd (``aot_function``) traces the function over the stand-ins. Being on the
device, they pass through its own kernels as remote tensors do: autocast's casts and the
attention kernel the executor picks end up in the graph. The forward graph, and in
training the backward graph, are recorded instead of compiled; a fake backward pass is run
at once so the backward graph exists before the first real call. ``compiled.py`` turns the
recorded graphs into wire definitions.

What the capture refuses, and why (each becomes an eager run with a warning):

- a graph that changes an input's metadata, mutates an input that requires grad, or
  returns outputs AOTAutograd adds for aliasing: the forward would not be a plain
  (new values of mutated inputs + user outputs + saved values) graph. Data mutations of
  other inputs (BatchNorm's running statistics) are captured: their new values are the
  forward's first outputs, and the executor writes them back;
- anything that needs data (``.item()``, data-dependent shapes): fakes have none.

``capture_in_place`` is the second way, for code that only updates its inputs (an
optimizer step): the aten ops are recorded as they run, in-place ops included, with no
functionalization and no autograd. The graph then writes the inputs' memory as the eager
code would, with no copies of them and no write-backs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ..wire.ops import written_arguments
from ..wire.protocol import storage_extent


class CaptureError(Exception):
    """The function cannot run as a compiled step; the message says why."""


@dataclass(frozen=True, slots=True)
class Captured:
    """The graphs of one function at one input signature.

    Attributes:
        forward: The forward (or inference) aten graph. Its outputs are the function's
            outputs, then (training only) the values the backward graph needs.
        backward: The backward graph, or None for inference. Its inputs are the saved
            values, then one gradient per differentiable output; its outputs are one
            gradient (or None) per forward input.
        n_outputs: How many of the forward graph's outputs the function returns (after
            the mutated inputs' new values).
        differentiable: Per function output, whether a gradient flows back through it.
        mutated: The inputs the function writes to, in order: the forward graph's first
            outputs are their new values.
    """

    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule | None
    n_outputs: int
    differentiable: tuple[bool, ...]
    mutated: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class InPlaceGraph:
    """A graph that updates its inputs: ``written`` are the ones it writes to."""

    graph: torch.fx.GraphModule
    written: tuple[int, ...]


def stand_in(tensor: torch.Tensor, mode: FakeTensorMode) -> torch.Tensor:
    """A fake tensor of ``mode`` on ``tensor``'s device, laid out like it (storage offset
    too), with the same ``requires_grad``.

    Its device is the real one, so the device's own kernels trace as they run: autocast's
    casts (``autocast.py``) and the attention kernel the executor picks (``kernels.py``).
    The offset matters: an output that views an input is described by its offset into
    the input's storage, and the client builds it on the real input's storage.
    """
    size, stride, offset = tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset()
    with mode:
        base = torch.empty(
            storage_extent(size, stride, offset), dtype=tensor.dtype, device=tensor.device
        )
        fake = base.as_strided(size, stride, offset).detach()
    return fake.requires_grad_(tensor.requires_grad)


def capture(fn: Callable[..., tuple[torch.Tensor, ...]], inputs: list[torch.Tensor]) -> Captured:
    """Trace ``fn(*inputs)``, which returns a tuple of tensors, into aten graphs.

    Raises:
        CaptureError: the function cannot be captured (with the reason).
    """
    # Imported here: AOTAutograd takes about a second to import (sympy and more), which
    # every consumer process would pay at start whether it compiles anything or not.
    from torch._functorch.aot_autograd import aot_function, make_boxed_func
    from torch._functorch.partitioners import default_partition

    graphs: dict[str, torch.fx.GraphModule] = {}
    partition: dict[str, int] = {}

    def record(kind: str, gm: torch.fx.GraphModule, example_inputs) -> Callable:
        # The partitioner can leave a forward node in the backward graph with its result
        # unused; run as is, the executor would compute it again for nothing.
        gm.graph.eliminate_dead_code(is_impure_node=_kept)
        gm.recompile()
        graphs[kind] = gm
        return make_boxed_func(gm.forward)

    def partition_fn(joint, joint_inputs, *, num_fwd_outputs, **kwargs):
        partition["num_fwd_outputs"] = num_fwd_outputs
        return default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)

    traced = aot_function(
        fn,
        fw_compiler=functools.partial(record, "forward"),
        bw_compiler=functools.partial(record, "backward"),
        inference_compiler=functools.partial(record, "forward"),
        partition_fn=partition_fn,
    )
    mode = FakeTensorMode()
    stand_ins = [stand_in(t, mode) for t in inputs]
    versions = [t._version for t in stand_ins]
    try:
        # Factories in the code or its backward (``torch.arange(n, device=x.device)``)
        # name the real device: with the fake mode active they make fakes, not remote ops.
        with mode:
            outputs = traced(*stand_ins)
            # AOTAutograd writes a mutated input's new value back into the stand-in.
            mutated = tuple(i for i, t in enumerate(stand_ins) if t._version != versions[i])
            differentiable = tuple(o.requires_grad for o in outputs)
            if any(differentiable):
                needed = [o for o in outputs if o.requires_grad]
                torch.autograd.backward(needed, [torch.ones_like(o) for o in needed])
    except Exception as exc:  # torch raises many types while tracing; all mean "cannot"
        raise CaptureError(f"{type(exc).__name__}: {_first_line(exc)}") from exc
    if any(stand_ins[i].requires_grad for i in mutated):
        raise CaptureError("the code writes in place to a tensor that requires grad")
    return _checked(graphs, partition, len(outputs), differentiable, mutated)


def capture_in_place(fn: Callable[..., object], inputs: list[torch.Tensor]) -> InPlaceGraph:
    """Trace ``fn(*inputs)``, which updates its inputs in place, into one aten graph.

    Raises:
        CaptureError: the function cannot be captured (with the reason).
    """
    from torch.fx.experimental.proxy_tensor import make_fx

    mode = FakeTensorMode()
    stand_ins = [stand_in(t, mode).requires_grad_(False) for t in inputs]
    try:
        with mode, torch.no_grad():
            gm = make_fx(fn)(*stand_ins)
    except Exception as exc:  # torch raises many types while tracing; all mean "cannot"
        raise CaptureError(f"{type(exc).__name__}: {_first_line(exc)}") from exc
    if _outputs(gm):
        raise CaptureError("the code returns tensors; only in-place updates are captured")
    return InPlaceGraph(gm, _written_inputs(gm))


def _written_inputs(gm: torch.fx.GraphModule) -> tuple[int, ...]:
    """The inputs an op of ``gm`` writes to directly, by position. (Fake tensors' version
    counters cannot say: foreach ops on them run meta kernels, which bump nothing.)"""
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    position = {node: i for i, node in enumerate(inputs)}
    written: set[int] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        for i, argument in written_arguments(node.target):
            value = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
            values = value if isinstance(value, (list, tuple)) else [value]
            written.update(position[v] for v in values if v in position)
    return tuple(sorted(written))


def _checked(
    graphs: dict, partition: dict, n_outputs: int, differentiable: tuple, mutated: tuple
) -> Captured:
    forward, backward = graphs.get("forward"), graphs.get("backward")
    if forward is None:
        raise CaptureError("AOTAutograd produced no forward graph")
    if any(differentiable) and backward is None:
        raise CaptureError("AOTAutograd produced no backward graph")
    returned = partition.get("num_fwd_outputs", len(_outputs(forward)))
    if returned != len(mutated) + n_outputs:
        raise CaptureError("the code changes its inputs in a way not captured yet")
    if backward is not None:
        saved = [_name(v) for v in _outputs(forward)[returned:]]
        taken = [n.name for n in backward.graph.nodes if n.op == "placeholder"]
        tangents = [name for name in taken if name.startswith("tangents")]
        if taken[: len(saved)] != saved or len(tangents) != sum(differentiable):
            raise CaptureError("the backward graph's inputs do not match the forward's outputs")
    return Captured(forward, backward, n_outputs, differentiable, mutated)


def _kept(node: torch.fx.Node) -> bool:
    """Graph nodes dead-code elimination keeps: inputs and the output. Every other node is
    a functional aten op whose result is all it contributes (random ops included: an
    unused draw is not worth its time)."""
    return node.op in ("placeholder", "output")


def _outputs(gm: torch.fx.GraphModule) -> list:
    node = next(n for n in gm.graph.nodes if n.op == "output")
    return list(node.args[0])


def _name(value) -> str | None:
    return value.name if isinstance(value, torch.fx.Node) else None


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else "no message"
