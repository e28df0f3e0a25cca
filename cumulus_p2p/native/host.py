"""A minimal executor process for the native device: replays batches from a TCP socket.

    python -m cumulus_p2p.native.host [--port 0] [--device cpu] [--quota-bytes N]

prints ``listening on HOST:PORT`` once it accepts connections, then serves until it is
killed. Each connection is one session: its own ``Replayer`` (``csrc/replay.cpp``: a
handle table, a quota, the op name table), fed by ``wire.py``'s frames over
``SocketFrameChannel``. Python runs once per frame; the records run in C++ without the
GIL, so sessions on different connections (one thread each) replay side by side.

What this slice leaves out, on purpose: no handshake, authentication or encryption (a
loopback or trusted-LAN test harness only), no failover, checkpoints or parked
sessions, no per-lease quotas or metering, no device scheduler between sessions. The
full executor (``cumulus_p2p.remote.executor``) keeps all of those for the Python
device; bringing them to this loop is later work.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

from .._errors import CumulusError, SessionClosedError
from ..channel.transport import SocketFrameChannel
from . import wire
from .errors import ReplayError
from .executor import DEFAULT_QUOTA, new_replayer

log = logging.getLogger(__name__)


def serve_connection(channel: SocketFrameChannel, device: str, quota_bytes: int) -> None:
    """Run one session until the client says bye or the connection drops."""
    replayer = new_replayer(device, quota_bytes)
    failure: ReplayError | None = None
    try:
        while True:
            kind, reply, names, batch = wire.parse_request(channel.recv_frame())
            if kind == wire.BYE:
                return
            readbacks: list[bytes] = []
            if failure is None:
                try:
                    readbacks = replayer.replay(bytes(batch), names)
                except ReplayError as exc:
                    failure = exc
                    log.info("native session failed: %s", exc)
            if reply:
                channel.send_frame(
                    wire.failed(failure.record, failure.kind, str(failure))
                    if failure is not None
                    else wire.ok(readbacks)
                )
    except SessionClosedError:
        return
    except CumulusError as exc:  # a malformed frame ends this session only
        log.warning("native session ended: %s", exc)
    finally:
        channel.close()


def serve(listener: socket.socket, device: str, quota_bytes: int) -> None:
    """Accept connections forever, one thread (and one session) each."""
    while True:
        conn, _ = listener.accept()
        channel = SocketFrameChannel(conn)
        threading.Thread(
            target=serve_connection, args=(channel, device, quota_bytes), daemon=True
        ).start()


@contextlib.contextmanager
def running_host(
    *, device: str = "cpu", quota_bytes: int = DEFAULT_QUOTA, threads: int = 1
) -> Iterator[tuple[str, int]]:
    """An executor process on a free loopback port, for tests and benchmarks: yields
    (host, port) once it listens, and kills it on exit."""
    command = [sys.executable, "-m", __name__, "--port", "0", "--device", device]
    command += ["--quota-bytes", str(quota_bytes), "--threads", str(threads)]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    try:
        line = process.stdout.readline() if process.stdout else ""
        if not line.startswith("listening on "):
            raise RuntimeError(f"the native executor did not start (it said {line!r})")
        host, _, port = line.removeprefix("listening on ").strip().rpartition(":")
        yield host, int(port)
    finally:
        process.kill()
        process.wait()
        if process.stdout:
            process.stdout.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quota-bytes", type=int, default=DEFAULT_QUOTA)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args()
    import torch

    from .executor import library

    if args.threads:
        torch.set_num_threads(args.threads)
    library()  # build or load before announcing the port
    listener = socket.create_server((args.host, args.port))
    host, port = listener.getsockname()[:2]
    print(f"listening on {host}:{port}", flush=True)
    serve(listener, args.device, args.quota_bytes)


if __name__ == "__main__":
    main()
