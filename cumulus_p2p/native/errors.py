"""What the native executor raises when a batch cannot run (``csrc/replay.cpp``)."""

from __future__ import annotations

from .._errors import CumulusError

#: The rule a failing record broke, as ``ReplayError.kind`` names it.
KINDS = (
    "malformed",  # truncated, unknown kind/tag/dtype, bad geometry, stray bytes
    "unknown_handle",  # a storage handle the session does not hold
    "unknown_op",  # not an aten overload, or one an executor refuses
    "out_of_memory",  # the session's quota would be exceeded
    "op_failed",  # the op itself raised (wrong shapes, wrong dtypes...)
    "poisoned_handle",  # an output the executor could not produce as the client expected
    "evicted",  # the session's storages, evicted to the host's disk, came back damaged
    "invalid_graph",  # a compiled graph's definition or call breaks a rule (host/graphs.py)
)


class ReplayError(CumulusError):
    """A record of a batch could not run.

    The records before it ran, it had no effect, and the records after it did not run.

    Attributes:
        record: the failing record's index in the batch (0-based).
        kind: which rule it broke, one of ``KINDS``.
    """

    def __init__(self, message: str, record: int, kind: str) -> None:
        super().__init__(message)
        self.record = record
        self.kind = kind

    def __reduce__(self):
        return (type(self), (str(self), self.record, self.kind))
