"""Command-line options shared by the benchmarks that drive an executor process."""

from __future__ import annotations

import argparse


def executor_bench_args(description: str | None) -> argparse.Namespace:
    """Parse ``--quick`` (fewer repetitions) and ``--device`` (the executor's device)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (< 60 s)")
    parser.add_argument("--device", default="cpu", help="executor device: cpu, cuda or auto")
    return parser.parse_args()
