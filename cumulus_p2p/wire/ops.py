"""Which ops an executor will run: aten overloads, by name, and nothing else.

The executor never unpickles, never evaluates client code and never looks a name up
outside ``torch.ops.aten``. A small blocklist removes the aten ops that reach past the
session's own tensors (files, process state).
"""

from __future__ import annotations

import functools
import re

import torch

from .._errors import RemoteProtocolError

_NAME = re.compile(r"^aten\.([a-z_][a-z0-9_]*)\.([a-zA-Z_][a-zA-Z0-9_]*)$")

#: aten ops that touch the host beyond the session's tensors, or change a tensor's
#: metadata in place (the client's picture of the tensor would silently go stale).
BLOCKED = frozenset(
    {
        "from_file",  # reads a host file
        "_print",  # writes to the host's stdout
        "set_",  # rebinds storages, incl. raw Storage overloads
        "resize_",
        "resize_as_",
        "_resize_output_",
        "as_strided_",
        # Layout changes in place: the client applies these locally and never sends them,
        # and the executor reuses its checked views of a storage from op to op.
        "squeeze_",
        "unsqueeze_",
        "t_",
        "transpose_",
        "swapdims_",
        "swapaxes_",
        "_set_grad_enabled",
        "_cufft_clear_plan_cache",
        "_cufft_set_plan_cache_max_size",
    }
)


class UnknownOpError(RemoteProtocolError):
    """The op name is not an allowed aten overload."""


@functools.lru_cache(maxsize=4096)
def resolve_op(name: str) -> torch._ops.OpOverload:
    """Map ``"aten.add.Tensor"`` to ``torch.ops.aten.add.Tensor``.

    Raises:
        UnknownOpError: the name is malformed, outside aten, blocked, or does not exist.
    """
    if not isinstance(name, str):
        raise UnknownOpError("op name must be a string")
    match = _NAME.match(name)
    if match is None:
        raise UnknownOpError(f"{name!r} is not an aten op name (expected aten.<op>.<overload>)")
    base, overload = match.groups()
    if base.startswith("__") or overload.startswith("__"):
        raise UnknownOpError(f"{name!r} is not an aten op")
    if base in BLOCKED:
        raise UnknownOpError(f"{name!r} is not allowed on an executor")
    try:
        packet = getattr(torch.ops.aten, base)
        op = getattr(packet, overload)
    except (AttributeError, RuntimeError) as exc:
        raise UnknownOpError(f"no aten op named {name!r}") from exc
    if not isinstance(op, torch._ops.OpOverload):
        raise UnknownOpError(f"{name!r} is not an op overload")
    return op


def written_arguments(op: torch._ops.OpOverload) -> list[tuple[int, torch.Argument]]:
    """Position and schema of each argument ``op`` writes to: an in-place op's ``self``, a
    foreach op's tensor list, an ``out=`` argument."""
    return [
        (i, argument)
        for i, argument in enumerate(op._schema.arguments)
        if argument.alias_info is not None and argument.alias_info.is_write
    ]


def op_name(op: torch._ops.OpOverload) -> str:
    """The wire name of an overload: ``aten.add.Tensor``."""
    return f"aten.{op._schema.name.split('::', 1)[1]}.{op._overloadname}"
