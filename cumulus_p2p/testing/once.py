"""A result computed once per test session, however many pytest workers ask for it.

A module-scoped fixture runs once per *worker* that runs one of its tests: two specs that
read one 45-second simulation, scheduled on two workers, computed it twice. ``once`` keeps
the result in the session's directory of kept runs (``nodes.REFERENCE_RUNS``, which every
worker inherits): the first worker to ask computes it under a file lock, the others wait
on the lock and read what it wrote.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from filelock import FileLock

from .nodes import REFERENCE_RUNS

T = TypeVar("T")


def once(key: str, compute: Callable[[], T]) -> T:
    """``compute()``, or what it returned for ``key`` earlier in this test session.

    Outside a session that keeps runs (no ``CUMULUS_REFERENCE_RUNS``), simply ``compute()``.
    """
    root = os.environ.get(REFERENCE_RUNS)
    if not root:
        return compute()
    kept = Path(root) / f"{key}.pickle"
    with FileLock(f"{kept}.lock"):
        if kept.exists():
            return pickle.loads(kept.read_bytes())
        result = compute()
        kept.write_bytes(pickle.dumps(result))
        return result
