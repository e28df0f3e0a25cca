"""How fast the hot path starts: imports, the executor, a session's first op (issue 17).

Prints JSON and writes ``benchmarks/results/startup.json``::

    python benchmarks/startup_bench.py [--runs 5] [--quick]

Each figure is the median of ``--runs`` fresh processes, so nothing is cached in memory
but the operating system's file cache:

- ``import_<module>_s``: ``python -c "import <module>"``, whole process, for the shim,
  the executor's entry point, ``cumulus_p2p.remote`` and the ``cumulus-node`` command
  (``import_cli_s``); ``import_libp2p_s`` and ``import_torch_s`` for scale (what the hot
  path no longer loads, and what it must).
- ``node_ready_s``: from starting a plain ``cumulus-node`` (a boot node: no
  ``--provide``) to its ``listening on`` line.
- ``executor_ready_s``: from starting ``cumulus-executor --device cpu`` to its
  ``listening`` line.
- ``executor_first_op_s``: from starting it to the answer of a first op from a client
  process that was already running (attach, one add, ``.item()``).
- ``worker_session_first_op_s``: on a running ``cumulus-executor --worker-per-session
  --pool 0`` (no worker kept waiting), from a new session's attach to its first op's
  answer: what starting that session's worker process costs it.
- ``job_first_line_s``: on a loopback mesh (a boot node and a CPU provider), from
  starting ``cumulus-node --consume -- python first.py`` to the script's first line
  (which it prints before anything else): matching, leasing, the script's interpreter and
  its session.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = (
    "cumulus_p2p.shim",
    "cumulus_p2p.host.executor_main",
    "cumulus_p2p.remote",
    "cumulus_p2p.cli",
)


def import_seconds(module: str) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True, cwd=ROOT)
    return time.perf_counter() - started


def executor_start() -> tuple[float, float]:
    """Seconds to the executor's ``listening`` line, and to a first op's answer."""
    import torch

    from cumulus_p2p import remote

    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cumulus_p2p.host.executor_main", "--device", "cpu"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        line = proc.stdout.readline()
        ready = time.perf_counter() - started
        address = line.split("listening on ")[1].split()[0]
        with remote.attach(address):
            (torch.ones(4, device="cumulus") + 1).sum().item()
        first_op = time.perf_counter() - started
    finally:
        proc.terminate()
        proc.wait(10)
    return ready, first_op


def worker_session_first_ops(runs: int) -> list[float]:
    """Seconds from attach to a first op's answer for ``runs`` sessions in turn, each in
    a worker started for it; after one session that warms the executor."""
    import torch

    from cumulus_p2p import remote

    command = [sys.executable, "-m", "cumulus_p2p.host.executor_main", "--device", "cpu"]
    command += ["--worker-per-session", "--pool", "0"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        address = proc.stdout.readline().split("listening on ")[1].split()[0]
        seconds = []
        for _ in range(runs + 1):
            started = time.perf_counter()
            with remote.attach(address):
                (torch.ones(4, device="cumulus") + 1).sum().item()
            seconds.append(time.perf_counter() - started)
    finally:
        proc.terminate()
        proc.wait(10)
    return seconds[1:]


FIRST_LINE = "import time\nprint('first line', time.time(), flush=True)\n"


def job_first_lines(runs: int) -> list[float]:
    """Seconds from starting a consumer node to its script's first line, ``runs`` jobs."""
    from cumulus_p2p.testing import nodes  # fresh processes: this one sets no fork start

    with tempfile.TemporaryDirectory() as root:
        script = Path(root) / "first.py"
        script.write_text(FIRST_LINE)
        with nodes.boot_and_provider(Path(root)) as (boot, _):
            seconds = []
            for run in range(runs):
                started = time.time()
                consumer = nodes.start_consumer(
                    Path(root) / f"c{run}", boot.addr, command=[str(script)]
                )
                if consumer.proc.wait(timeout=300) != 0:
                    raise RuntimeError(consumer.output())
                line = next(x for x in consumer.lines if x.startswith("first line"))
                seconds.append(float(line.split()[-1]) - started)
    return seconds


def node_ready() -> float:
    """Seconds from starting a boot node to its ``listening on`` line."""
    with tempfile.TemporaryDirectory() as data_dir:
        started = time.perf_counter()
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cumulus_p2p.cli",
                "--data-dir",
                data_dir,
                "--listen",
                "/ip4/127.0.0.1/tcp/0",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
        )
        try:
            for line in proc.stdout:
                if "listening on" in line:
                    return time.perf_counter() - started
            raise RuntimeError(f"cumulus-node exited ({proc.wait()}) before listening")
        finally:
            proc.terminate()
            proc.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="two runs of each figure")
    args = parser.parse_args()
    if args.quick:
        args.runs = 2
    results: dict[str, float] = {}
    for module in (*MODULES, "libp2p", "torch"):
        key = f"import_{module.rsplit('.', 1)[-1]}_s"
        results[key] = round(statistics.median(import_seconds(module) for _ in range(args.runs)), 3)
    executor_start()  # warm the file cache and this process's own imports
    starts = [executor_start() for _ in range(args.runs)]
    results["executor_ready_s"] = round(statistics.median(s[0] for s in starts), 3)
    results["executor_first_op_s"] = round(statistics.median(s[1] for s in starts), 3)
    firsts = worker_session_first_ops(args.runs)
    results["worker_session_first_op_s"] = round(statistics.median(firsts), 3)
    results["node_ready_s"] = round(statistics.median(node_ready() for _ in range(args.runs)), 3)
    results["job_first_line_s"] = round(statistics.median(job_first_lines(args.runs)), 3)
    print(json.dumps(results, indent=1))
    out = ROOT / "benchmarks" / "results" / "startup.json"
    out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
