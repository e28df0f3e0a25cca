"""Start ``python -m MODULE`` and ``python SCRIPT`` as forks of a server that has already
imported torch and libp2p, for the test suite.

Why: a test mesh starts its nodes and executors as processes of their own, and each
fresh interpreter spends 2 to 4 CPU seconds importing torch (about 2), libp2p (about 1)
and Cumulus before it does anything. Measured over the whole suite, those imports were
more than half of its CPU time on two cores. A fork of a process that imported them
once starts in a few hundredths of a second.

What a test gets is still a real process running the real entry point: its own pid,
sockets, signals and exit status, its output on a pipe. Only the parent differs: it is
the fork server (Python's ``multiprocessing`` forkserver, with torch preloaded), not
the test. ``popen`` answers with a ``subprocess.Popen`` when it cannot keep that
promise: a command that is not this interpreter running a module or a script, or fork
starts turned off (``CUMULUS_FORK_START`` unset or not ``1`` in the environment the
command is given: the demo and the benchmarks start fresh interpreters, as a user's
machine does, and so does a test that checks what a fresh node imports).

Two things a fresh interpreter reads at start-up are read again here: the environment
(replaced whole in the child) and ``OMP_NUM_THREADS`` (OpenMP read it when the server
loaded torch, so the child sets torch's thread count from it).
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.connection
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO

#: Set to ``1`` (``tests/conftest.py`` does) to start the commands ``popen`` can as forks.
ENV_SWITCH = "CUMULUS_FORK_START"
#: What the server imports once, before it forks anything: what a node, an executor or a
#: worker would import first thing. And torch._dynamo: a consumer node's script is forked
#: from the node (``node.prestart``), and imports it at its optimizer's first step.
PRELOAD = [
    "torch",
    "torch._dynamo",
    "libp2p",
    "trio",
    "cumulus_p2p.cli",
    "cumulus_p2p.node.provider",
    "cumulus_p2p.node.consumer",
    "cumulus_p2p.node.job",
    "cumulus_p2p.host.executor_main",
]

_context = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload(PRELOAD)
_started: list[ForkedProcess] = []


class ForkedProcess:
    """The part of ``subprocess.Popen`` the test helpers use, for a forked child."""

    def __init__(
        self,
        args: list[str],
        process,
        stdout: IO[str] | None,
        stderr: IO[str] | None,
        stdin: IO[str] | None = None,
    ) -> None:
        self.args = args
        self.stdin = stdin
        self.stdout = stdout
        self.stderr = stderr
        self._process = process
        self.pid: int = process.pid
        self._read: dict[str, str] = {}
        self._readers: list[threading.Thread] = []

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self._process.exitcode

    def communicate(self, timeout: float | None = None) -> tuple[str | None, str | None]:
        """Read the piped streams to their ends and wait for the exit, as ``Popen``'s:
        after a ``TimeoutExpired``, ``kill`` and call it again for what was printed."""
        if not self._readers:
            for name in ("stdout", "stderr"):
                if getattr(self, name) is not None:
                    reader = threading.Thread(target=self._drain, args=(name,), daemon=True)
                    reader.start()
                    self._readers.append(reader)
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in self._readers:
            reader.join(_left(deadline))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        self.wait(_left(deadline))
        return self._read.get("stdout"), self._read.get("stderr")

    def _drain(self, name: str) -> None:
        with getattr(self, name) as stream:
            self._read[name] = stream.read()

    def send_signal(self, sig: int) -> None:
        # Only a child not yet reaped: its pid cannot have gone to another process.
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def popen(
    command: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    stdout: int | IO | None = None,
    stderr: int | IO | None = None,
    stdin: int | None = None,
    text: bool = False,
) -> ForkedProcess | subprocess.Popen:
    """Start ``command`` as ``subprocess.Popen(command, env=..., cwd=..., stdout=...,
    stderr=..., stdin=..., text=...)`` would, as a fork of the preloaded server where it
    can (module docstring).

    ``stdout`` and ``stderr`` may be ``subprocess.PIPE`` or a file; ``stderr`` also
    ``subprocess.STDOUT``. ``stdin`` may be ``subprocess.PIPE``; by default the child's
    standard input is ``/dev/null``.
    """
    command = list(command)
    environ = dict(os.environ if env is None else env)
    entry = _entry(command)
    if environ.get(ENV_SWITCH) != "1" or entry is None or not text:
        return subprocess.Popen(
            command, env=env, cwd=cwd, stdout=stdout, stderr=stderr, stdin=stdin, text=text
        )
    if stdin not in (None, subprocess.PIPE):
        raise ValueError("forkstart.popen: stdin may only be subprocess.PIPE or None")
    in_read, in_write = os.pipe() if stdin == subprocess.PIPE else (None, None)
    out_fd, out_read = _child_end(stdout, 1)
    if stderr == subprocess.STDOUT:
        err_fd, err_read = os.dup(out_fd), None
    else:
        err_fd, err_read = _child_end(stderr, 2)
    out, err = (
        multiprocessing.connection.Connection(out_fd),
        multiprocessing.connection.Connection(err_fd),
    )
    inp = None if in_read is None else multiprocessing.connection.Connection(in_read)
    where = None if cwd is None else os.fspath(cwd)
    process = _context.Process(
        target=_run, args=(entry, environ, where, out, err, inp), daemon=False
    )
    try:
        process.start()
    finally:
        for end in (out, err, inp):
            if end is not None:
                end.close()
    streams = [open(end) if end is not None else None for end in (out_read, err_read)]
    writer = None if in_write is None else open(in_write, "w")
    child = ForkedProcess(command, process, *streams, stdin=writer)
    _started.append(child)
    return child


def run(
    command: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    timeout: float | None = None,
    check: bool = False,
) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True, ...)``, forked where
    ``popen`` would fork it."""
    child = popen(
        command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        raise
    done = subprocess.CompletedProcess(list(command), child.wait(), out, err)
    if check:
        done.check_returncode()
    return done


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _child_end(stream: int | IO | None, default: int) -> tuple[int, int | None]:
    """The descriptor the child writes ``stream`` to, and the end to read it from (a pipe's,
    for ``subprocess.PIPE``; else None). The parent closes the first once it is passed."""
    if stream == subprocess.PIPE:
        read_end, write_end = os.pipe()
        return write_end, read_end
    if stream is None:
        return os.dup(default), None
    return os.dup(stream if isinstance(stream, int) else stream.fileno()), None


def _entry(command: list[str]) -> tuple[str, str, list[str]] | None:
    """``("-m", module, args)`` or ``("", script, args)``; None for anything else."""
    if len(command) < 2 or command[0] != sys.executable:
        return None
    if command[1] == "-m" and len(command) >= 3:
        return "-m", command[2], command[3:]
    if command[1].endswith(".py"):
        return "", command[1], command[2:]
    return None


def _run(
    entry: tuple[str, str, list[str]], environ: dict[str, str], cwd: str | None, out, err, inp
) -> None:
    """In the child: become the command ``entry`` parsed (its streams, environment and
    arguments) and run it.
    ``SystemExit`` and exceptions end the process as they would end ``python``, after its
    ``atexit`` handlers."""
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    out.close()
    err.close()
    if inp is not None:  # multiprocessing gave the child /dev/null: a pipe replaces it
        os.dup2(inp.fileno(), 0)
        inp.close()
        sys.stdin = open(0, closefd=False)
    run_entry(entry, environ, cwd)


#: The globals of the script a fork ran (``run_entry``), never torn down.
_MAIN_GLOBALS: list[dict] = []


def run_entry(entry: tuple[str, str, list[str]], environ: dict[str, str], cwd: str | None) -> None:
    """In a forked child whose streams are in place: take ``environ`` and ``cwd``, and run
    ``entry`` (as ``_entry`` parses it) as ``__main__``, then the ``atexit`` handlers."""
    os.environ.clear()
    os.environ.update(environ)
    if cwd is not None:
        os.chdir(cwd)
    threads = environ.get("OMP_NUM_THREADS")
    if threads:
        import torch

        torch.set_num_threads(int(threads))
    kind, target, args = entry
    sys.argv = [target, *args]
    try:
        # The script's globals are kept to the end: the fork ends with ``os._exit``, as a
        # ``python`` process ends without tearing down its ``__main__``. Dropped here,
        # their C++ destructors ran in a fork of a process that had started torch's
        # threads, and one torchrun DDP job in five hung there for good (a rank at the
        # end of its script, in no Python frame).
        if kind == "-m":
            sys.path.insert(0, os.getcwd())  # as ``python -m`` puts it first
            _MAIN_GLOBALS.append(runpy.run_module(target, run_name="__main__", alter_sys=True))
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            _MAIN_GLOBALS.append(runpy.run_path(target, run_name="__main__"))
    finally:
        # The interpreter runs them at exit; a forked child ends with ``os._exit``.
        atexit._run_exitfuncs()


@atexit.register
def _kill_leftovers() -> None:
    # The server's children are not this process's: one a test left running would outlive
    # the test session (and multiprocessing would wait for it at exit).
    for child in _started:
        child.kill()
        child._process.join(5)
