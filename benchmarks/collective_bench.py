"""Collectives between a job's hosts (issue 33): all-reduce speed, and DDP through them.

Two real CPU executor processes on loopback, each serving one rank's session; every
figure is measured in the same run against its baseline:

- ``allreduce_gb_s``: a float32 tensor all-reduced by the ``cumulus`` backend (the
  executors reduce among themselves in a gloo group; the ranks only send the record),
  bytes of the tensor per second of wall time, from the rank's side (its sync included);
- ``gloo_gb_s``: the same all-reduce between two plain processes with gloo;
- ``ddp_step_s``, ``ddp_param_max_diff`` and ``consumer_bytes_share``: the standard
  torchrun DDP script of the tests (``tests/scripts/ddp_train.py``) through the shim, its
  median step time (``ddp_local_gloo_step_s``: the same script on gloo in two local
  processes), its largest parameter difference against that local run, and the bytes a
  training step adds to a rank's link against the bytes it all-reduces.

Prints JSON and writes ``benchmarks/results/collective.json`` (not with ``--quick``)::

    python benchmarks/collective_bench.py [--quick] [--megabytes N]

Not measured yet: shaped links (network namespaces and ``tc``) and DiLoCo, so
``diloco_utilization`` is null.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "ddp_train.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def rank_main(backend: str, megabytes: int, rounds: int, out: str) -> None:
    """One rank of the all-reduce timing (run as a torchrun child)."""
    import torch.distributed as dist

    device = "cumulus" if backend == "cumulus" else "cpu"
    if backend == "cumulus":
        import cumulus_p2p.shim as shim

        shim.connect(os.environ)
    dist.init_process_group(backend)
    tensor = torch.ones(megabytes * 2**20 // 4, device=device)
    dist.all_reduce(tensor)  # warm: connections, buffers
    tensor.sum().item()
    dist.barrier()
    started = time.perf_counter()
    for _ in range(rounds):
        dist.all_reduce(tensor)
    tensor[:1].sum().item()  # the executor has run them all
    seconds = time.perf_counter() - started
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"gb_s": megabytes * 2**20 * rounds / seconds / 1e9}))
    dist.destroy_process_group()


def torchrun(*args: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [*TORCHRUN, *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
        cwd=ROOT,
    )
    if done.returncode != 0:
        raise SystemExit(f"torchrun failed:\n{done.stderr[-3000:]}")
    return done.stdout


def all_reduce_gb_s(backend: str, megabytes: int, rounds: int, work: Path, env=None) -> float:
    out = work / f"allreduce-{backend}.json"
    torchrun(__file__, "--rank-of", backend, str(megabytes), str(rounds), str(out), env=env)
    return json.loads(out.read_text())["gb_s"]


def ddp_figures(executors: tuple[str, str], steps: int, work: Path) -> dict:
    from cumulus_p2p.testing.tap import tap

    local_step_s = _step_s(torchrun(str(SCRIPT), str(work / "local.pt"), str(steps)))
    link_bytes = {}
    for run_steps in (1, steps):
        with tap(executors[0]) as first, tap(executors[1]) as second:
            env = {"CUMULUS_EXECUTOR": f"{first.address},{second.address}"}
            out = torchrun(
                "-m",
                "cumulus_p2p.shim",
                str(SCRIPT),
                str(work / "remote.pt"),
                str(run_steps),
                env=env,
            )
            link_bytes[run_steps] = max(first.bytes, second.bytes)
    local, remote = torch.load(work / "local.pt"), torch.load(work / "remote.pt")
    param_bytes = sum(v.numel() * v.element_size() for v in local.values())
    return {
        "ddp_step_s": _step_s(out),
        "ddp_local_gloo_step_s": local_step_s,
        "ddp_param_max_diff": max((local[k] - remote[k]).abs().max().item() for k in local),
        # What a step adds to a rank's link, against the gradient bytes it all-reduces.
        "consumer_bytes_share": (link_bytes[steps] - link_bytes[1]) / (steps - 1) / param_bytes,
    }


def _step_s(stdout: str) -> float:
    ranks = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return max(rank["step_s"] for rank in ranks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller and fewer (< 1 minute)")
    parser.add_argument("--megabytes", type=int, default=None, help="all-reduced tensor size")
    parser.add_argument("--rank-of", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_of:
        backend, megabytes, rounds, out = args.rank_of
        rank_main(backend, int(megabytes), int(rounds), out)
        return
    from cumulus_p2p.testing.executor import executor_process

    megabytes = args.megabytes or (16 if args.quick else 64)
    rounds = 5 if args.quick else 20
    steps = 3 if args.quick else 8
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"collective-bench-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    result = {"megabytes": megabytes, "rounds": rounds, "ddp_steps": steps, "quick": args.quick}
    result["gloo_gb_s"] = all_reduce_gb_s("gloo", megabytes, rounds, work)
    with executor_process() as (first, _), executor_process() as (second, _):
        env = {"CUMULUS_EXECUTOR": f"{first},{second}"}
        result["allreduce_gb_s"] = all_reduce_gb_s("cumulus", megabytes, rounds, work, env)
        result.update(ddp_figures((first, second), steps, work))
    result["allreduce_vs_gloo"] = result["allreduce_gb_s"] / result["gloo_gb_s"]
    result["diloco_utilization"] = None  # not built yet
    print(json.dumps(result, indent=2))
    if not args.quick:
        (ROOT / "benchmarks" / "results" / "collective.json").write_text(
            json.dumps(result, indent=2)
        )


if __name__ == "__main__":
    main()
