"""Running tests on the native ``cumulus`` device, which needs a process of its own.

The native device and the Python wrapper device (``cumulus_p2p.remote``) cannot share a
process (see ``cumulus_p2p.native``), and the test suite's ``conftest.py`` imports the
wrapper. So ``@in_native_process`` runs a test's body in one spawned child per test
session, where the native device is loaded first thing. The child imports the test's
module by name (spawn pickles functions by reference), runs the body, and sends back its
result or its exception, whose traceback names the failing line.
"""

from __future__ import annotations

import functools
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

_in_child = False
_pool: ProcessPoolExecutor | None = None


def _start_child() -> None:
    global _in_child
    _in_child = True
    import torch

    from cumulus_p2p import native

    torch.set_num_threads(1)
    native.load()  # before any backward: autograd sizes its device queues once


def _child_pool() -> ProcessPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ProcessPoolExecutor(
            max_workers=1,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_start_child,
        )
    return _pool


def in_native_process(fn):
    """Run ``fn`` in the session's native-device child process (directly when in it)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if _in_child:
            return fn(*args, **kwargs)
        return _child_pool().submit(run, *args, **kwargs).result()

    return run


def stop_native_process() -> None:
    """End the child, if one was started."""
    global _pool
    if _pool is not None:
        _pool.shutdown()
        _pool = None
