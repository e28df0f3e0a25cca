"""CUDA compatibility mode: a script written for CUDA runs on the ``cumulus`` device unchanged.

Typical use (``python -m cumulus_p2p.shim`` does this around a whole script)::

    import cumulus_p2p.remote as remote
    from cumulus_p2p import cuda_compat

    with remote.attach("127.0.0.1:5555"), cuda_compat.cuda_compat():
        assert torch.cuda.is_available()
        model = Net().cuda()                       # parameters live on cumulus:0
        x = torch.randn(8, 32, device="cuda")      # so does x
        torch.cuda.synchronize()

Theory of operation
-------------------
Either cumulus device serves: the Python one (``cumulus_p2p.remote``, the default) or
the native one (``cumulus_p2p.native``; ``enable(native.load)``). The mode asks the device
through ``torch.cumulus``, the device module each registers, and never imports either
device itself (they cannot share a process). Three layers, all installed by ``enable()``
and removed by ``disable()``:

1. *Device arguments.* A ``TorchFunctionMode`` sees every torch call made in the thread
   that enabled it, before dispatch. It rewrites a ``device`` keyword naming CUDA (``"cuda"``,
   ``"cuda:0"``, ``torch.device("cuda")``, ``0``) to ``cumulus:0``, and handles the calls that
   name a device positionally or mean CUDA by themselves: ``Tensor.to("cuda", ...)`` and
   ``Tensor.cuda()``. ``nn.Module.to/.cuda`` go through those, so models move too. Pinned
   memory has no meaning for a remote device (bytes leave through a socket either way), so
   ``pin_memory()`` returns the tensor itself and ``pin_memory=True`` is dropped.
2. *The ``torch.cuda`` namespace.* Its query and control functions (``is_available``,
   ``synchronize``, memory statistics, seeding, events and streams...) are replaced by
   functions answering for the attached session, through ``torch.cumulus``. Torch's own
   Python code calls some of them too (``torch.manual_seed`` seeds CUDA; ``GradScaler`` and
   ``autocast`` check ``is_available``; optimizers check ``is_current_stream_capturing``), so
   every replacement is safe to call from there.
3. *Adjacent entry points.* ``torch.autocast("cuda")`` (and ``torch.cuda.amp.autocast``)
   becomes ``torch.autocast("cumulus")``; ``torch.set_default_device("cuda")`` and
   ``with torch.device("cuda"):`` mean cumulus; ``DataLoader(pin_memory=True)`` stops
   pinning; ``torch.load(..., map_location="cuda")`` (or of a checkpoint saved on a GPU)
   loads onto the CPU and moves the CUDA-bound tensors to ``cumulus``.

Every replaced attribute is saved and ``disable()`` puts back the very same objects.

``torch.autocast("cuda")`` means ``torch.autocast("cumulus")`` here, whose casting policy
(CUDA's) the device registers with itself (``autocast.py``).

Limits: the device mode is thread-local (torch function modes are), so torch calls made in
other threads than the enabling one are not redirected, and it costs about 1.5 µs per torch
call in that thread. ``tensor.is_cuda`` stays ``False`` and ``tensor.device`` reads
``cumulus:0`` (torch itself branches on both, so faking them would send cumulus tensors
down CUDA-only paths). ``torch.cuda.get_rng_state`` and ``set_rng_state`` read and set the
executor's generator. A process that attached several devices has them as ``cuda:0``
up (``cuda:1`` is ``cumulus:1``, ``torch.cuda.set_device`` picks the current one), so a
model split across GPUs runs split across hosts. ``torch.Generator(device="cuda")``,
CUDA graphs, ``torch.cuda.FloatTensor``-style types, ``DataParallel`` and the rest of
``torch.cuda`` are not emulated. A job of several processes is:
in one rank of a torchrun job, ``cuda:LOCAL_RANK`` is that rank's session,
``init_process_group("nccl")`` makes a ``cumulus`` group (``remote/distributed.py``), and
``DistributedDataParallel(device_ids=[LOCAL_RANK])`` runs on the session's device.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ._errors import SessionClosedError

NAME = "cumulus"

__all__ = ["NO_SESSION_MESSAGE", "cuda_compat", "disable", "enable", "is_enabled"]

#: What a CUDA call says when compatibility mode is on but no session is attached.
NO_SESSION_MESSAGE = (
    "CUDA compatibility mode sends CUDA work to the cumulus device, but no cumulus session "
    "is attached. Run the script under `cumulus-node --consume ... -- python script.py` "
    "(or `python -m cumulus_p2p.shim script.py` with CUMULUS_EXECUTOR=host:port), or call "
    "cumulus_p2p.remote.attach('host:port') before the first CUDA call."
)

#: What ``torch.cumulus`` must answer for compatibility mode, beside what torch itself asks
#: of a device module: both devices' modules provide these.
DEVICE_MODULE_API = (
    "is_attached",
    "session_info",
    "get_device_name",
    "synchronize",
    "manual_seed",
    "memory_allocated",
    "max_memory_allocated",
    "memory_reserved",
    "reset_peak_memory_stats",
    "empty_cache",
    "mem_get_info",
    "get_rng_state",
    "set_rng_state",
)

_MISSING = object()


# --- public API ----------------------------------------------------------------------------


def enable(register: Callable[[], Any] | None = None) -> bool:
    """Turn on CUDA compatibility mode for this process (device redirection for this thread).

    Safe to call before a session is attached: ``torch.cuda.is_available()`` answers
    ``True`` at once, and the first call that needs the device raises
    ``SessionClosedError`` saying how to attach.

    Args:
        register: makes the ``cumulus`` device exist; default: the Python device's
            (``cumulus_p2p.remote.device.register``). The native device passes
            ``cumulus_p2p.native.load``.

    Returns:
        ``True`` if this call turned the mode on, ``False`` if it was already on.
    """
    if _STATE.mode is not None:
        return False
    if register is None:
        from .remote.device import register
    register()
    saved = []
    try:
        for owner, name, value in _replacements():
            saved.append((owner, name, vars(owner).get(name, _MISSING)))
            setattr(owner, name, value)
    except BaseException:
        _restore(saved)
        raise
    mode = _CudaRedirect()
    mode.__enter__()
    _STATE.mode, _STATE.thread, _STATE.saved = mode, threading.get_ident(), saved
    return True


def disable() -> None:
    """Turn CUDA compatibility mode off and put back every attribute it replaced.

    Tensors already on ``cumulus`` stay there. A no-op when the mode is off.

    Raises:
        RuntimeError: called from a thread other than the one that called ``enable()``
            (the device mode lives in that thread's state).
    """
    mode = _STATE.mode
    if mode is None:
        return
    if _STATE.thread != threading.get_ident():
        raise RuntimeError("cuda_compat.disable() must run in the thread that called enable()")
    _remove_mode(mode)
    _restore(_STATE.saved)
    _STATE.mode, _STATE.thread, _STATE.saved = None, None, []


def is_enabled() -> bool:
    """Whether CUDA compatibility mode is on."""
    return _STATE.mode is not None


@contextlib.contextmanager
def cuda_compat(register: Callable[[], Any] | None = None) -> Iterator[None]:
    """Context manager: compatibility mode inside the block (``register`` as ``enable``'s).

    Nests: only the outermost block that actually turned the mode on turns it off.
    """
    turned_on = enable(register)
    try:
        yield
    finally:
        if turned_on:
            disable()


# --- state and patching ----------------------------------------------------------------------


class _State:
    mode: TorchFunctionMode | None = None
    thread: int | None = None
    saved: list[tuple[Any, str, Any]] = []


_STATE = _State()


def _restore(saved: list[tuple[Any, str, Any]]) -> None:
    for owner, name, old in reversed(saved):
        if old is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, old)


def _remove_mode(mode: TorchFunctionMode) -> None:
    """Take ``mode`` off this thread's function-mode stack, wherever it sits in it."""
    above = []
    while torch._C._len_torch_function_stack() > 0:
        top = torch._C._pop_torch_function_stack()
        if top is mode:
            break
        above.append(top)
    for other in reversed(above):
        torch._C._push_on_torch_function_stack(other)


def _replacements() -> list[tuple[Any, str, Any]]:
    """(owner, attribute, replacement) for everything ``enable`` installs."""
    import torch.amp.autocast_mode as autocast_mode
    import torch.serialization
    import torch.utils.data._utils.pin_memory as pin_memory
    from torch.utils._device import DeviceContext

    cuda = torch.cuda
    out: list[tuple[Any, str, Any]] = [(cuda, name, fn) for name, fn in _CUDA_FUNCTIONS.items()]
    original_init = vars(autocast_mode.autocast)["__init__"]
    out.append((autocast_mode.autocast, "__init__", _autocast_init(original_init)))
    out.append((pin_memory, "pin_memory", _no_pin))
    context_init = vars(DeviceContext)["__init__"]
    out.append((DeviceContext, "__init__", _device_context_init(context_init)))
    load = _load(torch.serialization.load)
    out += [(torch, "load", load), (torch.serialization, "load", load)]
    if torch.distributed.is_available():
        import torch.distributed.distributed_c10d as c10d
        from torch.nn.parallel import DistributedDataParallel as DDP

        init = _init_process_group(c10d.init_process_group)
        out += [(c10d, "init_process_group", init), (torch.distributed, "init_process_group", init)]
        out.append((DDP, "__init__", _ddp_init(vars(DDP)["__init__"])))
    return out


def _init_process_group(original: Callable) -> Callable:
    """``init_process_group`` with NCCL meaning the ``cumulus`` backend, whose collectives
    run among the job's hosts (``remote/distributed.py``)."""

    @functools.wraps(original)
    def init_process_group(backend: Any = None, *args: Any, **kwargs: Any) -> Any:
        if "backend" in kwargs:
            backend = kwargs.pop("backend")
        if isinstance(backend, str) and backend.lower() == "nccl":
            if NAME not in torch.distributed.Backend.backend_list:
                raise RuntimeError(
                    "NCCL means the cumulus backend under CUDA compatibility mode, and this "
                    "device has none: run the job on the Python device (without --native)"
                )
            backend = NAME
        return original(backend, *args, **kwargs)

    return init_process_group


def _ddp_init(original: Callable) -> Callable:
    """``DistributedDataParallel`` given ``device_ids=[LOCAL_RANK]``: a rank's session is
    its one device, on which the module and its inputs already are, so DDP is told no
    device (as for any device it does not move inputs to)."""

    @functools.wraps(original)
    def __init__(self, module, device_ids=None, output_device=None, *args, **kwargs):  # noqa: N807
        for device in device_ids or ():
            _check_index(device)
        if output_device is not None:
            _check_index(output_device)
        return original(self, module, None, None, *args, **kwargs)

    return __init__


# --- 1. device arguments ---------------------------------------------------------------------


def _device(index: int | None = 0) -> torch.device:
    """``cumulus:index``; the current device for None."""
    return _devices(_current() if index is None else index)


@functools.cache
def _devices(index: int) -> torch.device:
    # Not at import: "cumulus" is a device type only once a device registered it.
    return torch.device(NAME, index)


def _require_session() -> None:
    if not _cumulus().is_attached():
        raise SessionClosedError(NO_SESSION_MESSAGE)


def _cuda_index(device: Any) -> int | None | bool:
    """The device index ``device`` names if it means CUDA, else ``False``.

    An integer means CUDA to CUDA scripts (``.cuda(0)``, ``device=0``).
    """
    t = type(device)
    if t is str:
        if not device.startswith("cuda"):
            return False
        index = torch.device(device).index
    elif t is torch.device:
        if device.type != "cuda":
            return False
        index = device.index
    elif t is int:
        index = device
    else:
        return False
    # The environment is read only for an index other than 0: this runs on every device
    # argument of every torch call.
    if index not in (None, 0) and index != _local_rank() and not _one_of_several(index):
        count = _cumulus().device_count()
        raise ValueError(
            f"CUDA device {index} does not exist: this process has {count} cumulus "
            f"device(s), which compatibility mode presents as cuda:0 to cuda:{count - 1} "
            "(attach one executor per GPU the script uses; in one rank of a torchrun job, "
            "its device is cuda:LOCAL_RANK)"
        )
    return index


def _one_of_several(index: int) -> bool:
    """Whether ``cuda:index`` is one of the devices of a process no launcher started
    (``attach`` with several addresses: ``cumulus:index``)."""
    return "LOCAL_RANK" not in os.environ and 0 <= index < _cumulus().device_count()


def _cumulus_index(cuda_index: int | None) -> int | None:
    """The cumulus device a CUDA index means: in one rank of a torchrun job, its one
    session (``cuda:LOCAL_RANK``); otherwise the same index. None: the current device."""
    if cuda_index is None:
        return None
    return 0 if "LOCAL_RANK" in os.environ else cuda_index


def _local_rank() -> int:
    """This process's rank on its machine when a launcher (torchrun) started it: its
    session is that rank's GPU, so a script's ``cuda:LOCAL_RANK`` means it."""
    try:
        return int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError:
        return 0


def _redirect(device: Any) -> Any:
    """``device`` with CUDA replaced by the cumulus device it means (``cuda:1`` by
    ``cumulus:1``; in a torchrun rank, ``cuda:LOCAL_RANK`` by ``cumulus:0``); other
    devices unchanged."""
    index = _cuda_index(device)
    if index is False:
        return device
    _require_session()
    return _device(_cumulus_index(index))


def _tensor_to(func, args, kwargs):
    # Tensor.to(device[, dtype][, non_blocking][, copy]) or Tensor.to(other) or .to(dtype)
    if len(args) > 1:
        args = (args[0], _redirect(args[1]), *args[2:])
    if "device" in kwargs:
        kwargs = {**kwargs, "device": _redirect(kwargs["device"])}
    return func(*args, **kwargs)


def _tensor_cuda(func, args, kwargs):
    # Tensor.cuda(device=None, non_blocking=False, memory_format=torch.preserve_format)
    names = ("device", "non_blocking", "memory_format")
    given = dict(zip(names, args[1:], strict=False)) | kwargs
    index = _check_index(given.pop("device", None))
    _require_session()
    return args[0].to(_device(index), **given)


def _tensor_pin_memory(func, args, kwargs):
    return args[0]


def _tensor_record_stream(func, args, kwargs):
    return None  # one ordered op stream: memory is never reused across streams


_SPECIAL: dict[Any, Callable] = {
    torch.Tensor.to: _tensor_to,
    torch.Tensor.cuda: _tensor_cuda,
    torch.Tensor.pin_memory: _tensor_pin_memory,
    torch.Tensor.record_stream: _tensor_record_stream,
}


class _CudaRedirect(TorchFunctionMode):
    """Rewrites CUDA device arguments of every torch call in this thread to ``cumulus:0``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        special = _SPECIAL.get(func)
        if special is not None:
            return special(func, args, kwargs or {})
        if kwargs:
            if kwargs.get("device") is not None:
                kwargs = {**kwargs, "device": _redirect(kwargs["device"])}
            if kwargs.get("pin_memory"):
                kwargs = {**kwargs, "pin_memory": False}
            return func(*args, **kwargs)
        return func(*args)


def _no_pin(data, device=None):
    """``DataLoader``'s pinning step, as a no-op (also in its pin-memory thread)."""
    return data


# --- 2. the torch.cuda namespace -------------------------------------------------------------


def _cumulus():
    return torch.cumulus


def _check_index(device=None) -> int:
    """The index of the cumulus device ``device`` names (as CUDA or as cumulus; None:
    the current device), or raise."""
    if device is None:
        return _current()
    cuda = _cuda_index(device)
    if cuda is not False:
        index = _cumulus_index(cuda)
        return _current() if index is None else index
    index = torch.device(device).index
    if torch.device(device).type != NAME or (index or 0) >= max(1, _cumulus().device_count()):
        raise ValueError(f"{device!r} is none of this process's cumulus devices (cuda:0 up)")
    return _current() if index is None else index


def _current() -> int:
    """The current cumulus device; 0 before a device registered itself."""
    module = getattr(torch, NAME, None)
    return 0 if module is None else module.current_device()


def _on(index: int) -> dict:
    """The ``device`` argument of a ``torch.cumulus`` query for device ``index``: none for
    ``cumulus:0``, which the native device (one device, no such argument) answers too."""
    return {} if index == 0 else {"device": index}


def _is_available() -> bool:
    """True while compatibility mode is on; the first real use says if no session is attached."""
    return True


def _device_count() -> int:
    """The process's cumulus devices; one in a rank of a torchrun job (its session)."""
    return 1 if "LOCAL_RANK" in os.environ else max(1, _cumulus().device_count())


def _current_device() -> int:
    return _cumulus().current_device()


def _set_device(device) -> None:
    index = _check_index(device)
    if index != _cumulus().current_device():
        _cumulus().set_device(index)


def _get_device_name(device=None) -> str:
    index = _check_index(device)
    _require_session()
    return _cumulus().get_device_name(**_on(index))


def _get_device_capability(device=None) -> tuple[int, int]:
    """What the executor reports, else (8, 0): the bf16/TF32 class scripts test for."""
    index = _check_index(device)
    _require_session()
    capability = _cumulus().session_info(**_on(index)).get("capability")
    return tuple(capability) if capability else (8, 0)


@dataclass(frozen=True)
class DeviceProperties:
    """What ``torch.cuda.get_device_properties`` answers in compatibility mode.

    ``total_memory`` is the session's quota on the executor; the compute fields come from
    the executor when it reports them, else they are placeholders (``major, minor = 8, 0``).
    """

    name: str
    total_memory: int
    major: int
    minor: int
    multi_processor_count: int
    is_integrated: bool = False
    is_multi_gpu_board: bool = False


def _get_device_properties(device=None) -> DeviceProperties:
    index = _check_index(device)
    major, minor = _get_device_capability(index)
    info = _cumulus().session_info(**_on(index))
    return DeviceProperties(
        name=_cumulus().get_device_name(**_on(index)),
        total_memory=int(info.get("quota", 0)),
        major=major,
        minor=minor,
        multi_processor_count=int(info.get("multi_processor_count", 1)),
    )


def _synchronize(device=None) -> None:
    index = _check_index(device)
    _require_session()
    _cumulus().synchronize(**_on(index))


def _manual_seed(seed: int) -> None:
    # No session needed: torch.manual_seed calls this, and the cumulus module keeps a seed
    # given before attach for the session to come.
    _cumulus().manual_seed(int(seed))


def _seed() -> None:
    _manual_seed(int.from_bytes(os.urandom(8)) >> 1)


def _memory_allocated(device=None) -> int:
    return _cumulus().memory_allocated(**_on(_check_index(device)))


def _max_memory_allocated(device=None) -> int:
    return _cumulus().max_memory_allocated(**_on(_check_index(device)))


def _memory_reserved(device=None) -> int:
    return _cumulus().memory_reserved(**_on(_check_index(device)))


def _reset_peak_memory_stats(device=None) -> None:
    _cumulus().reset_peak_memory_stats(**_on(_check_index(device)))


def _empty_cache() -> None:
    _cumulus().empty_cache()


def _mem_get_info(device=None) -> tuple[int, int]:
    index = _check_index(device)
    _require_session()
    return _cumulus().mem_get_info(**_on(index))


def _memory_stats(device=None) -> dict[str, int]:
    allocated, peak = _memory_allocated(device), _max_memory_allocated(device)
    return {
        "allocated_bytes.all.current": allocated,
        "allocated_bytes.all.peak": peak,
        "reserved_bytes.all.current": allocated,
        "reserved_bytes.all.peak": peak,
    }


def _memory_summary(device=None, abbreviated=False) -> str:
    stats = _memory_stats(device)
    return (
        f"cumulus memory: {stats['allocated_bytes.all.current']} bytes allocated, "
        f"peak {stats['allocated_bytes.all.peak']} bytes"
    )


def _no_op(*args, **kwargs) -> None:
    return None


def _false(*args, **kwargs) -> bool:
    return False


def _true(*args, **kwargs) -> bool:
    return True


def _get_rng_state(device=None) -> torch.Tensor:
    """The remote generator's state: the executor's, for this session."""
    return _cumulus().get_rng_state(**_on(_check_index(device)))


def _get_rng_state_all() -> list[torch.Tensor]:
    return [_get_rng_state()]


def _set_rng_state(new_state: torch.Tensor, device=None) -> None:
    _cumulus().set_rng_state(new_state, **_on(_check_index(device)))


def _set_rng_state_all(new_states) -> None:
    for state in new_states:
        _set_rng_state(state)


class _Stream:
    """A CUDA stream stand-in: the session runs ops in order, so one stream is exact."""

    def __init__(self, device=None, priority: int = 0, **kwargs) -> None:
        _check_index(device)

    def synchronize(self) -> None:
        _synchronize()

    def query(self) -> bool:
        _synchronize()
        return True

    def wait_stream(self, stream) -> None:
        return None

    def wait_event(self, event) -> None:
        return None

    def record_event(self, event=None):
        event = event if event is not None else _Event()
        event.record(self)
        return event

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc) -> None:
        return None


_DEFAULT_STREAM = _Stream()


class _Event:
    """A CUDA event stand-in. ``record`` waits for the queued ops, then reads the clock."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, **kwargs) -> None:
        self._time: float | None = None

    def record(self, stream=None) -> None:
        _synchronize()
        self._time = time.perf_counter()

    def synchronize(self) -> None:
        return None

    def wait(self, stream=None) -> None:
        return None

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event: _Event) -> float:
        """Milliseconds between this event's ``record`` and ``end_event``'s."""
        if self._time is None or end_event._time is None:
            raise RuntimeError("both events must be recorded before elapsed_time")
        return (end_event._time - self._time) * 1000.0


def _current_stream(device=None) -> _Stream:
    _check_index(device)
    return _DEFAULT_STREAM


def _stream(stream=None):
    return contextlib.nullcontext(stream)


class _DeviceContext:
    """``with torch.cuda.device(0):``: there is only one device, so nothing changes."""

    def __init__(self, device) -> None:
        _check_index(device)

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None


_CUDA_FUNCTIONS: dict[str, Any] = {
    "is_available": _is_available,
    "is_initialized": _true,
    "init": _no_op,
    "_is_in_bad_fork": _false,
    "device_count": _device_count,
    "current_device": _current_device,
    "set_device": _set_device,
    "device": _DeviceContext,
    "get_device_name": _get_device_name,
    "get_device_capability": _get_device_capability,
    "get_device_properties": _get_device_properties,
    "synchronize": _synchronize,
    "manual_seed": _manual_seed,
    "manual_seed_all": _manual_seed,
    "seed": _seed,
    "seed_all": _seed,
    "get_rng_state": _get_rng_state,
    "get_rng_state_all": _get_rng_state_all,
    "set_rng_state": _set_rng_state,
    "set_rng_state_all": _set_rng_state_all,
    "memory_allocated": _memory_allocated,
    "max_memory_allocated": _max_memory_allocated,
    "memory_reserved": _memory_reserved,
    "max_memory_reserved": _max_memory_allocated,
    "memory_cached": _memory_reserved,
    "max_memory_cached": _max_memory_allocated,
    "reset_peak_memory_stats": _reset_peak_memory_stats,
    "reset_max_memory_allocated": _reset_peak_memory_stats,
    "reset_accumulated_memory_stats": _no_op,
    "empty_cache": _empty_cache,
    "ipc_collect": _no_op,
    "set_per_process_memory_fraction": _no_op,
    "mem_get_info": _mem_get_info,
    "memory_stats": _memory_stats,
    "memory_summary": _memory_summary,
    "is_bf16_supported": _true,
    "is_current_stream_capturing": _false,
    "Stream": _Stream,
    "Event": _Event,
    "current_stream": _current_stream,
    "default_stream": _current_stream,
    "stream": _stream,
}


# --- 3. autocast, DataLoader pinning, torch.load -------------------------------------------


def _autocast_init(original: Callable) -> Callable:
    def __init__(self, device_type, *args, **kwargs):
        if device_type == "cuda":
            device_type = NAME
        original(self, device_type, *args, **kwargs)

    __init__.__wrapped__ = original
    return __init__


def _device_context_init(original: Callable) -> Callable:
    """``torch.set_default_device("cuda")`` and ``with torch.device("cuda"):`` mean cumulus.

    Their mode sits at the bottom of the mode stack, below this module's, so the device it
    adds to factory calls must already be the right one.
    """

    def __init__(self, device):
        original(self, device)
        if self.device.type == "cuda":
            self.device = _redirect(self.device)

    __init__.__wrapped__ = original
    return __init__


def _load(original: Callable) -> Callable:
    """``torch.load`` that lands CUDA-bound tensors on ``cumulus`` instead of a local GPU."""

    def load(f, map_location=None, *args, **kwargs):
        moved: set[int] = set()
        restore = _cuda_restore(map_location, moved)
        if restore is None:
            return original(f, map_location, *args, **kwargs)
        result = original(f, restore, *args, **kwargs)
        return _move_loaded(result, moved) if moved else result

    load.__wrapped__ = original
    return load


def _cuda_restore(map_location, moved: set[int]) -> Callable | None:
    """A ``map_location`` keeping CUDA-bound storages on the CPU, noting them in ``moved``.

    ``None`` when ``map_location`` sends nothing to CUDA (or is the caller's own function).
    """
    from torch.serialization import default_restore_location

    def keep(storage):
        moved.add(storage.data_ptr())
        return storage

    if map_location is None:
        return lambda storage, location: keep(storage) if location.startswith("cuda") else None
    if isinstance(map_location, (str, torch.device)):
        if not str(map_location).startswith("cuda"):
            return None
        return lambda storage, location: keep(storage)
    if isinstance(map_location, dict):

        def restore(storage, location):
            target = str(map_location.get(location, location))
            if target.startswith("cuda"):
                return keep(storage)
            return default_restore_location(storage, target)

        return restore
    return None


def _move_loaded(obj: Any, moved: set[int]) -> Any:
    """Move the tensors of a loaded object whose storage was CUDA-bound onto ``cumulus``.

    Walks dicts, lists and tuples (state dicts, checkpoints); tensors inside other objects
    stay on the CPU, where cumulus ops still accept them as operands.
    """
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "cpu" or obj.untyped_storage().data_ptr() not in moved:
            return obj
        _require_session()
        remote = obj.detach().to(_device())
        if isinstance(obj, torch.nn.Parameter):
            return torch.nn.Parameter(remote, requires_grad=obj.requires_grad)
        return remote.requires_grad_(obj.requires_grad)
    if isinstance(obj, dict):
        for key, value in obj.items():
            obj[key] = _move_loaded(value, moved)
        return obj
    if isinstance(obj, list):
        obj[:] = [_move_loaded(v, moved) for v in obj]
        return obj
    if isinstance(obj, tuple):
        items = [_move_loaded(v, moved) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj
