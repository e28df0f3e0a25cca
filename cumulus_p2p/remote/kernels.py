"""Kernels registered for the PrivateUse1 (``cumulus``) key, for what dispatch misses.

Ops on existing cumulus tensors reach ``RemoteTensor.__torch_dispatch__``. Three kinds of
calls do not:

- factories (``torch.empty(..., device="cumulus")`` and all built on it) have no tensor
  argument to dispatch on;
- ``copy_`` inside ``torch.tensor(..., device=...)`` runs below the Python key;
- ``scaled_dot_product_attention`` picks its fused kernel in C++ by device type, and would
  always fall back to the unfused math path (some 35 ops) for an unknown device. Here it
  picks what the executor's device would pick (a CPU's choice is computed locally; a GPU
  executor is asked once per signature), so results match a local run, the executor runs
  its device's best kernel, and the op stays one op forward and one backward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..wire.ops import op_name
from .client import device_session
from .tensor import (
    DEVICE,
    RemoteTensor,
    contiguous_strides,
    download,
    fresh_tensor,
    new_empty,
    streams_upload,
    upload_into,
    wire_arguments,
)

_META = torch.device("meta")
# sdp::SDPBackend values, as _fused_sdp_choice reports them.
_FLASH, _EFFICIENT, _CUDNN = 1, 2, 3


def _empty_memory_format(
    size, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None
):
    dtype = dtype or torch.get_default_dtype()
    fmt = memory_format or torch.contiguous_format
    if fmt in (torch.contiguous_format, torch.preserve_format):
        strides = contiguous_strides(size)
    else:
        strides = torch.empty(size, device="meta", memory_format=fmt).stride()
    return new_empty(size, strides, dtype, device_session(device))


def _empty_strided(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    return new_empty(size, stride, dtype or torch.get_default_dtype(), device_session(device))


def _copy_from(src, dst, non_blocking=False):
    """``copy_`` reached below the Python key (``torch.tensor(..., device="cumulus")``)."""
    if streams_upload(dst, src):
        upload_into(dst, src)
        return dst
    if type(dst) is RemoteTensor:
        if type(src) is RemoteTensor and src._rs.session is not dst._rs.session:
            return dst.copy_(src)  # between two devices: ``tensor.py``'s ``_copy_`` moves it
        session = dst._rs.session
        session.submit(["aten.copy_.default", *wire_arguments(session, [dst, src], {}), [None]])
        return dst
    dst.copy_(download(src))
    return dst


_sdp_choices: dict[tuple, int] = {}


def _sdp_choice(
    on_cpu: bool, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa
) -> int:
    """The kernel the executor's device would choose for these arguments (cached).

    A CPU's choice is made here on CPU tensors of the same layout (``empty_strided`` does
    not touch the pages). Any other device is asked: ``_fused_sdp_choice`` on remote
    tensors is an op with a non-tensor result, so it runs there as a sync point, once per
    signature. While a compiled step is captured (``capture.py``) the arguments are the
    tracer's tensors: the question is asked outside the tracer, on tensors of their layout.
    """
    sig = (
        _layout(query),
        _layout(key),
        _layout(value),
        None if attn_mask is None else (attn_mask.dtype, tuple(attn_mask.shape)),
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        query.requires_grad,
    )
    choice = _sdp_choices.get(sig)
    if choice is None:
        with _disable_current_modes():
            choice = _sdp_choices[sig] = torch.ops.aten._fused_sdp_choice(
                *(_asked_on(on_cpu, t) for t in (query, key, value, attn_mask)),
                dropout_p,
                is_causal,
                scale=scale,
                enable_gqa=enable_gqa,
            )
    return choice


def _layout(t: torch.Tensor) -> tuple:
    if type(t) is RemoteTensor:  # the eager path, every attention call: already at hand
        return t._sig
    return (t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())


def _asked_on(on_cpu: bool, t: torch.Tensor | None) -> torch.Tensor | None:
    """``t``, or a tensor of its layout where the choice is made (CPU or the executor)."""
    if t is None or (type(t) is RemoteTensor and not on_cpu):
        return t
    return torch.empty_strided(
        t.shape, t.stride(), dtype=t.dtype, device="cpu" if on_cpu else DEVICE
    )


def _sdpa(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    # A captured step's query is the tracer's tensor: its session is the current one.
    session = query._rs.session if type(query) is RemoteTensor else device_session(None)
    on_cpu = session.info.get("device") == "cpu"
    args = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    choice = _sdp_choice(on_cpu, *args)
    if on_cpu and choice == _FLASH:
        out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
        )
        return out
    # The fused GPU kernels, called as torch's own sdpa calls them, for the plain case:
    # no mask to convert, no head dimension to pad, no grouped heads to expand.
    plain = attn_mask is None and not enable_gqa and query.shape[-1] % 8 == 0
    if not on_cpu and plain and choice in (_FLASH, _EFFICIENT, _CUDNN):
        return _fused_gpu_attention(choice, query, key, value, dropout_p, is_causal, scale)
    return torch.ops.aten._scaled_dot_product_attention_math(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
    )[0]


def _fused_gpu_attention(choice, query, key, value, dropout_p, is_causal, scale):
    aten = torch.ops.aten
    if choice == _FLASH:
        return aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale
        )[0]
    lse = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if choice == _EFFICIENT:
        return aten._scaled_dot_product_efficient_attention(
            query, key, value, None, lse, dropout_p, is_causal, scale=scale
        )[0]
    return aten._scaled_dot_product_cudnn_attention(
        query, key, value, None, lse, dropout_p, is_causal, False, scale=scale
    )[0]


def _factory_kernel(func) -> Callable:
    """A PrivateUse1 kernel for a factory op: metadata from meta, the op runs remotely.

    Needed for factories that would otherwise fill a fresh ``empty`` through an ``out=``
    kernel that resizes it (``arange``): a wrapper tensor cannot be resized in place.
    """
    name = op_name(func)

    def kernel(*args, **kwargs):
        meta = func(*args, **{**kwargs, "device": _META})
        session = device_session(kwargs.get("device"))
        tensor, spec = fresh_tensor(
            session, meta.dtype, tuple(meta.shape), tuple(meta.stride()), meta.storage_offset()
        )
        session.submit([name, list(args), {**kwargs, "device": DEVICE}, [spec]])
        return tensor

    return kernel


# Factory ops have no tensor argument to dispatch on, so they need PrivateUse1 kernels.
_factory_kernels = torch.library.Library("aten", "IMPL")
_factory_kernels.impl("empty.memory_format", _empty_memory_format, "PrivateUse1")
_factory_kernels.impl("empty_strided", _empty_strided, "PrivateUse1")
_factory_kernels.impl("_copy_from", _copy_from, "PrivateUse1")
for _name in (
    "arange",
    "arange.start",
    "arange.start_step",
    "linspace",
    "logspace",
    "range",
    "eye",
    "eye.m",
    "randperm",
    "tril_indices",
    "triu_indices",
):
    _base, _, _overload = _name.partition(".")
    _op = getattr(getattr(torch.ops.aten, _base), _overload or "default")
    _factory_kernels.impl(_name, _factory_kernel(_op), "PrivateUse1")
_factory_kernels.impl("scaled_dot_product_attention", _sdpa, "AutogradPrivateUse1")


def _updates_in_place(*args, **kwargs) -> None:
    """The meta kernel of an op that only updates its arguments: nothing to compute."""


# torch has no meta kernel for the fused optimizers' tensor-learning-rate overloads. Without
# one the client cannot plan them (every step would wait for the executor to describe the
# outputs) and a compiled optimizer step cannot trace them.
_meta_kernels = torch.library.Library("aten", "IMPL")
for _name in ("_fused_adam_.tensor_lr", "_fused_adamw_.tensor_lr", "_fused_sgd_.tensor_lr"):
    if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{_name}", "Meta"):
        _meta_kernels.impl(_name, _updates_in_place, "Meta")
