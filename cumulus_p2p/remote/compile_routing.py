"""Where ``torch.compile`` sends code: cumulus's capture when it runs on cumulus, dynamo
otherwise.

``torch.compile`` returns its compiled callable at once, before any tensor is seen, so
the choice is made per call: a module whose parameters are on cumulus, a function called
with cumulus arguments, or an optimizer holding cumulus parameters runs through
``CompiledCode`` (``compiled.py``) or ``CompiledOptimizerStep`` (``compiled_optimizer.py``);
anything else reaches what dynamo made of it, exactly as without cumulus. A function that
reaches cumulus tensors another way, through its closure or the globals it names (the
PyTorch recipe ``@torch.compile def fn(): opt.step(); sched.step()``), runs eagerly with a
warning: dynamo cannot trace a cumulus tensor.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from .compiled import CompiledCode, warn_eager
from .compiled_optimizer import CompiledOptimizerStep, optimizer_on


def patch_torch_compile(device_type: str) -> None:
    """Route ``torch.compile`` calls whose code runs on ``device_type`` to cumulus."""
    original = torch.compile
    if getattr(original, "_cumulus_patched", False):
        return

    @functools.wraps(original)
    def compile_for_cumulus(model: Any = None, **options: Any) -> Any:
        if model is None:  # the decorator form: @torch.compile(mode=...)
            return lambda fn: compile_for_cumulus(fn, **options)
        compiled = original(model, **options)
        fullgraph = bool(options.get("fullgraph", False))
        if isinstance(model, torch.nn.Module):
            # OptimizedModule calls its ``forward`` attribute, the dynamo-wrapped
            # ``model.__call__``; on cumulus the module is called through CompiledCode.
            remote = CompiledCode(model, model, device_type, fullgraph)
            compiled.forward = _route(device_type, compiled.forward, remote, model)
            return compiled
        optimizer = _optimizer_of(model)
        if optimizer is not None:
            return CompiledOptimizerStep(model, optimizer, compiled, device_type, fullgraph)
        remote = CompiledCode(model, None, device_type, fullgraph)
        return _route(device_type, compiled, remote, None)

    compile_for_cumulus._cumulus_patched = True  # type: ignore[attr-defined]
    torch.compile = compile_for_cumulus


def _route(
    device_type: str, compiled: Callable, remote: CompiledCode, module: torch.nn.Module | None
) -> Callable:
    @functools.wraps(remote.fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if _module_on(device_type, module) or _arguments_on(device_type, args, kwargs):
            return remote(*args, **kwargs)
        if module is None and _reaches(device_type, remote.fn):
            warn_eager(
                "the compiled function reaches cumulus tensors through its closure or "
                "globals (compile the model or opt.step itself to capture them)",
                remote.fullgraph,
            )
            return remote.fn(*args, **kwargs)
        return compiled(*args, **kwargs)

    return call


def _optimizer_of(fn: Any) -> torch.optim.Optimizer | None:
    """The optimizer whose ``step`` ``fn`` is: the bound method, or the wrapper an LR
    scheduler puts in its place (it holds the optimizer by weak reference)."""
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, torch.optim.Optimizer):
        return owner
    if getattr(fn, "_wrapped_by_lr_sched", False):
        for cell in fn.__closure__ or ():
            target = cell.cell_contents
            if isinstance(target, weakref.ref) and isinstance(target(), torch.optim.Optimizer):
                return target()
    return None


def _reaches(device_type: str, fn: Callable) -> bool:
    """Whether ``fn``'s closure or the globals it names hold a cumulus tensor, a module
    on cumulus, or an optimizer of cumulus parameters (one level deep)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return False
    cells = [cell.cell_contents for cell in fn.__closure__ or () if _filled(cell)]
    names = getattr(fn, "__globals__", {})
    values = [*cells, *(names[n] for n in code.co_names if n in names)]
    return any(_on(device_type, value) for value in values)


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _on(device_type: str, value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.device.type == device_type
    if isinstance(value, torch.nn.Module):
        return _module_on(device_type, value)
    if isinstance(value, torch.optim.Optimizer):
        return optimizer_on(device_type, value)
    return False


def _module_on(device_type: str, module: torch.nn.Module | None) -> bool:
    if module is None:
        return False
    # A model lives on one device; its first parameter (or buffer) says which.
    first = next(itertools.chain(module.parameters(), module.buffers()), None)
    return first is not None and first.device.type == device_type


def _arguments_on(device_type: str, args: tuple, kwargs: dict) -> bool:
    return any(
        isinstance(leaf, torch.Tensor) and leaf.device.type == device_type
        for leaf in tree_leaves((args, kwargs))
    )
