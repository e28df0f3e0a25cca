"""An executor's memory under a loop of large results (issue 35's CUDA out-of-memory).

A client runs ``(a @ b)[0, 0].item()`` in a loop, as ``contention_bench.py``'s hog does,
against a ``cumulus-executor`` process of its own: once in-process (``plain``) and once
with a worker process per session (``worker``). Every ``--every`` iterations it records
the session's ``bytes_in_use`` (the executor's count of the session's live tensors) and
the memory the executor's process tree holds: on CUDA what ``nvidia-smi`` reports for its
processes, on a CPU their resident set. A loop that frees each result holds both flat;
memory that grows while ``bytes_in_use`` stays flat is held by something the session does
not count.

    python benchmarks/hog_memory.py [--quick] [--device cpu|cuda] [--size N] [--iterations N]

Prints JSON (nothing written): per mode, the samples ``[iteration, bytes_in_use MiB,
process MiB]``, ``growth_mib`` (process memory at the end over the first sample) and
``error`` when the loop failed, with the iteration it failed at.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MIB = 1 << 20


def start_executor(device: str, workers: bool) -> tuple[subprocess.Popen, str]:
    """A ``cumulus-executor`` process and the address it listens on."""
    cmd = [sys.executable, "-m", "cumulus_p2p.host.executor_main", "--device", device]
    cmd += ["--worker-per-session"] if workers else []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    line = proc.stdout.readline()
    return proc, line.split("listening on ")[1].split()[0]


def tree_mib(root: int, device: str) -> float:
    """Memory held by process ``root`` and its children, in MiB."""
    pids = [root] + [child.pid for child in psutil.Process(root).children(recursive=True)]
    if device == "cpu":
        return sum(psutil.Process(pid).memory_info().rss for pid in pids) / MIB
    query = "--query-compute-apps=pid,used_memory"
    out = subprocess.run(
        ["nvidia-smi", query, "--format=csv,noheader,nounits"], capture_output=True, text=True
    ).stdout
    used = {int(p): float(m) for p, m in (line.split(",") for line in out.splitlines() if line)}
    return sum(used.get(pid, 0.0) for pid in pids)


def run_mode(device: str, workers: bool, size: int, iterations: int, every: int) -> dict:
    import torch

    import cumulus_p2p.remote as remote

    proc, address = start_executor(device, workers)
    samples, error = [], None
    try:
        with remote.attach(address) as session:
            a = torch.randn(size, size, device="cumulus")
            b = torch.randn(size, size, device="cumulus")
            for i in range(iterations):
                try:
                    (a @ b)[0, 0].item()
                except Exception as exc:  # the figure is where and how it failed
                    error = f"iteration {i}: {type(exc).__name__}: {str(exc)[:300]}"
                    break
                if i % every == 0 or i == iterations - 1:
                    in_use = session.stats()["bytes_in_use"] / MIB
                    samples.append([i, round(in_use, 1), round(tree_mib(proc.pid, device), 1)])
    finally:
        proc.kill()
        proc.wait()
    growth = samples[-1][2] - samples[0][2] if samples else 0.0
    return {"samples": samples, "growth_mib": round(growth, 1), "error": error}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--size", type=int, help="the matmul's size (default 8192 on CUDA)")
    parser.add_argument("--iterations", type=int, help="loop length (default 200, quick 40)")
    args = parser.parse_args()
    size = args.size or (8192 if args.device == "cuda" else 2048)
    iterations = args.iterations or (40 if args.quick else 200)
    every = max(1, iterations // 20)
    result = {"device": args.device, "size": size, "iterations": iterations}
    for mode, workers in (("plain", False), ("worker", True)):
        result[mode] = run_mode(args.device, workers, size, iterations, every)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
