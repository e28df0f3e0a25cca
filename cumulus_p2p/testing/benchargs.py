"""What the benchmarks share: command-line options for those that drive an executor
process, and the median time of a step."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable


def executor_bench_args(description: str | None) -> argparse.Namespace:
    """Parse ``--quick`` (fewer repetitions) and ``--device`` (the executor's device)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (< 60 s)")
    parser.add_argument("--device", default="cpu", help="executor device: cpu, cuda or auto")
    return parser.parse_args()


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
