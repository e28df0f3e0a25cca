"""Where ``torch.compile`` sends code: cumulus's capture when it runs on cumulus, dynamo
otherwise.

``torch.compile`` returns its compiled callable at once, before any tensor is seen, so
the choice is made per call: a module whose parameters are on cumulus, a function called
with cumulus arguments, or an optimizer holding cumulus parameters runs through
``CompiledCode`` (``compiled.py``) or ``CompiledOptimizerStep`` (``compiled_optimizer.py``);
anything else reaches what dynamo made of it, exactly as without cumulus.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from .compiled import CompiledCode
from .compiled_optimizer import CompiledOptimizerStep


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
        if isinstance(model, torch.nn.Module):
            # OptimizedModule calls its ``forward`` attribute, the dynamo-wrapped
            # ``model.__call__``; on cumulus the module is called through CompiledCode.
            remote = CompiledCode(model, model, device_type)
            compiled.forward = _route(device_type, compiled.forward, remote, model)
            return compiled
        if isinstance(getattr(model, "__self__", None), torch.optim.Optimizer):
            return CompiledOptimizerStep(model, compiled, device_type)
        return _route(device_type, compiled, CompiledCode(model, None, device_type), None)

    compile_for_cumulus._cumulus_patched = True  # type: ignore[attr-defined]
    torch.compile = compile_for_cumulus


def _route(
    device_type: str, compiled: Callable, remote: CompiledCode, module: torch.nn.Module | None
) -> Callable:
    @functools.wraps(remote.fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if _module_on(device_type, module) or _arguments_on(device_type, args, kwargs):
            return remote(*args, **kwargs)
        return compiled(*args, **kwargs)

    return call


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
