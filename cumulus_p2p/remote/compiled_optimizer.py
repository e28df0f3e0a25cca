"""Compiled optimizer steps: ``torch.compile(opt.step)`` on cumulus is one record per step.

Theory of operation
-------------------
Eagerly, an optimizer step on cumulus is a dozen foreach ops over lists as long as the
model has parameters, each paid for in the client's Python. ``CompiledOptimizerStep``
captures the step once per guard key (``capture.capture_in_place``): the optimizer's own
``step`` runs over fake stand-ins for the parameters, their gradients and their state, and
the aten ops it dispatches are recorded as they ran, in-place ops included. The graph goes
to the executor once per session (``CompiledGraph``); each later step is one ``@run``
record naming the real tensors, and the executor updates them in place. The results are
bit-identical to the same optimizer run eagerly on cumulus with ``capturable=True``.

As ``torch.compile`` does for a CUDA optimizer, the step is made *capturable* first: each
group that has the flag gets ``capturable=True``, and step counters move to the
parameters' device. The step then computes its bias corrections on the device instead of
reading ``step.item()`` into Python, so nothing in the graph changes from step to step. A
group that leaves ``foreach`` to torch gets torch's choice for the real parameters while
the fakes stand in (for the fakes alone torch would pick the per-parameter loop).

The guard key is each group's hyperparameters, which parameters have gradients, and the
layouts of parameters, gradients and state tensors. Adam and AdamW take the learning rate
as a graph input instead, a one-element tensor on the device per group, refilled when the
group's ``lr`` changes: a schedule that sets it every step (nanoGPT's) costs one small op
per step, not a capture. Other optimizers capture again for a new learning rate, as torch
recompiles for one. The step of a fresh optimizer runs eagerly: it creates the state. A
step with a closure, step hooks (Python that would run only at capture), a tensor
hyperparameter, or more than ``MAX_CAPTURES`` keys runs eagerly with a one-line warning.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch
from torch.optim import optimizer as torch_optimizer

from .capture import CaptureError, capture_in_place
from .compiled import MAX_CAPTURES, CompiledGraph, warn_eager
from .tensor import RemoteTensor

#: The entry of a key whose step creates optimizer state (a fresh optimizer's first step):
#: that step runs eagerly, without a warning, and the next one has a key of its own.
_CREATES_STATE = "the step creates optimizer state"

_Entry = tuple[CompiledGraph, tuple[int, ...]] | str

#: Optimizers whose capturable step accepts a learning rate held in a tensor.
_TENSOR_LR = (torch.optim.Adam, torch.optim.AdamW)


class CompiledOptimizerStep:
    """What ``torch.compile(opt.step)`` returns when ``opt`` may hold cumulus parameters."""

    def __init__(
        self,
        step: Callable,
        optimizer: torch.optim.Optimizer,
        compiled: Callable,
        device_type: str,
        fullgraph: bool = False,
    ) -> None:
        self.step = step  # what was compiled, run as is whenever the step runs eagerly
        self.optimizer = optimizer
        self.compiled = compiled  # dynamo's version, for parameters on other devices
        self.device_type = device_type
        self.fullgraph = fullgraph  # a step that cannot be captured raises instead of warning
        # An LR scheduler's wrapper of ``step`` notes each call for the scheduler's check.
        self._noted = getattr(step, "_wrapped_by_lr_sched", False)
        self._graphs: dict[tuple, _Entry] = {}
        self._lr_input = type(self.optimizer) in _TENSOR_LR
        self._lrs: list[tuple[float, torch.Tensor]] = []  # per group: value, device tensor

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not optimizer_on(self.device_type, self.optimizer):
            return self.compiled(*args, **kwargs)
        reason = "an optimizer step with a closure" if args or kwargs else _refusal(self.optimizer)
        if reason is None:
            tensors, entry = self._entry()
            if entry is _CREATES_STATE:
                return self.step()
            if not isinstance(entry, str):
                graph, written = entry
                graph.call(tensors + self._lr_tensors() if self._lr_input else tensors)
                # As an eager in-place op would: autograd then refuses a backward that
                # needs the old values.
                torch.autograd.graph.increment_version([tensors[i] for i in written])
                if self._noted:
                    self.optimizer._opt_called = True  # type: ignore[attr-defined]
                return None
            reason = entry
        warn_eager(reason, self.fullgraph)
        return self.step(*args, **kwargs)

    def _entry(self) -> tuple[list, _Entry]:
        """The step's inputs now, and the graph (or the reason for eager) for their key."""
        try:
            tensors, key = _inputs_and_key(self.optimizer, self._lr_input)
            entry = self._graphs.get(key)
            if entry is None:
                _make_capturable(self.optimizer)
                tensors, key = _inputs_and_key(self.optimizer, self._lr_input)
                entry = self._graphs.get(key) or self._capture(key, tensors)
        except TypeError:  # a hyperparameter that cannot be part of a key
            return [], "a hyperparameter is not hashable"
        return tensors, entry

    def _lr_tensors(self) -> list[torch.Tensor]:
        """Each group's learning rate on the device, refilled where it changed."""
        groups = self.optimizer.param_groups
        if len(self._lrs) != len(groups):
            device = groups[0]["params"][0].device
            self._lrs = [(math.nan, torch.empty((), device=device)) for _ in groups]
        for i, group in enumerate(groups):
            value, tensor = self._lrs[i]
            if group["lr"] != value:
                tensor.fill_(group["lr"])
                self._lrs[i] = (group["lr"], tensor)
        return [tensor for _, tensor in self._lrs]

    def _capture(self, key: tuple, tensors: list) -> _Entry:
        entry: _Entry
        if len(self._graphs) >= MAX_CAPTURES:
            entry = f"more than {MAX_CAPTURES} optimizer signatures (learning rates, shapes)"
        elif any(type(t) is not RemoteTensor for t in tensors) or _foreign_state(self.optimizer):
            entry = "optimizer state or gradients on another device"
        else:
            try:
                inputs = tensors + self._lr_tensors() if self._lr_input else tensors
                captured = capture_in_place(_functional(self.optimizer, self._lr_input), inputs)
                entry = (CompiledGraph(captured.graph), captured.written)
            except CaptureError as exc:
                # Creating state may take ops the tracer cannot run: whatever failed, a
                # step that has state to create runs for real first.
                created = isinstance(exc.__cause__, _StateCreated) or _stateless(self.optimizer)
                entry = _CREATES_STATE if created else f"the step cannot be captured ({exc})"
        self._graphs[key] = entry
        return entry


def optimizer_on(device_type: str, optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s parameters live on ``device_type`` (its first one says)."""
    first = next((p for g in optimizer.param_groups for p in g["params"]), None)
    return first is not None and first.device.type == device_type


class _StateCreated(Exception):
    """Raised in a traced step that created state: that step must run for real."""


def _refusal(optimizer: torch.optim.Optimizer) -> str | None:
    """Why this optimizer's step cannot be captured at all, or None."""
    hooks = (
        optimizer._optimizer_step_pre_hooks,
        optimizer._optimizer_step_post_hooks,
        torch_optimizer._global_optimizer_pre_hooks,
        torch_optimizer._global_optimizer_post_hooks,
    )
    if any(hooks):
        return "the optimizer has step hooks"
    for group in optimizer.param_groups:
        if group.get("differentiable"):
            return "a differentiable optimizer step"
        if any(isinstance(v, torch.Tensor) for k, v in group.items() if k != "params"):
            return "a tensor hyperparameter (lr, betas...)"
    return None


def _make_capturable(optimizer: torch.optim.Optimizer) -> None:
    """What ``torch.compile`` does to a CUDA optimizer: capturable groups, step counters
    on the parameters' device (a counter on the CPU would be read with ``.item()``)."""
    for group in optimizer.param_groups:
        if "capturable" in group:
            group["capturable"] = True
    for param, state in optimizer.state.items():
        step = state.get("step")
        if isinstance(step, torch.Tensor) and step.device != param.device:
            state["step"] = step.to(param.device)


def _inputs_and_key(optimizer: torch.optim.Optimizer, lr_input: bool) -> tuple[list, tuple]:
    """The step's input tensors (per parameter with a gradient: it, its gradient, its state
    tensors) and the guard key (without the learning rate where it is an input)."""
    tensors: list[torch.Tensor] = []
    layout: list[Any] = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                layout.append(None)
                continue
            tensors += (param, grad)
            entries = []
            for name, value in optimizer.state.get(param, {}).items():
                if type(value) is RemoteTensor:
                    tensors.append(value)
                    entries.append((name, value._sig))
                else:  # a number, or a tensor elsewhere: a constant of the graph
                    entries.append((name, _constant(value)))
            layout.append((_sig(param), _sig(grad), tuple(entries)))
    fixed = ("params", "lr") if lr_input else ("params",)
    hyper = tuple(
        tuple((k, v) for k, v in g.items() if k not in fixed) for g in optimizer.param_groups
    )
    return tensors, (hyper, tuple(layout))


def _sig(tensor: torch.Tensor) -> Any:
    return tensor._sig if type(tensor) is RemoteTensor else ("other", tensor.device)


def _constant(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", value.device, value.dtype, tuple(value.shape))
    return value


def _stateless(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a parameter with a gradient has no optimizer state yet."""
    return any(
        p.grad is not None and not optimizer.state.get(p)
        for group in optimizer.param_groups
        for p in group["params"]
    )


def _foreign_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a state tensor is not on cumulus: tracing would update the real one."""
    return any(
        isinstance(v, torch.Tensor) and type(v) is not RemoteTensor
        for state in optimizer.state.values()
        for v in state.values()
    )


def _functional(optimizer: torch.optim.Optimizer, lr_input: bool) -> Callable[..., tuple]:
    """The step as a function of ``_inputs_and_key``'s tensors (then, with ``lr_input``,
    each group's learning rate), for the tracer."""
    step = type(optimizer).step
    # ``Optimizer`` wraps each subclass's step in its profiling hook: recorded, it would
    # leave profiler ops in the graph. The hook's wrapper keeps the step it wraps.
    step = getattr(step, "__wrapped__", step) if getattr(step, "hooked", False) else step

    def functional(*tensors: torch.Tensor) -> tuple:
        it = iter(tensors)
        params: list[list[torch.Tensor]] = []
        state: defaultdict[torch.Tensor, dict] = defaultdict(dict)
        for group in optimizer.param_groups:
            params.append([])
            for param in group["params"]:
                if param.grad is None:  # the step reads nothing of it but its gradient
                    params[-1].append(param)
                    continue
                fake = next(it)
                fake.grad = next(it)
                real = optimizer.state.get(param, {})
                state[fake] = {
                    k: next(it) if type(v) is RemoteTensor else v for k, v in real.items()
                }
                params[-1].append(fake)
        lrs = list(it) if lr_input else None
        before = {fake: dict(entries) for fake, entries in state.items()}
        with _standing_in(optimizer, params, state, lrs):
            step(optimizer)
        for fake, entries in before.items():
            if state[fake].keys() != entries.keys() and not entries:
                raise _StateCreated()
            if state[fake].keys() != entries.keys() or any(
                state[fake][k] is not v for k, v in entries.items()
            ):
                raise CaptureError("the step replaces state tensors instead of updating them")
        return ()

    return functional


@contextmanager
def _standing_in(
    optimizer: torch.optim.Optimizer, params: list, state: defaultdict, lrs: list | None
):
    """The optimizer with stand-in parameters, state (and learning rates) while inside."""
    saved = [(g["params"], g.get("foreach"), g["lr"]) for g in optimizer.param_groups]
    saved_state = optimizer.state
    try:
        for i, (group, stand_ins) in enumerate(zip(optimizer.param_groups, params, strict=True)):
            if group.get("foreach") is None and not group.get("fused"):
                real = [p for p in group["params"] if p.grad is not None]
                group["foreach"] = torch_optimizer._default_to_fused_or_foreach(
                    real, differentiable=False, use_fused=False
                )[1]
            group["params"] = stand_ins
            if lrs is not None:
                group["lr"] = lrs[i]
        optimizer.state = state
        yield
    finally:
        optimizer.state = saved_state
        for group, (group_params, foreach, lr) in zip(optimizer.param_groups, saved, strict=True):
            group["params"], group["lr"] = group_params, lr
            if "foreach" in group:
                group["foreach"] = foreach
