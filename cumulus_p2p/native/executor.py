"""The executor side of the native device: one session's replay loop, loaded from C++.

``Replayer(device, quota_bytes)`` (``csrc/replay.cpp``) holds a session's storages,
its op name table and its resolved operator handles; ``replay(batch, new_names)`` runs
one batch of wire records and returns the readbacks' bytes, raising ``ReplayError``
(``errors.py``) for a record that cannot run. Unlike the device library, the replay
library registers nothing with the dispatcher, so any process may load it.
"""

from __future__ import annotations

from types import ModuleType

from .errors import ReplayError as ReplayError

#: Per-session memory quota when none is given: as the Python executor's default.
DEFAULT_QUOTA = 8 * 1024**3

_LIBRARY: ModuleType | None = None


def library(verbose: bool = False) -> ModuleType:
    """Build (if sources changed) and load the replay library, once per process."""
    global _LIBRARY
    if _LIBRARY is None:
        from ._build import build_replay

        _LIBRARY = build_replay(verbose=verbose)
    return _LIBRARY


def new_replayer(device: str = "cpu", quota_bytes: int = DEFAULT_QUOTA):
    """A session's replay loop on ``device`` (``"cpu"``, ``"cuda"``...), its live storages
    capped at ``quota_bytes``."""
    return library().Replayer(device, quota_bytes)
