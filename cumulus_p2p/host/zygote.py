"""Workers forked from one process that imported torch once, instead of exec'd afresh.

Why: a fresh worker spends about 2.4 CPU seconds importing torch and the worker module
(5 to 10 s of wall clock on a busy two-core machine) before it can take a session, and
holds its own copy of their pages. A fork of a process that imported them starts in a
few hundredths of a second and shares those pages with its siblings.

The zygote keeps the worker's secrets rule (``supervisor``: nothing of the node's memory
in a process that runs tenant code). It is exec'd fresh, with the workers' environment
and in their sandbox (the same ``unshare`` prefix), imports torch and the worker, and
from then on only forks. It never sees a key: each worker's link and session arrive on
the worker's own descriptors, after the fork.

Protocol, on a ``SOCK_SEQPACKET`` socket pair (one JSON message per packet):

- zygote → supervisor: ``["ready"]`` once it has imported what the workers need;
- supervisor → zygote: the worker's arguments, with the descriptors they name attached
  (``SCM_RIGHTS``) and listed as ``{"args": [...], "fds": [n, ...]}``; the child gets
  each descriptor under the number the supervisor gave it, as ``pass_fds`` would;
- zygote → supervisor: ``["started", pid]`` for each fork, in order, and
  ``["exited", pid, status]`` when it reaps one (``status`` as ``Popen.returncode``).

The zygote dies with the supervisor (``PR_SET_PDEATHSIG``), and its workers with it: a
worker's parent is the zygote, and ``--parent`` names it. The supervisor's end
(``Zygote``) gives the parts of ``subprocess.Popen`` the supervisor uses.
"""

from __future__ import annotations

import argparse
import array
import contextlib
import ctypes
import fcntl
import json
import os
import select
import signal
import socket
import subprocess
import sys
import traceback
from collections.abc import Sequence

import trio

#: The largest message either way: a worker's arguments carry its spec as JSON.
MAX_MESSAGE = 1 << 16
#: Descriptors a worker gets at most (its link, the blob directory, its turn flag).
MAX_FDS = 8
_PR_SET_PDEATHSIG = 1


class ForkedWorker:
    """A worker the zygote forked: ``pid``, ``returncode``, ``poll``, ``kill`` as
    ``Popen``'s, and ``exited``, set once the zygote reaped it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.exited = trio.Event()

    def poll(self) -> int | None:
        return self.returncode

    def kill(self) -> None:
        # Only before the zygote reported it reaped: the pid is still this worker's.
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def _ended(self, status: int) -> None:
        self.returncode = status
        self.exited.set()


class Zygote:
    """The supervisor's end of a zygote process. ``start`` it, run ``serve`` in a
    nursery, then ``fork`` workers; once ``alive`` is false, workers are exec'd again."""

    def __init__(self, process: subprocess.Popen, sock: trio.socket.SocketType) -> None:
        self.process = process
        self.alive = True
        self._sock = sock
        self._forking = trio.Lock()
        self._started_send, self._started = trio.open_memory_channel[int](1)
        self._workers: dict[int, ForkedWorker] = {}

    @classmethod
    async def start(cls, prefix: Sequence[str], env: dict[str, str], timeout: float) -> Zygote:
        """Exec the zygote (under ``prefix``, the sandbox's, if any) and wait until it is
        ready.

        Raises:
            OSError: It could not be started, or it ended or stalled before it was ready.
        """
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        command = [*prefix, sys.executable, "-m", __name__, "--fd", str(theirs.fileno())]
        command += ["--parent", str(os.getpid())]
        try:
            process = subprocess.Popen(
                command, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, env=env
            )
        finally:
            theirs.close()
        zygote = cls(process, trio.socket.from_stdlib_socket(ours))
        why = f"the worker zygote was not ready within {timeout:.0f} s"
        with trio.move_on_after(timeout):
            reply = await zygote._sock.recv(MAX_MESSAGE)
            if reply and json.loads(reply) == ["ready"]:
                return zygote
            why = "the worker zygote exited before it was ready"
        await zygote.aclose()
        raise OSError(f"{why} (status {process.returncode})")

    async def serve(self) -> None:
        """Read the zygote's reports until it is gone (then every worker it forked is)."""
        try:
            while packet := await self._sock.recv(MAX_MESSAGE):
                kind, pid, *status = json.loads(packet)
                if kind == "started":
                    self._workers[pid] = ForkedWorker(pid)
                    await self._started_send.send(pid)
                elif kind == "exited" and pid in self._workers:
                    self._workers.pop(pid)._ended(status[0])
        finally:
            self.alive = False
            self._started_send.close()  # a ``fork`` waiting for its pid hears it is gone
            for worker in self._workers.values():  # they die with it (PR_SET_PDEATHSIG)
                worker._ended(-signal.SIGKILL)
            self._workers.clear()
            with trio.CancelScope(shield=True):
                await self.aclose()

    async def fork(self, args: Sequence[str], fds: Sequence[int]) -> ForkedWorker:
        """A worker running ``python -m cumulus_p2p.host.worker *args``, with ``fds``.

        Raises:
            OSError: The zygote is gone.
        """
        message = json.dumps({"args": list(args), "fds": list(fds)}).encode()
        async with self._forking:
            if not self.alive:
                raise OSError("the worker zygote is gone")
            ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
            await self._sock.sendmsg([message], ancillary)
            try:
                pid = await self._started.receive()
            except trio.EndOfChannel:
                raise OSError("the worker zygote is gone") from None
        return self._workers[pid]

    async def aclose(self) -> None:
        """Stop the zygote (closing its socket ends it, and its workers with it) and
        reap it."""
        self._sock.close()
        with trio.move_on_after(5):
            await trio.to_thread.run_sync(self.process.wait, abandon_on_cancel=True)
        if self.process.poll() is None:
            self.process.kill()
            await trio.to_thread.run_sync(self.process.wait)


# --- the zygote process ------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="cumulus-worker-zygote", description=__doc__.split(",")[0]
    )
    parser.add_argument("--fd", type=int, required=True, help="the supervisor's socket")
    parser.add_argument("--parent", type=int, required=True, help="the supervisor's pid")
    args = parser.parse_args(argv)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != args.parent:
        return 1  # the supervisor died before the backstop was armed
    import torch  # noqa: F401  (what every worker imports first; shared by the forks)

    import cumulus_p2p.host.worker  # noqa: F401

    sock = socket.socket(fileno=args.fd)
    sock.send(json.dumps(["ready"]).encode())
    _serve(sock)
    return 0


def _serve(sock: socket.socket) -> None:
    """Fork a worker per request and report every exit, until the supervisor hangs up."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake the select below
    signal.set_wakeup_fd(wake_w)
    while True:
        readable, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in readable:
            os.read(wake_r, 512)
        _report_exits(sock)
        if sock in readable:
            message, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, MAX_FDS)
            if not message:
                return  # the supervisor is gone
            request = json.loads(message)
            pid = os.fork()
            if pid == 0:
                try:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    sock.close()
                    os.close(wake_r)
                    os.close(wake_w)
                    _run_worker(request["args"], fds, request["fds"])
                finally:
                    os._exit(1)  # never back into the zygote's loop
            for fd in fds:
                os.close(fd)
            sock.send(json.dumps(["started", pid]).encode())


def _report_exits(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock.send(json.dumps(["exited", pid, os.waitstatus_to_exitcode(status)]).encode())


def _run_worker(args: list[str], received: list[int], wanted: list[int]) -> None:
    """In the child: put each descriptor under the number its arguments name, run the
    worker, and exit with its status."""
    # Out of the way first, so that no wanted number is taken by another received one.
    above = max(wanted, default=0) + 1
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, above) for fd in received]
    for fd in received:
        os.close(fd)
    for fd, number in zip(moved, wanted, strict=True):
        os.dup2(fd, number)
        os.close(fd)
    from cumulus_p2p.host import worker

    try:
        status = worker.main(args)
    except BaseException:
        traceback.print_exc()
        status = 1
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
