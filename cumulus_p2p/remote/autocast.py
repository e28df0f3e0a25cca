"""Mixed precision on the ``cumulus`` device: ``torch.autocast("cumulus")`` as on CUDA.

Autocast needs kernels for the ``AutocastPrivateUse1`` dispatch key, and torch registers
none for a Python backend: without them even a plain ``fill_`` fails in an autocast
region ("Could not run 'aten::...' with arguments from the 'Autocastcumulus' backend").
``register()`` (called when the device is registered) adds a fallthrough for every op plus
CUDA's casting policy for the common ones: matmul and convolution families in the
autocast dtype; pointwise ops prone to overflow, norms and losses in float32; reductions
accumulating in float32 unless the caller chose a dtype; mixed-type ops promoted to the
widest type. CUDA compatibility mode maps ``torch.autocast("cuda")`` here.

Unlike CUDA's, the casts are not cached across ops within a region: a weight used twice
is cast twice (two remote ops, no extra round trip).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from .device import NAME

#: Run in the autocast dtype (float16 unless the region says bfloat16).
_LOWER_PRECISION = tuple(
    """
    _convolution conv1d conv2d conv3d conv1d.padding conv2d.padding conv3d.padding conv_tbc
    conv_transpose1d conv_transpose2d.input conv_transpose3d.input convolution prelu addmm
    addmv addr matmul einsum mm mv linear addbmm baddbmm bmm chain_matmul linalg_multi_dot
    lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell scaled_dot_product_attention
    """.split()
)
#: Run in float32 (numerically sensitive).
_FLOAT32 = tuple(
    """
    acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan
    pow.Tensor_Scalar pow.Tensor_Tensor pow.Scalar softplus layer_norm native_layer_norm
    group_norm cosine_similarity poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d
    hinge_embedding_loss kl_div l1_loss smooth_l1_loss huber_loss mse_loss
    margin_ranking_loss multilabel_margin_loss soft_margin_loss triplet_margin_loss
    multi_margin_loss binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp
    """.split()
)
#: Reductions that accumulate in float32: given ``dtype=float32`` unless the caller set one.
_FLOAT32_DTYPE_ARG = tuple(
    """
    prod prod.dim_int softmax.int log_softmax.int cumprod cumsum linalg_vector_norm sum
    sum.dim_IntList
    """.split()
)
#: Mixed-precision inputs promoted to the widest type among them.
_PROMOTE = tuple(
    """
    addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot
    scatter_add cat stack index_copy
    """.split()
)

_AUTOCAST_KEY = "AutocastPrivateUse1"
_NO_AUTOCAST = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)


def _eligible(x: Any) -> bool:
    """Cast as CUDA's autocast casts: floating tensors of this device, never float64. By
    device, not type: a compiled step's capture traces tensors that stand in for remote
    ones (``capture.py``)."""
    return (
        isinstance(x, torch.Tensor)
        and x.device.type == NAME
        and x.is_floating_point()
        and x.dtype != torch.float64
    )


def _cast(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if _eligible(x) and x.dtype != dtype else x
    if type(x) is list or type(x) is tuple:
        return type(x)(_cast(v, dtype) for v in x)
    return x


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif type(x) is list or type(x) is tuple:
        for v in x:
            yield from _tensors(v)


def _autocast_kernel(op, policy: str) -> Callable:
    dtype_index = next(
        (i for i, a in enumerate(op._schema.arguments) if a.name == "dtype" and not a.kwarg_only),
        None,
    )

    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_NO_AUTOCAST):
            if policy == "lower":
                dtype = torch.get_autocast_dtype(NAME)
            elif policy == "float32":
                dtype = torch.float32
            elif policy == "promote":
                eligible = [t for t in _tensors((args, tuple(kwargs.values()))) if _eligible(t)]
                wide = any(t.dtype == torch.float32 for t in eligible)
                dtype = torch.float32 if wide else torch.get_autocast_dtype(NAME)
            else:  # "dtype": only the accumulation type changes, and only if not chosen
                first = next(_tensors(args), None)
                if first is None or not _eligible(first):
                    return op(*args, **kwargs)
                if dtype_index is not None and len(args) > dtype_index:
                    if args[dtype_index] is None:
                        args = (*args[:dtype_index], torch.float32, *args[dtype_index + 1 :])
                elif kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
                return op(*args, **kwargs)
            return op(*_cast(args, dtype), **{k: _cast(v, dtype) for k, v in kwargs.items()})

    return kernel


def register() -> list[torch.library.Library]:
    """Register the fallthrough and the policy; keep the returned libraries alive."""
    fallthrough = torch.library.Library("_", "IMPL")
    fallthrough.fallback(torch.library.fallthrough_kernel, _AUTOCAST_KEY)
    kernels = torch.library.Library("aten", "IMPL")
    tables = (
        ("lower", _LOWER_PRECISION),
        ("float32", _FLOAT32),
        ("dtype", _FLOAT32_DTYPE_ARG),
        ("promote", _PROMOTE),
    )
    for policy, names in tables:
        for name in names:
            base, _, overload = name.partition(".")
            op = getattr(getattr(torch.ops.aten, base), overload or "default")
            kernels.impl(name, _autocast_kernel(op, policy), _AUTOCAST_KEY)
    return [fallthrough, kernels]
