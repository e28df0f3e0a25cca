"""``torch.compile`` on cumulus tensors: run eagerly, with one warning, never crash.

Dynamo cannot trace a ``RemoteTensor`` yet: it would fake-ify it through
``__tensor_unflatten__`` and fail deep inside its own machinery. Real training code calls
``torch.compile(model)`` by default (nanoGPT does on CUDA), so under CUDA compatibility
mode it would stop at its first step. Until compiled steps exist (issue 13), a compiled
callable whose module or arguments live on ``cumulus`` runs the original eager code,
which gives the same numbers, and says so once per process. Everything else compiles
exactly as before: the check sits in front of the compiled callable, not inside dynamo.
"""

from __future__ import annotations

import functools
import itertools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

#: What the one warning says: why the code runs eagerly and that nothing is wrong.
EAGER_WARNING = (
    "torch.compile: cumulus tensors run eagerly for now (same results; compiled steps "
    "on the cumulus device are not supported yet)"
)

_warned = [False]


def patch_torch_compile(device_type: str) -> None:
    """Route ``torch.compile`` calls that touch ``device_type`` tensors to eager code."""
    original = torch.compile
    if getattr(original, "_cumulus_patched", False):
        return

    @functools.wraps(original)
    def compile_unless_remote(model: Any = None, **options: Any) -> Any:
        if model is None:  # the decorator form: @torch.compile(mode=...)
            return lambda fn: compile_unless_remote(fn, **options)
        compiled = original(model, **options)
        if isinstance(model, torch.nn.Module):
            # OptimizedModule calls its ``forward`` attribute, the dynamo-wrapped
            # ``model.__call__``; the eager path calls the module itself.
            compiled.forward = _eager_on(device_type, compiled.forward, model, model)
            return compiled
        return _eager_on(device_type, compiled, model, None)

    compile_unless_remote._cumulus_patched = True  # type: ignore[attr-defined]
    torch.compile = compile_unless_remote


def _eager_on(
    device_type: str, compiled: Callable, eager: Callable, module: torch.nn.Module | None
) -> Callable:
    @functools.wraps(eager)
    def call(*args: Any, **kwargs: Any) -> Any:
        if _module_on(device_type, module) or _arguments_on(device_type, args, kwargs):
            if not _warned[0]:
                _warned[0] = True
                warnings.warn(EAGER_WARNING, UserWarning, stacklevel=2)
            return eager(*args, **kwargs)
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
