"""Registers the ``cumulus`` device with torch and provides ``torch.cumulus``.

torch's pure-Python PrivateUse1 backend is renamed ``cumulus`` at import, except on a
machine with a CUDA GPU of its own: once a PrivateUse1 backend exists, torch takes it for
*the* accelerator of the process (``at::getAccelerator``, pytorch/pytorch#161129), and
autograd then fails on every local CUDA backward. There registration waits for first need
(``register``, which ``attach`` and CUDA compatibility mode call), so importing
``cumulus_p2p.remote`` leaves the local GPU usable. Ops on existing cumulus
tensors reach ``RemoteTensor.__torch_dispatch__``; ops that *create* tensors from nothing
(``torch.empty(..., device="cumulus")`` and everything built on it: ``zeros``, ``randn``,
``arange``, ``tensor(...)``) have no tensor to dispatch on; their PrivateUse1 kernels sit
beside ``RemoteTensor`` in ``tensor.py``. ``torch.compile`` of code on cumulus tensors
captures it into graphs the executor runs (``compiled.py``). ``torch.cumulus`` has streams
and events, as ``torch.cuda`` does; a session runs its ops in one order, so they keep it
and wait only when asked to synchronize (``Stream``, ``Event``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import time

import torch
import torch.utils.data._utils.pin_memory as _dataloader_pinning
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

from ..devicemodule import SessionDeviceModule
from . import compile_routing
from .client import CURRENT, RemoteSession, current_session, device_index, device_session

NAME = "cumulus"


class Stream:
    """A stream of the ``cumulus`` device, as ``torch.cuda.Stream`` (FSDP2 makes several).

    A session runs its ops in the order they were issued, whichever stream was current,
    so every stream is that one order: what a wait between streams or on an event would
    enforce on a GPU holds already, and those waits are no-ops. Synchronizing waits for
    every op queued, this stream's among them.
    """

    def __init__(self, device=None, priority: int = 0, **kwargs) -> None:
        if device is not None:
            CumulusModule.set_device(torch.device(device).index)

    def synchronize(self) -> None:
        """Wait for every queued op; raises the first executor error among them."""
        current_session().synchronize()

    def query(self) -> bool:
        """Whether the ops queued are done: it waits for them, so always True."""
        self.synchronize()
        return True

    def wait_stream(self, stream: Stream) -> None:
        """Order this stream after ``stream``'s work queued so far: it is already."""

    def wait_event(self, event: Event) -> None:
        """Order this stream after ``event``'s ops: it is already."""

    def record_event(self, event: Event | None = None) -> Event:
        """Record ``event`` (a new one by default) here and return it."""
        event = event if event is not None else Event()
        event.record(self)
        return event

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> None:
        return None


class Event:
    """An event of the ``cumulus`` device, as ``torch.cuda.Event``.

    Recording one marks a point in the session's one op order (``Stream``). Its
    ``synchronize`` waits for every op queued so far, those before the record among them.
    A timing event (``enable_timing=True``) waits for them when recorded, then reads the
    clock, so that ``elapsed_time`` measures the ops between two records.
    """

    def __init__(self, enable_timing: bool = False, blocking: bool = False, **kwargs) -> None:
        self._timing = enable_timing
        self._time: float | None = None

    def record(self, stream: Stream | None = None) -> None:
        """Mark the point in the op order; a timing event waits and reads the clock."""
        if self._timing:
            current_session().synchronize()
            self._time = time.perf_counter()

    def synchronize(self) -> None:
        """Wait for the ops before the record (and every other op queued)."""
        current_session().synchronize()

    def query(self) -> bool:
        """Whether the ops before the record are done: it waits for them, so always True."""
        self.synchronize()
        return True

    def wait(self, stream: Stream | None = None) -> None:
        """Order ``stream`` after this event: it is already."""

    def elapsed_time(self, end_event: Event) -> float:
        """Milliseconds between this timing event's record and ``end_event``'s."""
        if self._time is None or end_event._time is None:
            raise RuntimeError("both events must be timing events, recorded, for elapsed_time")
        return (end_event._time - self._time) * 1000.0


_DEFAULT_STREAM = Stream()


class CumulusModule(SessionDeviceModule):
    """``torch.cumulus``: what ``torch.cuda`` answers, for the remote device."""

    _open_session = staticmethod(current_session)
    Stream = Stream
    Event = Event

    @staticmethod
    def current_stream(device=None) -> Stream:
        """The stream ops go to: there is one order (``Stream``), so always the same one."""
        return _DEFAULT_STREAM

    default_stream = current_stream

    @staticmethod
    def stream(stream: Stream | None = None) -> contextlib.AbstractContextManager:
        """``with torch.cumulus.stream(s):`` issues ops in the one order, as outside it."""
        return contextlib.nullcontext() if stream is None else stream

    _pending_seed: int | None = None

    @staticmethod
    def is_available() -> bool:
        """True while a session is attached."""
        return CURRENT.session is not None and not CURRENT.session.closed

    #: What ``cuda_compat`` asks before using the session: the same question.
    is_attached = is_available

    @classmethod
    def device_count(cls) -> int:
        """The sessions attached: one per device (``attach`` with several addresses)."""
        return len(CURRENT.sessions) if cls.is_available() else 0

    @staticmethod
    def current_device() -> int:
        return CURRENT.index

    @staticmethod
    def set_device(device) -> None:
        """Make ``cumulus:device`` the one ``device="cumulus"`` names.

        Raises:
            ValueError: no such device is attached.
        """
        index = device_index(device)
        if index is None:
            return
        if not 0 <= index < max(len(CURRENT.sessions), 1):
            raise ValueError(
                f"cumulus:{index} does not exist: this process attached "
                f"{len(CURRENT.sessions)} cumulus device(s)"
            )
        CURRENT.index = index

    @classmethod
    def synchronize(cls, device=None) -> None:
        """Wait for every op sent to the device so far; raises its first failure."""
        device_session(device).synchronize()

    @classmethod
    def session_info(cls, device=None) -> dict:
        """What the device's executor said of itself when its session opened."""
        return device_session(device).info

    @classmethod
    def get_device_name(cls, device=None) -> str:
        return f"cumulus ({cls.session_info(device).get('device_name', '?')})"

    @staticmethod
    def memory_allocated(device=None) -> int:
        """Bytes held by live tensors of the device's session (counted locally)."""
        session = _attached(device)
        return 0 if session is None else session.bytes_allocated

    @staticmethod
    def max_memory_allocated(device=None) -> int:
        session = _attached(device)
        return 0 if session is None else session.peak_bytes_allocated

    @classmethod
    def memory_reserved(cls, device=None) -> int:
        return cls.memory_allocated(device)

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        session = _attached(device)
        if session is not None:
            session.peak_bytes_allocated = session.bytes_allocated

    @staticmethod
    def empty_cache() -> None:
        """Nothing is cached client-side: send the frees queued so far, so that the
        executors see them."""
        for session in CURRENT.sessions:
            if not session.closed:
                session.flush()

    @staticmethod
    def mem_get_info(device=None) -> tuple[int, int]:
        """(free, total) bytes of the device's session's quota on its executor."""
        session = device_session(device)
        quota = int(session.info.get("quota", 0))
        return quota - session.bytes_allocated, quota

    @classmethod
    def manual_seed(cls, seed: int) -> None:
        """Seed every device's generator (applied at attach if none is attached yet)."""
        sessions = [s for s in CURRENT.sessions if not s.closed]
        if not sessions:
            cls._pending_seed = int(seed)
        for session in sessions:
            session.seed(int(seed))

    manual_seed_all = manual_seed

    @staticmethod
    def get_rng_state(device=None) -> torch.Tensor:
        """The device generator's state on its executor (for ``torch.random.fork_rng``)."""
        return device_session(device).rng_state()

    @staticmethod
    def set_rng_state(new_state: torch.Tensor, device=None) -> None:
        """Restore a state from ``get_rng_state``."""
        device_session(device).set_rng_state(new_state)

    @staticmethod
    def is_bf16_supported() -> bool:
        return True


def _attached(device) -> RemoteSession | None:
    """The device's session; None where nothing is attached."""
    index = device_index(device)
    index = CURRENT.index if index is None else index
    sessions = CURRENT.sessions
    return sessions[index] if 0 <= index < len(sessions) else None


def _pins_for_cumulus(device) -> bool:
    if device is None or device == "":
        current = torch.accelerator.current_accelerator()
        return current is not None and current.type == NAME
    return torch.device(device).type == NAME


def _skip_pinning_for_cumulus(pin_memory):
    """``DataLoader``'s pinning step, made a no-op when it pins for ``cumulus``.

    Page-locked memory speeds up DMA to a local GPU; batches for a remote device leave
    through a socket, so there is nothing to gain, and a pure-Python backend cannot
    provide the pinned allocator torch would ask for. Once ``cumulus`` is registered it
    is the current accelerator, so an ordinary ``DataLoader(pin_memory=True)`` pins for
    it and would fail in its pinning thread.
    """

    @functools.wraps(pin_memory)
    def pin(data, device=None):
        return data if _pins_for_cumulus(device) else pin_memory(data, device)

    return pin


#: The autocast kernels' libraries: registrations last as long as these objects.
_AUTOCAST: list[torch.library.Library] = []


def is_registered() -> bool:
    """Whether ``cumulus`` is a torch device in this process yet."""
    return torch._C._get_privateuse1_backend_name() == NAME


def register() -> None:
    """Make ``cumulus`` a torch device in this process (idempotent; cannot be undone).

    Until then ``torch.manual_seed`` cannot reach the device, so the first registration
    carries its seed over: the session is seeded as if the device had existed all along.

    Caveat (a torch limitation, pytorch/pytorch#161129): from now on torch treats
    ``cumulus`` as this process's accelerator, and a backward pass over *local* CUDA
    tensors fails inside autograd. Train on a local GPU in another process.
    """
    if is_registered():
        return
    _setup_privateuseone_for_python_backend(NAME, backend_module=CumulusModule())
    from . import autocast  # its kernels name this device, so after registering it

    _AUTOCAST.extend(autocast.register())
    compile_routing.patch_torch_compile(NAME)
    _dataloader_pinning.pin_memory = _skip_pinning_for_cumulus(_dataloader_pinning.pin_memory)
    CumulusModule._pending_seed = torch.initial_seed()
    # torch's first dispatch to a tensor subclass imports torch.distributed.tensor (and
    # sympy with it: a second of CPU) to look for DTensor. Paid here, with the device's
    # other set-up, it does not stall the first op of the first session.
    if torch.distributed.is_available():
        importlib.import_module("torch.distributed.tensor")
        from . import distributed  # init_process_group("cumulus"): collectives among hosts

        distributed.register()


if not torch.cuda.is_available():
    register()
