"""``torch.compile`` on the native device: dynamo captures, the graph's ops run as eager ones.

Dynamo traces code on ``cumulus`` tensors as on any other device (the device is a real
PrivateUse1 backend whose kernels shape outputs on meta), but inductor has no code
generator for it and fails with a bare ``KeyError: 'cumulus'``. So once the device is
loaded, ``torch.compile``'s default backend becomes ``OnCumulus``: graphs on other devices
go to inductor as before, and a graph with ``cumulus`` tensors runs through AOT
autograd's eager backend, whose aten ops reach the device's fallback and are recorded
just as eager ops are. A script that compiles its model (nanoGPT does by default) runs,
with a warning. The graph is not yet shipped to the host as one piece, as the Python
device's compiled graphs are (issue 30).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch

from . import NAME

#: Said once per compiled callable, the first time it captures a graph on the device.
EAGER_WARNING = (
    "torch.compile on the native cumulus device: the graph is captured, and its ops are "
    "recorded and replayed one by one on the host as in eager mode (compiled graphs are "
    "not shipped to the host yet)"
)


class OnCumulus:
    """A dynamo backend: AOT autograd's eager backend for a graph with ``cumulus``
    tensors, ``other`` (inductor, with the caller's mode and options) for the rest."""

    def __init__(self, other: Any) -> None:
        self.other = other
        self.warned = False

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        if not _on_cumulus(gm, example_inputs):
            return self.other(gm, example_inputs)
        if not self.warned:
            warnings.warn(EAGER_WARNING, stacklevel=2)
            self.warned = True
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    def __getattr__(self, name: str) -> Any:
        # torch.compile asks its backend for inductor's config and the like.
        return getattr(self.other, name)


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
