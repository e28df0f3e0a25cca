"""A ``python`` for programs that start Python processes themselves (torchrun), whose
children are forks of a server that has already imported torch, for the test suite.

Why: ``testing.forkstart`` forks the processes a test starts, but not those its processes
start: torchrun's agent starts each rank as a fresh ``python -u script``, and each spends
3 to 5 CPU seconds importing torch and Cumulus. The suite's torchrun jobs started about
sixty such ranks: a tenth of its CPU.

torchrun runs ranks with ``$PYTHON_EXEC`` where it is set. ``python_exec`` starts the
server (itself a fork start) and returns that variable, naming a small executable: a
stdlib-only client (``forkexec_client.py``, no ``site``, a few hundredths of a second)
that hands the server its arguments, environment, working directory and standard
streams, relays the signals it gets to the fork, and exits as the fork did. A command it
does not know (``python -c ...``, other interpreter flags) runs in a fresh interpreter.

Each rank is still a real process running the real script, with its own pid, sockets and
exit status; only its parent is the server. A fork whose client is killed is killed too.

The server is single-threaded (``selectors``): a fork of a process with threads may
inherit a lock another thread held.
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from cumulus_p2p.testing import forkstart

#: Where the client finds the server: the executable ``python_exec`` names sets it.
SOCKET_VARIABLE = "CUMULUS_FORKEXEC_SOCKET"
_CLIENT = Path(__file__).with_name("forkexec_client.py")
_started: dict[str, str] = {}


def python_exec() -> dict[str, str]:
    """``{"PYTHON_EXEC": path}`` for torchrun's environment: its ranks start as forks of
    this process's server, started on the first call. Empty where fork starts are off
    (``forkstart.ENV_SWITCH``): the ranks then start as fresh interpreters."""
    if os.environ.get(forkstart.ENV_SWITCH) != "1":
        return {}
    if not _started:
        folder = Path(tempfile.mkdtemp(prefix="cumulus-forkexec-"))
        path = folder / "server.sock"
        # A script, not ``-m``: the fork server has imported this module already.
        # forkstart kills it at exit, as it does every fork it started.
        server = forkstart.popen([sys.executable, __file__, str(path)], text=True)
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        _wait_for(path, server)
        wrapper = folder / "python"
        wrapper.write_text(
            "#!/bin/sh\n"
            f"{SOCKET_VARIABLE}='{path}' exec '{sys.executable}' -I -S '{_CLIENT}' \"$@\"\n"
        )
        wrapper.chmod(0o755)
        _started["PYTHON_EXEC"] = str(wrapper)
    return dict(_started)


def _wait_for(path: Path, server: forkstart.ForkedProcess | subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while not path.exists():
        if server.poll() is not None:
            raise RuntimeError(f"the forkexec server exited ({server.returncode})")
        if time.monotonic() > deadline:
            raise TimeoutError("the forkexec server did not listen within 60 s")
        time.sleep(0.05)


def serve(path: str) -> None:
    """Fork a child for each client that connects to the unix socket ``path``; tell the
    client its pid, then its exit status (``Popen.returncode``'s convention)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".partial")
    listener.listen(64)
    os.rename(path + ".partial", path)  # the client connects once it exists
    clients: dict[int, socket.socket] = {}  # pid -> its client's connection
    with selectors.DefaultSelector() as selector:
        selector.register(listener, selectors.EVENT_READ)
        while True:
            for key, _ in selector.select(timeout=0.05):
                if key.fileobj is listener:
                    _accept(listener, clients, selector)
                elif not _still_open(key.fileobj):  # type: ignore[arg-type]
                    # The client is gone (SIGKILL): so goes its fork.
                    selector.unregister(key.fileobj)
                    _kill(key.data)
            _reap(clients, selector)


def _accept(listener: socket.socket, clients: dict[int, socket.socket], selector) -> None:
    """Fork the child the next client asks for and tell the client its pid. A client gone
    or garbled before its request is whole gets no fork; the server serves on."""
    connection, _ = listener.accept()
    try:
        request, fds = _request(connection)
    except (OSError, ValueError):
        connection.close()
        return
    pid = _fork(request, fds, [listener, connection, *clients.values()], selector)
    clients[pid] = connection
    selector.register(connection, selectors.EVENT_READ, pid)
    try:
        connection.sendall(f"pid {pid}\n".encode())
    except OSError:
        pass  # its client is gone: the next select sees the end and kills the fork


def _request(connection: socket.socket) -> tuple[dict, list[int]]:
    """A client's request (its entry, environment and directory) and its three streams."""
    header, fds, _, _ = socket.recv_fds(connection, 4, 3)
    if len(header) != 4 or len(fds) != 3:
        for fd in fds:
            os.close(fd)
        raise ValueError("a request without its header or its three streams")
    size, payload = struct.unpack(">I", header)[0], b""
    while len(payload) < size:
        chunk = connection.recv(size - len(payload))
        if not chunk:
            raise ValueError("a request cut short")
        payload += chunk
    return json.loads(payload), fds


def _still_open(connection: socket.socket) -> bool:
    """Whether the client at the other end is still there (it never writes again)."""
    try:
        return bool(connection.recv(64))
    except OSError:  # a reset: it died with our reply unread
        return False


def _fork(request: dict, fds: list[int], others: list[socket.socket], selector) -> int:
    """Fork the child ``request`` asks for, on the client's streams ``fds``. The child
    closes its copies of the server's sockets (``others``): a script run by a fresh
    ``python`` holds none of them."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        return pid
    code = 1
    try:
        selector.close()
        for other in others:
            other.close()
        for stream, fd in enumerate(fds):
            os.dup2(fd, stream)
            os.close(fd)
        sys.stdin = open(0, closefd=False)  # the server's may have read ahead of its own
        if request["env"].get("PYTHONUNBUFFERED"):
            sys.stdout.reconfigure(write_through=True)  # type: ignore[union-attr]
        kind, target, args = request["entry"]
        forkstart.run_entry((kind, target, args), request["env"], request["cwd"])
        code = 0
    except SystemExit as exit:
        code = _exit_code(exit.code)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _exit_code(code: object) -> int:
    """What ``python`` exits with for ``SystemExit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reap(clients: dict[int, socket.socket], selector) -> None:
    while clients:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        connection = clients.pop(pid, None)
        if connection is None:
            continue
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        try:
            selector.unregister(connection)
        except KeyError:
            pass
        try:
            connection.sendall(f"exit {code}\n".encode())
        except OSError:
            pass
        connection.close()


if __name__ == "__main__":
    serve(sys.argv[1])
