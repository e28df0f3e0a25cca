"""Measure a link's real rate between two namespaces: one TCP stream, counted at the receiver.

``measure_mbit(src, dst)`` runs a sink in ``dst``'s namespace and a sender in ``src``'s, both
as ``python -m cumulus_p2p.testing.linkrate``, and returns the rate the sink saw. It exists to
check that ``netns.shaped_mesh`` really shapes: a benchmark that claims 100 Mbit/s should show
it. The sink times from its first byte to its last, so the sender's socket buffer filling up
at memory speed does not count as link speed.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time

from .netns import Host

SINK_PORT = 5299
_CHUNK = 256 * 1024


def measure_mbit(src: Host, dst: Host, *, seconds: float = 2.0) -> float:
    """Megabits per second of one TCP stream from ``src`` to ``dst``, as ``dst`` received it."""
    this = [sys.executable, "-m", "cumulus_p2p.testing.linkrate"]
    sink = subprocess.Popen(
        dst.command(*this, "sink", dst.address), stdout=subprocess.PIPE, text=True
    )
    try:
        if sink.stdout.readline().strip() != "ready":
            raise RuntimeError("the link-rate sink did not start")
        send = [*this, "send", dst.address, "--seconds", str(seconds)]
        subprocess.run(src.command(*send), check=True, timeout=seconds + 30)
        return float(sink.stdout.readline())
    finally:
        sink.kill()
        sink.wait()


def _sink(address: str) -> None:
    with socket.create_server((address, SINK_PORT)) as server:
        print("ready", flush=True)
        conn, _ = server.accept()
        with conn:
            first = conn.recv(_CHUNK)
            start, received = time.perf_counter(), 0
            while chunk := conn.recv(_CHUNK):
                received += len(chunk)
            elapsed = time.perf_counter() - start
    print(received * 8 / elapsed / 1e6 if first and elapsed > 0 else 0.0, flush=True)


def _send(address: str, seconds: float) -> None:
    payload = bytes(_CHUNK)
    with socket.create_connection((address, SINK_PORT)) as conn:
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            conn.sendall(payload)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("role", choices=["sink", "send"])
    parser.add_argument("address")
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args()
    if args.role == "sink":
        _sink(args.address)
    else:
        _send(args.address, args.seconds)


if __name__ == "__main__":
    main()
