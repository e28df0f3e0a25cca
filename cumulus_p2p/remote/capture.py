"""Capture a function of tensors as aten graphs, on meta stand-ins, with AOTAutograd.

A compiled step on cumulus never traces the remote tensors themselves: each input gets a
*stand-in* on the ``meta`` device with the same dtype, shape, strides, storage offset and
``requires_grad``, and AOTAutograd (``aot_function``) traces the function over the
stand-ins. Its forward graph, and in training its backward graph, are recorded instead of
compiled; a meta backward pass is run at once so the backward graph exists before the
first real call. ``compiled.py`` turns the recorded graphs into wire definitions.

What the capture refuses, and why (each becomes an eager run with a warning):

- a graph that mutates its inputs or returns extra outputs (BatchNorm's running
  statistics): the partition would not be a plain (user outputs + saved) forward;
- anything that needs data (``.item()``, data-dependent shapes) fails on meta by nature.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes

from .protocol import storage_extent

#: ``sdp::SDPBackend::flash_attention``, as ``_fused_sdp_choice`` reports it.
_FLASH = 1


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
        n_outputs: How many of the forward graph's outputs the function returns.
        differentiable: Per function output, whether a gradient flows back through it.
    """

    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule | None
    n_outputs: int
    differentiable: tuple[bool, ...]


def stand_in(tensor: torch.Tensor) -> torch.Tensor:
    """A meta tensor laid out like ``tensor`` (storage offset too), same ``requires_grad``.

    The offset matters: an output that views an input is described by its offset into
    the input's storage, and the client builds it on the real input's storage.
    """
    size, stride, offset = tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset()
    extent = storage_extent(size, stride, offset)
    base = torch.empty(extent, dtype=tensor.dtype, device="meta")
    return base.as_strided(size, stride, offset).detach().requires_grad_(tensor.requires_grad)


class _CpuAttention(TorchFunctionMode):
    """Capture ``scaled_dot_product_attention`` as the fused CPU kernel wherever torch on
    a CPU would pick it (as eager cumulus does, ``kernels._sdpa``), not as the dozen math
    ops meta tensors decompose it into: one node, and the numbers of a local run."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            fused = _flash_on_cpu(*args, **kwargs)
            if fused is not None:
                return fused
        return func(*args, **kwargs)


def _flash_on_cpu(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                  scale=None, enable_gqa=False) -> torch.Tensor | None:  # fmt: skip
    def on_cpu(t):  # empty_strided does not touch the pages
        return None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)

    with _disable_current_modes():  # the tracer's modes would record the choice as a node
        choice = torch.ops.aten._fused_sdp_choice(
            on_cpu(query), on_cpu(key), on_cpu(value), on_cpu(attn_mask), dropout_p, is_causal,
            scale=scale, enable_gqa=enable_gqa,
        )  # fmt: skip
    if choice != _FLASH:
        return None
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )[0]


def capture(
    fn: Callable[..., tuple[torch.Tensor, ...]],
    inputs: list[torch.Tensor],
    *,
    cpu_attention: bool = False,
) -> Captured:
    """Trace ``fn(*inputs)``, which returns a tuple of tensors, into aten graphs.

    With ``cpu_attention`` (the executor runs on a CPU), attention is captured as the
    fused kernel a CPU picks.

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
    stand_ins = [stand_in(t) for t in inputs]
    try:
        with _CpuAttention() if cpu_attention else contextlib.nullcontext():
            outputs = traced(*stand_ins)
        differentiable = tuple(o.requires_grad for o in outputs)
        if any(differentiable):
            needed = [o for o in outputs if o.requires_grad]
            torch.autograd.backward(needed, [torch.ones_like(o) for o in needed])
    except CaptureError:
        raise
    except Exception as exc:  # torch raises many types while tracing; all mean "cannot"
        raise CaptureError(f"{type(exc).__name__}: {_first_line(exc)}") from exc
    return _checked(graphs, partition, len(outputs), differentiable)


def _checked(graphs: dict, partition: dict, n_outputs: int, differentiable: tuple) -> Captured:
    forward, backward = graphs.get("forward"), graphs.get("backward")
    if forward is None:
        raise CaptureError("AOTAutograd produced no forward graph")
    if any(differentiable) and backward is None:
        raise CaptureError("AOTAutograd produced no backward graph")
    returned = partition.get("num_fwd_outputs", len(_outputs(forward)))
    if returned != n_outputs:
        raise CaptureError("the code mutates its inputs (e.g. BatchNorm statistics)")
    if backward is not None:
        saved = [_name(v) for v in _outputs(forward)[n_outputs:]]
        taken = [n.name for n in backward.graph.nodes if n.op == "placeholder"]
        tangents = [name for name in taken if name.startswith("tangents")]
        if taken[: len(saved)] != saved or len(tangents) != sum(differentiable):
            raise CaptureError("the backward graph's inputs do not match the forward's outputs")
    return Captured(forward, backward, n_outputs, differentiable)


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
