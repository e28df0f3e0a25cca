"""The ``cumulus`` device in C++: a PrivateUse1 backend that records ops (issue 30).

Theory of operation
-------------------
The Python device (``cumulus_p2p.remote``) is a ``__torch_dispatch__`` wrapper
subclass: every aten op, views included, crosses into Python, 25–29 µs a dispatch. This
package builds a C++ extension (``csrc/``) that is the kernels behind the PrivateUse1
dispatch key itself:

- an allocator whose "pointers" are remote storage handles, never dereferenced, a
  device guard and PrivateUse1 hooks (``device.cpp``);
- native view and metadata kernels, so ``view``, ``t``, ``transpose``, ``detach`` cost
  what they cost on a CPU tensor and append nothing (``kernels.cpp``);
- one boxed fallback for every other op: outputs come from the op's meta kernel, get new
  storage handles, and the op is appended to an in-memory batch as a wire record
  (format in ``csrc/record.h``, decoded by ``records.py``), with no Python per op.

The executor side replays those batches in C++ (``csrc/replay.cpp``, a library of its
own that registers nothing, loaded by ``executor.py``): the host's own executor
(``cumulus_p2p.host.executor``) runs a native session beside the Python device's,
with the lease's quota, device turns and worker process, over plain TCP or the secure
channel. ``session.py`` sends the device's batches there (frames in
``cumulus_p2p.wire.native``) and answers reads back through the device's readback hook
(``set_readback_hook``). ``torch.cumulus`` (``_DeviceModule``) answers what torch and
CUDA compatibility mode (``cumulus_p2p.cuda_compat``) ask of the device. A session
fails over from checkpoints the client keeps in memory or on its disk, or a standby
host keeps, pulled from the session's host (``checkpoint.py``), and resumes where its
host parked it when only its connection or its lease's time ran out.

One owner per process
---------------------
PrivateUse1 is a single dispatch key and ``rename_privateuse1_backend`` works once per
process. ``cumulus_p2p.remote`` claims both at import (it renames the key ``cumulus`` and
registers Python kernels for factories and copies on it). Two sets of kernels behind one
key would silently override each other, so the native device is exclusive: ``load``
refuses a process where ``cumulus_p2p.remote`` is imported or PrivateUse1 has another
name, and once loaded it makes importing ``cumulus_p2p.remote`` fail with an
ImportError that says why. Until the native device becomes the default, run it in its
own process (the tests and ``benchmarks/dispatch_floor.py`` do).

Parts:

- ``load()``: build if needed, load, and register ``cumulus`` (idempotent);
- ``missing_toolchain()``: why the extension cannot be built here, or None;
- ``is_fresh()``: whether it is built from the current sources (loads with no compiler);
- ``records``: the wire record decoder (and an encoder: tests, checkpoints' restores);
- ``checkpoint``, ``replaylog``: what a session keeps to move to another host;
- ``executor``, ``errors``: the C++ replay loop, a session's state around it
  (``ReplaySession``) and the ``ReplayError`` it raises;
- ``session``: a session with a host's executor, over any frame channel;
- ``compile``: ``torch.compile`` of code on the device (each graph shipped whole);
- ``python -m cumulus_p2p.native --build``: build ahead of time (``scripts/bootstrap``).
"""

from __future__ import annotations

import importlib.abc
import sys
from types import ModuleType

from ..devicemodule import SessionDeviceModule
from ._build import build_directory as build_directory
from ._build import is_fresh as is_fresh
from ._build import missing_toolchain as missing_toolchain

NAME = "cumulus"
_WRAPPER = "cumulus_p2p.remote"
_LOADED: ModuleType | None = None


class _DeviceModule(SessionDeviceModule):
    """``torch.cumulus`` for the native device: what torch asks a backend module."""

    @staticmethod
    def _open_session():
        return _session()

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1

    class device:  # noqa: N801 - torch asks for torch.<device>.device(index)
        """``with torch.cumulus.device(0):``: there is one device, so nothing changes."""

        def __init__(self, device) -> None:
            self.index = device

        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc) -> None:
            return None

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        """``torch.manual_seed`` reaches the executor's generator: a SEED record, in
        order with the ops around it."""
        if _LOADED is not None:
            _LOADED.seed(seed & 0xFFFF_FFFF_FFFF_FFFF)

    manual_seed = manual_seed_all

    # What CUDA compatibility mode asks beside (``cumulus_p2p.cuda_compat``).

    @staticmethod
    def is_attached() -> bool:
        from .session import current

        return current() is not None

    @staticmethod
    def memory_allocated(device=None) -> int:
        """Bytes of the session's live storages (counted on this side)."""
        return 0 if _LOADED is None else _LOADED.memory_allocated()

    @staticmethod
    def max_memory_allocated(device=None) -> int:
        return 0 if _LOADED is None else _LOADED.max_memory_allocated()

    memory_reserved = memory_allocated

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        if _LOADED is not None:
            _LOADED.reset_peak_memory_stats()

    @staticmethod
    def empty_cache() -> None:
        """Nothing is cached here: send the frees queued so far, so the executor sees them."""
        from .session import current

        session = current()
        if session is not None:
            session.flush()

    @staticmethod
    def mem_get_info(device=None) -> tuple[int, int]:
        """(free, total) bytes of the session's quota on the executor."""
        quota = int(_session().info.get("quota", 0))
        return quota - _LOADED.memory_allocated(), quota

    @staticmethod
    def get_rng_state(device=None):
        """The executor generator's state as a CPU byte tensor (a sync point); empty
        while no session is open."""
        import torch

        from .session import current

        if current() is None:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(bytearray(_LOADED.rng_state()), dtype=torch.uint8)

    @staticmethod
    def set_rng_state(new_state, device=None) -> None:
        """Give the executor's generator a state ``get_rng_state`` read, in order with
        the ops around it (``fork_rng``, activation checkpointing)."""
        from .session import current

        if current() is not None and new_state.numel() > 0:
            _LOADED.set_rng_state(new_state.contiguous().numpy().tobytes())


def _session():
    """The open native session, or a SessionClosedError saying how to open one."""
    from .._errors import SessionClosedError
    from .session import current

    session = current()
    if session is None:
        raise SessionClosedError(
            "no native cumulus session is open: run the script under `cumulus-node "
            "--consume --native ... -- python script.py` (or `python -m cumulus_p2p.shim "
            "--native script.py` with CUMULUS_EXECUTOR=host:port)"
        )
    return session


class _RefuseWrapperDevice(importlib.abc.MetaPathFinder):
    """Makes ``import cumulus_p2p.remote`` fail once the native device owns PrivateUse1."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == _WRAPPER or fullname.startswith(_WRAPPER + "."):
            raise ImportError(
                f"{fullname} cannot be imported in this process: cumulus_p2p.native "
                "owns the PrivateUse1 device here, and the Python wrapper device would "
                "override its kernels. Use one or the other per process."
            )
        return None


def _check_process_is_free() -> None:
    import torch

    if _WRAPPER in sys.modules:
        raise RuntimeError(
            "cumulus_p2p.native cannot load in this process: cumulus_p2p.remote (the "
            "Python wrapper device) already registered kernels for PrivateUse1. Load "
            "the native device in a process that does not import cumulus_p2p.remote."
        )
    current = torch._C._get_privateuse1_backend_name()
    if current != "privateuseone":
        raise RuntimeError(
            f"cumulus_p2p.native cannot load: PrivateUse1 is already the {current!r} "
            "device in this process"
        )


def load(verbose: bool = False) -> ModuleType:
    """Build (if sources changed), load and register the native ``cumulus`` device.

    Call it before the process's first backward pass: autograd's engine sizes its
    per-device queues once, from the device guards registered at that time.

    Returns:
        The extension module: ``take_batch``, ``pending_records``, ``intern``,
        ``op_names``, ``handle`` and ``set_readback_hook``.

    Raises:
        RuntimeError: the process already has another PrivateUse1 device (see the module
            docstring), or the extension cannot be built (the message names what to
            install).
    """
    global _LOADED
    if _LOADED is not None:
        return _LOADED
    _check_process_is_free()
    import torch

    from ._build import build

    module = build(verbose=verbose)
    torch.utils.rename_privateuse1_backend(NAME)
    torch.utils.generate_methods_for_privateuse1_backend()
    torch._register_device_module(NAME, _DeviceModule())
    from .compile import patch_torch_compile

    patch_torch_compile()
    sys.meta_path.insert(0, _RefuseWrapperDevice())
    _LOADED = module
    return module
