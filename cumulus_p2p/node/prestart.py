"""The script's interpreter, started before its lease: it imports torch while the node
matches, and runs the script once the node hands it the session's environment.

Why: a consumer's script is ``python -m cumulus_p2p.shim train.py``, and before its
first line it spends seconds importing torch (2 CPU seconds here; 5 to 10 s of wall
clock on a busy two-core machine). The node knows the command at start-up but not the
environment the script needs (its control channel and token exist only once a host has
leased). Measured on a loopback mesh, fresh processes, five jobs each: from starting
``cumulus-node --consume`` to the script's first line, 3.05 s (median) against 3.70.
So at start-up, while the process is still one thread, the node forks a child that
imports what the script will import first, then waits on a pipe. When the lease is
held, ``start`` writes the environment down the pipe and the child becomes
``python -m MODULE ARGS`` in every way a script can see: its own environment, argv,
``sys.path[0]`` (the working directory, as ``-m`` sets it), ``__main__``, a clean
``atexit`` list and the interpreter's exit rules (threads joined, ``atexit`` run, a
traceback and status 1 for an uncaught exception, ``SystemExit``'s status).

The child is the node's own, so it stays what ``subprocess.Popen`` gave before: the
node's only child, signalled and reaped by pid, and the parent whose death the shim's
``PR_SET_PDEATHSIG`` watches. A child never started (no host matched, the node was
stopped) is killed before it ran anything of the script's; one whose node died reads the
pipe's end and exits quietly.

It forks only at start-up: a fork of a process running threads (trio's workers,
libp2p's) could copy a lock some other thread held. Where that is not possible, or the
command is not ``python -m MODULE``, the node starts a fresh interpreter as before.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import runpy
import signal
import sys
import threading
import traceback
from collections.abc import Iterator, Mapping, Sequence

#: What a script under the shim imports first (the shim's own imports; the device
#: module is the caller's to add): imported in the child while it waits. Not the shim
#: itself: the module run as ``__main__`` must not be imported before (runpy warns, and
#: its code would run twice). Not torch._dynamo, which ``torch.optim`` imports at an
#: optimizer's first step: on two cores its 1.5 CPU seconds slowed the node's own start,
#: and a script without an optimizer then started 0.5 s later than with no prestart.
SHIM_IMPORTS = ("torch", "cumulus_p2p.node.control")


class PrestartedScript:
    """``python -m MODULE ARGS`` forked ahead of its environment (module docstring).

    The parts of ``subprocess.Popen`` the node uses once it has started: ``pid``,
    ``poll``, ``wait``, ``send_signal``, ``kill`` and ``returncode``.
    """

    def __init__(self, pid: int, pipe: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._pipe: int | None = pipe
        # One waitpid at a time: ``wait`` may block in a worker thread while ``poll`` runs.
        self._waiting = threading.Lock()

    @classmethod
    def fork(cls, argv: Sequence[str], imports: Sequence[str] = ()) -> PrestartedScript | None:
        """Fork the child that will run ``argv`` (``[sys.executable, "-m", MODULE, *ARGS]``)
        and import ``imports`` in it now. Call it only while this process runs one thread.

        Returns:
            None where this cannot be done: another command, a platform without ``fork``,
            or other threads running.
        """
        argv = list(argv)
        if len(argv) < 3 or argv[:2] != [sys.executable, "-m"] or not hasattr(os, "fork"):
            return None
        if threading.active_count() > 1:
            return None
        read_end, write_end = os.pipe()
        for stream in (sys.stdout, sys.stderr):  # else the child would print them again
            stream.flush()
        # SIGINT is held until the child ignores it: Python's handler, inherited, would
        # raise KeyboardInterrupt in the child's copy of this frame.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            pid = os.fork()
            if pid == 0:
                try:
                    os.close(write_end)
                    _child(read_end, argv[2], argv[3:], imports, mask)
                finally:  # never back into the node's code, whatever went wrong
                    os._exit(1)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        os.close(read_end)
        return cls(pid, write_end)

    def start(self, env: Mapping[str, str]) -> PrestartedScript:
        """Run the command with environment ``env`` (the whole of it, as ``Popen``'s)."""
        if self._pipe is None:
            raise RuntimeError("this script was already started or dropped")
        pipe, self._pipe = self._pipe, None
        try:
            with open(pipe, "wb") as stream:
                stream.write(json.dumps(dict(env)).encode())
        except BrokenPipeError:
            pass  # the child is gone already: ``wait`` says how it ended
        return self

    def drop(self) -> None:
        """The script will not run: the child, which has run nothing of the script's, is
        killed (it may be importing torch) and reaped."""
        if self._pipe is not None:
            # Killed before its pipe closes: the end of the pipe would have it exit by
            # itself, which a loaded machine let it do first (status 0, not SIGKILL).
            self.kill()
            os.close(self._pipe)
            self._pipe = None
            self.wait()

    def poll(self) -> int | None:
        if self.returncode is None and self._waiting.acquire(blocking=False):
            try:
                if self.returncode is None:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                    if pid:
                        self.returncode = os.waitstatus_to_exitcode(status)
            finally:
                self._waiting.release()
        return self.returncode

    def wait(self) -> int:
        with self._waiting:
            if self.returncode is None:
                _, status = os.waitpid(self.pid, 0)
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        # Not once reaped: the pid could belong to another process by then.
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


@contextlib.contextmanager
def prestarted(
    argv: Sequence[str], imports: Sequence[str] = ()
) -> Iterator[PrestartedScript | None]:
    """``PrestartedScript.fork`` for the span of a node's run: a child never started is
    dropped at the end."""
    script = PrestartedScript.fork(argv, imports)
    try:
        yield script
    finally:
        if script is not None:
            script.drop()


def _child(pipe: int, module: str, args: list[str], imports: Sequence[str], mask: set[int]) -> None:
    """In the forked child: import ``imports``, wait for the environment, run the module
    as ``python -m`` would, and exit as the interpreter would. Never returns."""
    # Ctrl-C at the terminal reaches the whole process group: while the node matches it
    # is the node's to handle (it stops, and the pipe closes).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    atexit._clear()  # the node's exit handlers are not the script's
    for name in imports:
        if name == module:
            continue  # run as ``__main__`` below: imported first, it would run twice
        with contextlib.suppress(Exception):  # the script's own import will say what failed
            __import__(name)
    with open(pipe, "rb") as stream:
        message = stream.read()
    if not message:
        os._exit(0)
    env = json.loads(message)
    os.environ.clear()
    os.environ.update(env)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = [module, *args]
    sys.path[0] = os.getcwd()
    status = _run_module(module)
    _exit(status)


def _run_module(module: str) -> int | None:
    """Run ``module`` as ``__main__``; returns the exit status, or None after an
    uncaught ``KeyboardInterrupt`` (the interpreter then dies of SIGINT)."""
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        traceback.print_exc()
        return None
    except BaseException:
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


def _exit(status: int | None) -> None:
    """End the process as the interpreter ends: threads joined, ``atexit`` run, streams
    flushed; a ``KeyboardInterrupt`` ends it by SIGINT, as it ends ``python``."""
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if status is None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(status if status is not None else 130)
