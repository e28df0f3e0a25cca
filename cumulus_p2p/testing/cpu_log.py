"""A pytest plugin that says where the suite's CPU goes: per test, its wall time and the
CPU seconds of the test process, of the child processes it waited for, and of those the
test's fork server (``testing.forkstart``) started for it and reaped: nodes, executors,
scripts. On two cores the suite is bound by CPU, not by waits, so these, not the
durations, say which tests to make cheaper.

    .venv/bin/python -m pytest -p cumulus_p2p.testing.cpu_log -n 4 ...

Each process appends a JSON line per test to ``$CUMULUS_CPU_LOG`` (default
``test-cpu.jsonl``); ``python -m cumulus_p2p.testing.cpu_log FILE`` prints the costliest.

A forked node is the fork server's child, not the test's: its CPU is read from the
server's own count of its reaped children (``/proc/PID/stat``). A forked process still
running when its test ends is counted in the test that runs when it is reaped.
"""

from __future__ import annotations

import json
import multiprocessing.forkserver
import os
import resource
import sys
import time
from pathlib import Path

import pytest


def _cpu() -> tuple[float, float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime, _forked_cpu()


def _forked_cpu() -> float:
    """CPU seconds of the fork server's reaped children (0 before it has started)."""
    pid = multiprocessing.forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    try:
        stat = Path(f"/proc/{pid}/stat").read_text() if pid else ""
    except OSError:  # the server is gone: it is started again for the next fork
        return 0.0
    # Fields after the command's closing parenthesis; cutime and cstime are the 16th and
    # 17th of the whole line.
    fields = stat.rpartition(")")[2].split()
    return sum(int(tick) for tick in fields[13:15]) / os.sysconf("SC_CLK_TCK") if fields else 0.0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    started, (own, children, forked) = time.perf_counter(), _cpu()
    yield
    wall, (own_after, children_after, forked_after) = time.perf_counter() - started, _cpu()
    line = {
        "test": item.nodeid,
        "wall_s": round(wall, 2),
        "cpu_s": round(own_after - own, 2),
        "children_cpu_s": round(children_after - children, 2),
        "forked_cpu_s": round(max(0.0, forked_after - forked), 2),
    }
    with open(os.environ.get("CUMULUS_CPU_LOG", "test-cpu.jsonl"), "a") as out:
        out.write(json.dumps(line) + "\n")


def main() -> None:
    rows = [json.loads(line) for line in Path(sys.argv[1]).read_text().splitlines()]
    for row in rows:
        row["total"] = row["cpu_s"] + row["children_cpu_s"] + row.get("forked_cpu_s", 0)
    rows.sort(key=lambda row: -row["total"])
    total = sum(row["total"] for row in rows)
    print(
        f"{len(rows)} tests, {total:.0f} CPU s in all, {sum(r['wall_s'] for r in rows):.0f} s wall"
    )
    for row in rows[:40]:
        print(f"{row['total']:7.1f} {row['wall_s']:7.1f}  {row['test']}")


if __name__ == "__main__":
    main()
