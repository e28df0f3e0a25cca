"""Executor errors as the consumer sees them: the executor's exception type, its message
and the op's name, raised at the next sync point.

These live apart from ``_errors.py`` because they derive from torch's exception types and
``_errors.py`` must stay importable without torch.
"""

from __future__ import annotations

import functools

import torch

from .._errors import RemoteExecutionError


class RemoteOutOfMemoryError(RemoteExecutionError, torch.OutOfMemoryError):
    """The session went over its memory quota, or the host's device ran out of memory.

    The failed op's outputs are unavailable; everything else in the session is intact.
    Free tensors (``del``) or rent more memory, then carry on.
    """


_BUILTIN_BASES: dict[str, type[Exception]] = {
    "RuntimeError": RuntimeError,
    "ValueError": ValueError,
    "TypeError": TypeError,
    "IndexError": IndexError,
    "KeyError": KeyError,
    "NotImplementedError": NotImplementedError,
    "ZeroDivisionError": ZeroDivisionError,
    "OverflowError": OverflowError,
    "AssertionError": AssertionError,
}


@functools.cache
def _remote_class(kind: str) -> type[RemoteExecutionError]:
    base = _BUILTIN_BASES.get(kind, RuntimeError)
    return type(f"Remote{kind}", (RemoteExecutionError, base), {"__module__": __name__})


def remote_error(kind: str, message: str, op: str) -> RemoteExecutionError:
    """Build the exception to raise in the client for an executor-side failure.

    The result is an instance of both ``RemoteExecutionError`` and the builtin type the
    executor raised (``RuntimeError`` when it was a type the client does not know), so
    ``except RuntimeError`` in existing training code keeps working.
    """
    text = f"{op}: {kind}: {message}"
    if kind == "OutOfMemoryError":
        return RemoteOutOfMemoryError(text, remote_type=kind, op=op)
    return _remote_class(kind)(text, remote_type=kind, op=op)
