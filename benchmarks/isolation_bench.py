"""Tenant isolation's costs: a worker process per session (issue 12).

Prints JSON and writes ``benchmarks/results/isolation.json``::

    python benchmarks/isolation_bench.py [--quick]

- ``lease_to_first_op_warm_s``: from dialing an executor whose pool holds a started
  worker to the result of the session's first op (median of several sessions, from a
  client process that has attached before, so its own imports are not counted);
  ``lease_to_first_op_cold_s`` the same with no worker pool (``--pool 0``: the worker
  starts when the session comes); ``lease_to_first_op_shared_s`` with every session in
  the executor's process, for reference.
- ``one_tenant_steps_per_s`` / ``four_tenants_steps_per_s``: interruptible tenants
  running matmul steps back to back (``priority_bench``'s background loop), each in its
  own worker: the device's total throughput with one tenant and with four.
- ``on_demand_alone_ms`` / ``on_demand_beside_interruptible_ms`` (and ``_p90_ms``): an
  on-demand tenant's short steps alone, then beside three interruptible tenants, with
  turns granted across workers by lease rank.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import priority_bench  # noqa: E402 - after the path fix


def first_op_seconds(flags: list[str], sessions: int, settle_s: float) -> float:
    """Median time from dialing to the first op's result, over ``sessions`` sessions."""
    import torch

    import cumulus_p2p.remote as remote
    from cumulus_p2p.testing.executor import executor_process

    times = []
    with executor_process(extra=flags) as (address, _):
        for i in range(sessions + 1):
            time.sleep(settle_s)  # the pool refills between sessions
            t0 = time.perf_counter()
            with remote.attach(address):
                torch.ones(4, device="cumulus").sum().item()
                if i:  # the first session warms this client process
                    times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs (within 60 s)")
    args = parser.parse_args()
    sessions, seconds = (2, 3.0) if args.quick else (5, 12.0)
    workers = ["--worker-per-session"]
    result = {
        "lease_to_first_op_warm_s": first_op_seconds([*workers, "--pool", "1"], sessions, 4.0),
        "lease_to_first_op_cold_s": first_op_seconds([*workers, "--pool", "0"], sessions, 0.5),
        "lease_to_first_op_shared_s": first_op_seconds(["--shared-process"], sessions, 0.5),
    }
    print("isolation_bench: first ops timed", file=sys.stderr, flush=True)
    run = priority_bench.measure
    _, one = run(True, seconds, with_background=True, isolation="worker", tenants=1)
    _, four = run(True, seconds, with_background=True, isolation="worker", tenants=4)
    alone, _ = run(True, seconds, with_background=False, isolation="worker")
    beside, _ = run(True, seconds, with_background=True, isolation="worker", tenants=3)
    result |= {
        "one_tenant_steps_per_s": round(len(one) / seconds, 1),
        "four_tenants_steps_per_s": round(len(four) / seconds, 1),
        "on_demand_alone_ms": round(statistics.median(alone), 2),
        "on_demand_beside_interruptible_ms": round(statistics.median(beside), 2),
        "on_demand_beside_interruptible_p90_ms": round(statistics.quantiles(beside, n=10)[-1], 2),
    }
    result = {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}
    print(json.dumps(result, indent=2))
    out = ROOT / "benchmarks" / "results" / "isolation.json"
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
