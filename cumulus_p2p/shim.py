"""Run a user's PyTorch script with the ``cumulus`` device attached.

``cumulus-node --consume [requirements] -- python train.py [args]`` runs the script as::

    python -m cumulus_p2p.shim [--no-cuda-compat] [--native] train.py [args...]
    python -m cumulus_p2p.shim [--no-cuda-compat] [--native] -m package.module [args...]

The shim attaches the session the environment describes (``connect``), turns on CUDA
compatibility mode (``cumulus_p2p.cuda_compat``) unless told not to, and runs the
script as ``__main__`` the way ``python train.py`` would: ``sys.argv`` is
``[train.py, args...]`` and the script's directory comes first on ``sys.path``. Whatever
way the script ends (returning, ``sys.exit``, an exception, Ctrl-C, SIGTERM), the session
is detached, so the executor releases the script's remote memory at once rather than
holding it for a consumer that might come back.

With ``--native`` the script runs on the native C++ device instead
(``cumulus_p2p.native``; ``connect_native``): eager ops cost what a CPU tensor's do on
this side, and the host replays each batch in C++. A leased session that loses its host
is rebuilt on another from its last checkpoint (on a standby host, or this machine's
disk) and the batches sent since (``native.checkpoint``, ``native.replaylog``). CUDA
compatibility mode works on it as on the Python device.

Exit status: the script's own (an uncaught exception prints its traceback and exits 1, as
in plain Python; SIGTERM exits 143); 2 when the shim cannot start the script: a bad command
line, no session described in the environment, or an executor that cannot be reached.

Under ``cumulus-node --consume`` the script lives and dies with its node: when the node
is gone (killed, crashed), the shim stops the script (``_stop_when_node_is_gone``).

Environment:
    CUMULUS_CONTROL, CUMULUS_CONTROL_TOKEN: set by ``cumulus-node --consume``: the node's
        control channel, which hands over the leased session and finds a new host on
        failover (see ``cumulus_p2p.node.control``).
    CUMULUS_EXECUTOR: otherwise, ``host:port`` of an executor reachable over plain TCP;
        for a job of several ranks (``torchrun -m cumulus_p2p.shim train.py``), one per
        rank, comma separated, each rank taking the one at its ``LOCAL_RANK``. Run
        without a launcher (no ``LOCAL_RANK``), a process attaches every one of them,
        as its devices ``cumulus:0`` to ``cumulus:N-1``. A rank's
        entry may name executors to fail over to after its own, ``|`` between them
        (``a:1|c:3,b:2|c:3``): then the session fails over (checkpoints every
        ``CUMULUS_CHECKPOINT_INTERVAL`` seconds, 30 by default, kept in this process), to
        the first of them that answers, its own first.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import runpy
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ._errors import CumulusError, SessionClosedError
from .node import control

if TYPE_CHECKING:  # the native device cannot share a process with the Python one
    from .native.session import NativeSession
    from .remote.client import RemoteSession

#: ``host:port`` of a plain-TCP executor.
ENV_EXECUTOR = "CUMULUS_EXECUTOR"
EXIT_CANNOT_START = 2
#: Seconds a script whose node is gone has to end after SIGTERM.
STOP_GRACE_S = 10.0
_PR_SET_PDEATHSIG = 1
USAGE = (
    "usage: python -m cumulus_p2p.shim [--no-cuda-compat] [--native] script.py [args...]\n"
    "       python -m cumulus_p2p.shim [--no-cuda-compat] [--native] -m package.module [args...]"
)


def connect(environ: Mapping[str, str]) -> RemoteSession:
    """Attach the session the environment describes as the ``cumulus`` device; return it.

    The one place that knows how the node hands a session to the script's process: the
    consumer node's control channel (a leased provider over the secure channel, with
    failover), or ``CUMULUS_EXECUTOR=host:port``, an executor over plain TCP.

    Args:
        environ: the environment to read (``os.environ`` in the shim).

    Raises:
        SessionClosedError: nothing in ``environ`` says where the session is, or the executor
            cannot be reached or refuses the session.
    """
    from . import remote

    if _leased(environ):
        controls = _controls(environ)
        if len(controls) > 1:
            return _connect_leased_devices(controls, environ[control.ENV_TOKEN])
        return _connect_leased(environ)
    if _devices_of_one_process(environ):
        return _attach_devices(environ[ENV_EXECUTOR].split(","))
    address, *spares = _executor_address(environ).split("|")
    failover: dict = {}
    try:
        if "|" in environ[ENV_EXECUTOR]:  # every rank must go back when one host is lost
            interval = float(environ.get("CUMULUS_CHECKPOINT_INTERVAL", "30"))
            reconnect = _first_answering([address, *spares])
            failover = {"reconnect": reconnect, "checkpoint_interval": interval}
        return remote.attach(address, **failover).session
    except (OSError, ValueError, CumulusError) as exc:
        raise SessionClosedError(f"cannot attach to the executor at {address}: {exc}") from exc


def _devices_of_one_process(environ: Mapping[str, str]) -> bool:
    """Whether ``CUMULUS_EXECUTOR`` names several executors for a process no launcher
    started: they are its devices, ``cumulus:0`` to ``cumulus:N-1``."""
    return "LOCAL_RANK" not in environ and "," in environ.get(ENV_EXECUTOR, "")


def _attach_devices(addresses: list[str]) -> RemoteSession:
    from . import remote

    if any("|" in address for address in addresses):
        raise SessionClosedError(
            f"{ENV_EXECUTOR} names spares ('|') for several devices of one process: "
            "failover is for one device per process yet; drop the spares"
        )
    try:
        return remote.attach(addresses).session
    except (OSError, ValueError, CumulusError) as exc:
        raise SessionClosedError(f"cannot attach to the executors {addresses}: {exc}") from exc


def _first_answering(addresses: list[str]):
    """A ``reconnect`` for plain-TCP executors: a channel to the first that answers.

    Raises:
        ValueError: an address is not ``host:port``, or ``CUMULUS_SILENCE_S`` is not
            seconds (now, not at the first failover).
    """
    from .channel.transport import SocketFrameChannel, fell_silent_within, silence_limit
    from .remote import host_port

    dialled = [host_port(address) for address in addresses]
    silence_s = silence_limit()

    def reconnect():
        failures = []
        # A host that hangs still accepts connections: the others first.
        places = list(zip(addresses, dialled, strict=True))
        places.sort(key=lambda place: fell_silent_within(*place[1], 10 * silence_s))
        for address, (host, port) in places:
            try:
                return SocketFrameChannel.connect(host, port, silence_s=silence_s)
            except OSError as exc:
                failures.append(f"{address}: {exc}")
        raise OSError(f"no executor answers: {'; '.join(failures)}")

    return reconnect


def connect_native(environ: Mapping[str, str]) -> NativeSession:
    """As ``connect``, for the native device: load it and open its session with the
    host the environment describes (a leased one over the secure channel, without
    failover; or ``CUMULUS_EXECUTOR``).

    Raises:
        SessionClosedError: as ``connect``; also when the native device cannot be built
            here (the message names what to install).
    """
    from . import native

    try:
        native.load()  # before the script's first backward: autograd sizes its queues once
    except RuntimeError as exc:
        raise SessionClosedError(str(exc)) from exc
    from .native.session import NativeSession

    if _leased(environ):
        from .node.native_attach import attach_native_leased

        try:
            return attach_native_leased(_control_client(environ))
        except (OSError, ValueError, CumulusError) as exc:
            raise SessionClosedError(f"cannot open the leased native session: {exc}") from exc
    address = _executor_address(environ).split("|")[0]  # the native device: no failover
    host, _, port = address.rpartition(":")
    try:
        return NativeSession.connect(host, int(port))
    except (OSError, ValueError, CumulusError) as exc:
        raise SessionClosedError(
            f"cannot open a native session with the executor at {address}: {exc}"
        ) from exc


def _leased(environ: Mapping[str, str]) -> bool:
    return bool(environ.get(control.ENV_ADDRESS) and environ.get(control.ENV_TOKEN))


def _control_client(environ: Mapping[str, str]) -> control.ControlClient:
    return control.ControlClient(_control_address(environ), environ[control.ENV_TOKEN])


def _control_address(environ: Mapping[str, str]) -> str:
    """This rank's control address (``_leased`` says there is one).

    Raises:
        SessionClosedError: the node leased fewer GPUs than the launcher ran ranks.
    """
    try:
        address = control.address_for_rank(environ)
    except CumulusError as exc:
        raise SessionClosedError(str(exc)) from exc
    assert address is not None
    return address


def _executor_address(environ: Mapping[str, str]) -> str:
    address = environ.get(ENV_EXECUTOR)
    if not address:
        raise SessionClosedError(
            f"no cumulus session to attach: {ENV_EXECUTOR} is not set. Run the script with "
            f"`cumulus-node --consume ... -- python script.py`, or set {ENV_EXECUTOR}=host:port "
            "of a running `cumulus-executor`."
        )
    # One address per rank of a job (``host:port,host:port``): each rank's process
    # attaches to its own, by the LOCAL_RANK its launcher gave it.
    own = control.this_ranks(address, environ)
    if own is None:
        raise SessionClosedError(
            f"{ENV_EXECUTOR} names {len(address.split(','))} executors and this is rank "
            f"{environ.get('LOCAL_RANK')!r}: name one executor per rank, in rank order"
        )
    return own


def _controls(environ: Mapping[str, str]) -> list[str]:
    """The control addresses of this process's leases (``_leased`` says it has some):
    its rank's in a torchrun job; every one for a process no launcher started, whose
    devices they are."""
    if "LOCAL_RANK" in environ:
        return [_control_address(environ)]
    return environ[control.ENV_ADDRESS].split(",")


def _connect_leased_devices(controls: list[str], token: str) -> RemoteSession:
    """The sessions the node leased for this process's devices, ``cumulus:0`` up."""
    from .node.attach import attach_leased_devices

    try:
        clients = [control.ControlClient(address, token) for address in controls]
        return attach_leased_devices(clients).session
    except (OSError, ValueError, CumulusError) as exc:
        raise SessionClosedError(f"cannot open the leased sessions: {exc}") from exc


def _connect_leased(environ: Mapping[str, str]) -> RemoteSession:
    """The session ``cumulus-node --consume`` leased for this process, with failover."""
    from .node.attach import attach_leased

    try:
        return attach_leased(_control_client(environ)).session
    except (OSError, ValueError, CumulusError) as exc:
        raise SessionClosedError(f"cannot open the leased session: {exc}") from exc


def run(
    target: str,
    args: Sequence[str] = (),
    *,
    module: bool = False,
    cuda_compat: bool = True,
    native: bool = False,
    environ: Mapping[str, str] | None = None,
) -> None:
    """Attach, run ``target`` as ``__main__``, detach.

    Args:
        target: the script's path, or with ``module=True`` a module name (as ``python -m``).
        args: the script's arguments (``sys.argv[1:]`` as it sees them).
        module: run ``target`` as a module instead of a file.
        cuda_compat: turn on CUDA compatibility mode while the script runs.
        native: run on the native device (``connect_native``).
        environ: where ``connect`` reads the session from (default ``os.environ``).

    Raises:
        SessionClosedError: from ``connect``; the script did not run.
        BaseException: whatever the script raises, ``SystemExit`` included, unchanged.
    """
    command = _Command(target, list(args), module, cuda_compat, native)
    environ = os.environ if environ is None else environ
    session = connect_native(environ) if native else connect(environ)
    _run_attached(session, command)


@dataclass
class _Command:
    """What the shim was asked to run, and how."""

    target: str
    args: list[str]
    module: bool = False
    cuda_compat: bool = True
    native: bool = False


def _run_attached(session: RemoteSession | NativeSession, command: _Command) -> None:
    try:
        with _compat(command), _as_main(command.target, command.args, module=command.module):
            if command.module:
                runpy.run_module(command.target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(command.target, run_name="__main__")
    finally:
        if not command.native:
            from . import remote

            remote.detach()
        session.close()  # in case the script attached a session of its own meanwhile
        _report_final_counts(os.environ)


def _compat(command: _Command) -> contextlib.AbstractContextManager:
    if not command.cuda_compat:
        return contextlib.nullcontext()
    from . import cuda_compat, native

    return cuda_compat.cuda_compat(native.load if command.native else None)


def _report_final_counts(environ: Mapping[str, str]) -> None:
    """Give the node the session's last byte counts: the host's final receipt is
    checked against them after this process has gone."""
    if not _leased(environ):
        return
    from .node.dial import USAGE

    try:
        for address in _controls(environ):  # one per device: each lease's rank is told
            control.report_usage(address, environ[control.ENV_TOKEN], USAGE.snapshot())
    except (OSError, CumulusError) as exc:
        print(
            f"cumulus shim: could not give the node its last byte counts: {exc}",
            file=sys.stderr,
            flush=True,
        )


@contextlib.contextmanager
def _as_main(target: str, args: Sequence[str], *, module: bool) -> Iterator[None]:
    """``sys.argv`` and ``sys.path[0]`` as ``python script.py args`` would set them."""
    saved_argv, saved_path = sys.argv, list(sys.path)
    # run_module fills in argv[0] itself (alter_sys); a file's argv[0] is its path as given.
    sys.argv = [target, *args]
    if not module:
        # `python -m cumulus_p2p.shim` put the working directory first, as `python -m mod`
        # wants; `python script.py` puts the script's directory there instead.
        sys.path[:1] = [os.path.dirname(os.path.abspath(target))]
    try:
        yield
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path


def _parse(argv: Sequence[str]) -> _Command | str:
    """What to run, or the message for a bad command line."""
    flags, i = {"cuda_compat": True, "native": False}, 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--no-cuda-compat":
            flags["cuda_compat"] = False
        elif arg == "--native":
            flags["native"] = True
        elif arg == "--":
            i += 1
            break
        elif arg in ("-h", "--help"):
            return USAGE
        elif arg == "-m":
            if i + 1 >= len(argv):
                return f"-m needs a module name\n{USAGE}"
            return _Command(argv[i + 1], list(argv[i + 2 :]), True, **flags)
        elif arg.startswith("-"):
            return f"unknown option {arg!r}\n{USAGE}"
        else:
            break
        i += 1
    if i >= len(argv):
        return f"no script given\n{USAGE}"
    return _Command(argv[i], list(argv[i + 1 :]), False, **flags)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``python -m cumulus_p2p.shim`` command; returns 0 when the script returns.

    The script's ``SystemExit`` and exceptions propagate, so the interpreter exits with
    the script's own status and prints its traceback.
    """
    parsed = _parse(sys.argv[1:] if argv is None else argv)
    if isinstance(parsed, str):
        print(parsed, file=sys.stdout if parsed == USAGE else sys.stderr)
        return 0 if parsed == USAGE else EXIT_CANNOT_START
    if not parsed.module and not os.path.isfile(parsed.target):
        print(f"cumulus shim: can't open file {parsed.target!r}", file=sys.stderr)
        return EXIT_CANNOT_START
    if not _stop_when_node_is_gone(os.environ):
        print("cumulus shim: the cumulus-node that started this script is gone", file=sys.stderr)
        return EXIT_CANNOT_START
    try:
        session = connect_native(os.environ) if parsed.native else connect(os.environ)
    except SessionClosedError as exc:
        print(f"cumulus shim: {exc}", file=sys.stderr)
        return EXIT_CANNOT_START
    with _sigterm_exits():
        try:
            _run_attached(session, parsed)
        except _Terminated:
            _exit_at_once(128 + signal.SIGTERM)
    return 0


def _stop_when_node_is_gone(environ: Mapping[str, str]) -> bool:
    """Under ``cumulus-node --consume``, stop this process when the node goes.

    A script must not train on a provider with no node left to countersign for it. A
    thread watches the node's control channel; when it closes, the script gets SIGTERM
    (``SystemExit`` through ``_sigterm_exits``) and ``STOP_GRACE_S`` to end before the
    process exits. The kernel's parent-death signal is the backstop (Linux).

    Returns:
        False if the node is already gone (this process outlived it before it could
        watch); True otherwise, also when no node started this process.
    """
    if not _leased(environ):
        return True
    token = environ[control.ENV_TOKEN]
    node_pid = environ.get(control.ENV_NODE_PID)
    if sys.platform.startswith("linux") and node_pid:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        # A rank's parent is its launcher (torchrun), whose parent is the node.
        if int(node_pid) not in (os.getppid(), _parent_of(os.getppid())):
            return False
    from .node.dial import USAGE

    # Each lease's rank at the node takes the byte counts from its own channel.
    for address in _controls(environ):
        watch = threading.Thread(
            target=_watch_node, args=(address, token, USAGE.snapshot), daemon=True
        )
        watch.start()
    return True


def _parent_of(pid: int) -> int | None:
    """The parent of process ``pid`` (Linux's /proc), None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name, in parentheses, may hold spaces: the fields after it are split.
    return int(stat.rpartition(")")[2].split()[1])


def _watch_node(address: str, token: str, usage) -> None:
    how = control.wait_until_node_is_gone(address, token, usage)
    print(
        f"cumulus shim: the cumulus-node running this script is gone: {how}; stopping the script",
        file=sys.stderr,
        flush=True,
    )
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(STOP_GRACE_S)
    os._exit(128 + signal.SIGTERM)  # the script ignored SIGTERM


class _Terminated(SystemExit):
    """SIGTERM, as ``SystemExit(143)``: a script may catch it like any exit."""


@contextlib.contextmanager
def _sigterm_exits() -> Iterator[None]:
    """Turn SIGTERM into ``_Terminated`` so the session is detached, not just dropped.

    A SIGTERM that lands while torch is calling back into Python (an op's dispatch, a
    tensor's ``__del__``) is delivered again 10 ms later, so the exception never unwinds
    through torch's C++. A script may install its own handler (say, to checkpoint before
    a preemption); it replaces this one as usual.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    retrying = threading.Event()

    def exit_(signum, frame):
        if not _inside_a_callback_from_torch(frame):
            raise _Terminated(128 + signum)
        if not retrying.is_set():  # raising here would unwind through torch's C++
            retrying.set()
            threading.Timer(_RETRY_SIGNAL_S, _signal_again, (signum, retrying)).start()

    previous = signal.signal(signal.SIGTERM, exit_)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


#: Python functions torch's C++ calls back into: an exception raised by a signal handler
#: while one of them runs unwinds through C++ frames that do not expect it, and the
#: process aborts ("terminate called without an active exception", seen in 1 of 10
#: SIGTERMs during training). ``__del__`` also swallows exceptions.
_CALLBACKS = frozenset({"__torch_dispatch__", "__torch_function__", "__del__"})
_RETRY_SIGNAL_S = 0.01


def _inside_a_callback_from_torch(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_name in _CALLBACKS:
            return True
        frame = frame.f_back
    return False


def _signal_again(signum: int, retrying: threading.Event) -> None:
    """Deliver ``signum`` again shortly: the script is then most likely between ops."""
    retrying.clear()
    os.kill(os.getpid(), signum)


def _exit_at_once(status: int) -> None:
    """Exit without finalizing the interpreter, once the session is detached.

    SIGTERM can land mid-``backward()``: autograd's device thread may still be running
    Python for the ``cumulus`` device when the main thread exits. Finalizing then ends that
    thread with ``pthread_exit`` through C++ frames, and the process aborted ("terminate
    called without an active exception", status 134) about once in four runs under load.
    Python's own default for SIGTERM skips ``atexit`` too.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
