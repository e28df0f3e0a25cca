"""A job that outlives a lost host (issue 33, ``remote/regroup.py``): what it costs.

The standard torchrun DDP script of the tests (``tests/scripts/ddp_train.py``) runs
through the shim on two real CPU executor processes, three times in one run:

- ``ddp_step_s``: without failover (the baseline), the median step;
- ``ddp_step_recoverable_s``: each rank with a spare behind its executor
  (``CUMULUS_EXECUTOR=a,b|c``), so that the ranks checkpoint together every
  ``--interval`` seconds; ``group_checkpoint_overhead`` is its time over the baseline's,
  the checkpoints' share spread over the steps (all steps' time, not the median, which
  a checkpoint every few steps would not move);
- the same, SIGKILLing rank 1's executor once the steps have begun: ``regroup_pause_s``
  is the slowest step of that run less its median (the step in which both ranks
  rebuilt their sessions, re-formed the group and replayed), ``failover_s`` the longest
  "session moved" a rank reported, and ``regroup_losses_exact`` (1 or 0) whether every
  rank's losses are the baseline's, bit for bit.

This machine's speed swings by minutes: compare within one run.
Prints JSON and writes ``benchmarks/results/regroup.json`` (not
with ``--quick``)::

    python benchmarks/regroup_bench.py [--quick] [--interval S]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cumulus_p2p.testing import nodes  # noqa: E402
from cumulus_p2p.testing.executor import executor_process  # noqa: E402
from cumulus_p2p.testing.tap import tap  # noqa: E402

SCRIPT = ROOT / "tests" / "scripts" / "ddp_train.py"
#: Bytes on rank 0's link once the model is up and the steps have begun.
STEPPING = 600_000
#: Steps of the runs that warm the executors up before the measured ones.
WARM_STEPS = "30"


def run_job(args: list[str], env: dict, *, kill=None, metered=None) -> tuple[list[dict], str]:
    """The script through the shim; ``kill`` (a process) is SIGKILLed once ``metered`` (a
    tap on rank 0's link) has carried ``STEPPING`` bytes. Returns each rank's JSON line
    and the launcher's stderr."""
    shim = ["-m", "cumulus_p2p.shim", str(SCRIPT), *args]
    done: dict = {}
    job = threading.Thread(target=lambda: done.update(run=nodes.torchrun(*shim, env=env)))
    job.start()
    if kill is not None:
        while metered.bytes < STEPPING and job.is_alive():
            time.sleep(0.05)
        time.sleep(0.5)
        kill.kill()
    job.join()
    run = done["run"]
    if run.returncode != 0:
        raise RuntimeError(f"the job failed ({run.returncode}):\n{run.stderr[-4000:]}")
    return nodes.json_lines(run.stdout), run.stderr


def measure(steps: str, hidden: str, interval: str, work: Path) -> dict:
    args = [str(work / "out.pt"), steps, hidden]
    with (
        executor_process() as (first, _),
        executor_process() as (second, doomed),
        executor_process() as (spare, _),
        tap(first) as metered,
    ):
        plain_env = {"CUMULUS_EXECUTOR": f"{first},{second}"}
        spares = {
            "CUMULUS_EXECUTOR": f"{first},{second}|{spare}",
            "CUMULUS_CHECKPOINT_INTERVAL": interval,
        }
        # The executors' first runs are slower (the model's upload, which leaves it in
        # their blob stores; first use of each kernel): 1.7x here. Each arm runs once
        # before any is measured.
        for env in (plain_env, spares):
            run_job([args[0], WARM_STEPS, hidden], env)
        plain, _ = run_job(args, plain_env)
        recoverable, _ = run_job(args, spares)
        spares["CUMULUS_EXECUTOR"] = f"{metered.address},{second}|{spare}"
        killed, stderr = run_job(args, spares, kill=doomed, metered=metered)
    moved = [float(s) for s in re.findall(r"session moved to \S+ in ([0-9.]+) s", stderr)]
    by_rank = {rank["rank"]: rank["losses"] for rank in plain}

    def slower(ranks: list[dict], key: str) -> float:
        return max(rank[key] for rank in ranks)

    return {
        "ddp_step_s": slower(plain, "step_s"),
        "ddp_step_recoverable_s": slower(recoverable, "step_s"),
        "group_checkpoint_overhead": slower(recoverable, "train_s") / slower(plain, "train_s"),
        "regroup_pause_s": slower(killed, "slowest_step_s") - slower(killed, "step_s"),
        "failover_s": max(moved, default=None),
        "ranks_moved": len(moved),
        "regroup_losses_exact": int(all(r["losses"] == by_rank[r["rank"]] for r in killed)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller and fewer (< 1 minute)")
    parser.add_argument("--interval", default="1", help="seconds between group checkpoints")
    args = parser.parse_args()
    steps, hidden = ("100", "1024") if args.quick else ("300", "2048")
    with contextlib.ExitStack() as stack:
        import tempfile

        work = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        result = {"steps": int(steps), "hidden": int(hidden), "interval_s": float(args.interval)}
        result.update(measure(steps, hidden, args.interval, work))
    result["quick"] = args.quick
    print(json.dumps(result, indent=2))
    if not args.quick:
        (ROOT / "benchmarks" / "results" / "regroup.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
