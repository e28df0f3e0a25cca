"""A pytest plugin that says where the suite's CPU goes: per test, its wall time and the
CPU seconds of the test process and of the child processes it waited for (nodes,
executors, scripts). On two cores the suite is bound by CPU, not by waits, so these,
not the durations, say which tests to make cheaper.

    .venv/bin/python -m pytest -p cumulus_p2p.testing.cpu_log -n 4 ...

Each process appends a JSON line per test to ``$CUMULUS_CPU_LOG`` (default
``test-cpu.jsonl``); ``python -m cumulus_p2p.testing.cpu_log FILE`` prints the costliest.

It turns the suite's fork starts off (``testing.forkstart``): a forked node is the fork
server's child, not the test's, and its CPU would go uncounted. So the figures are those
of fresh interpreters, imports included: an upper bound on what the suite spends.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

import pytest

from .forkstart import ENV_SWITCH

# Loaded with -p, before tests/conftest.py, which only sets the switch where it is unset.
os.environ[ENV_SWITCH] = "0"


def _cpu() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    started, (own, children) = time.perf_counter(), _cpu()
    yield
    wall, (own_after, children_after) = time.perf_counter() - started, _cpu()
    line = {
        "test": item.nodeid,
        "wall_s": round(wall, 2),
        "cpu_s": round(own_after - own, 2),
        "children_cpu_s": round(children_after - children, 2),
    }
    with open(os.environ.get("CUMULUS_CPU_LOG", "test-cpu.jsonl"), "a") as out:
        out.write(json.dumps(line) + "\n")


def main() -> None:
    rows = [json.loads(line) for line in Path(sys.argv[1]).read_text().splitlines()]
    for row in rows:
        row["total"] = row["cpu_s"] + row["children_cpu_s"]
    rows.sort(key=lambda row: -row["total"])
    total = sum(row["total"] for row in rows)
    print(
        f"{len(rows)} tests, {total:.0f} CPU s in all, {sum(r['wall_s'] for r in rows):.0f} s wall"
    )
    for row in rows[:40]:
        print(f"{row['total']:7.1f} {row['wall_s']:7.1f}  {row['test']}")


if __name__ == "__main__":
    main()
