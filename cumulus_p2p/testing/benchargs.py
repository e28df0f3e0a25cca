"""What the benchmarks share: command-line options (``--quick``, and ``--device`` for
those that drive an executor process), the median time of a step or the rate of a call,
writing a result, and running a benchmark's own roles as child processes."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def quick_parser(description: str | None, quick: str) -> argparse.ArgumentParser:
    """A benchmark's parser, with ``--quick`` (``quick`` says what it shortens)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help=quick)
    return parser


def executor_bench_args(description: str | None) -> argparse.Namespace:
    """Parse ``--quick`` (fewer repetitions) and ``--device`` (the executor's device)."""
    parser = quick_parser(description, "fewer repetitions (< 60 s)")
    parser.add_argument("--device", default="cpu", help="executor device: cpu, cuda or auto")
    return parser.parse_args()


def per_second(call: Callable[[Any], object], items: Sequence) -> float:
    """Calls of ``call`` per second, one on each of ``items``."""
    start = time.perf_counter()
    for item in items:
        call(item)
    return len(items) / (time.perf_counter() - start)


def save_result(path: Path, result: dict) -> None:
    """Print ``result`` as one JSON line and keep it, indented, at ``path``."""
    print(json.dumps(result))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


def median_seconds(step: Callable[[], object], steps: int, *, warmup: int = 3) -> float:
    """The median wall time of ``step()`` over ``steps`` calls, after ``warmup`` untimed."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def spawn_role(script: str, *args: str, cwd: Path) -> subprocess.Popen:
    """``script`` started again in a child process with ``args`` (one of its server or
    client roles), its output piped as text."""
    return subprocess.Popen(
        [sys.executable, script, *args], stdout=subprocess.PIPE, text=True, cwd=cwd
    )


def last_json_line(proc: subprocess.Popen, *, timeout: float) -> Any:
    """The JSON on the last line ``proc`` prints, once it exits (within ``timeout`` s)."""
    out, _ = proc.communicate(timeout=timeout)
    return json.loads(out.strip().splitlines()[-1])


async def serve_ranks(nursery, executor, ranks) -> list[int]:
    """Serve ``executor``'s sessions in ``nursery`` on a loopback port per rank in
    ``ranks`` (a session arriving on a port runs at its rank); the ports, in order."""
    import trio

    from ..channel.transport import TrioFrameChannel

    ports = []
    for rank in ranks:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        ports.append(listeners[0].socket.getsockname()[1])

        async def handler(stream, rank=rank) -> None:
            await executor.run_session(TrioFrameChannel(stream), rank=rank)

        nursery.start_soon(trio.serve_listeners, handler, listeners)
    return ports
