"""Tenant isolation's costs: a worker process per session (issue 12).

Prints JSON and writes ``benchmarks/results/isolation.json``::

    python benchmarks/isolation_bench.py [--quick]

``--quick`` (within 60 s, nothing written) times one session each way, the relay's step
cost only with the same OpenMP policy, and skips the on-demand latency.

- ``lease_to_first_op_warm_s``: from dialing an executor whose pool holds a started
  worker to the result of the session's first op (median of several sessions, from a
  client process that has attached before, so its own imports are not counted);
  ``lease_to_first_op_cold_s`` the same with no worker pool (``--pool 0``: the worker
  starts when the session comes); ``lease_to_first_op_shared_s`` with every session in
  the executor's process, for reference. ``sync_round_trip_us_worker`` / ``_shared``:
  the median ``.item()`` of a 4-element tensor after it, over plain TCP on loopback;
  ``sync_round_trip_us_secure_worker`` / ``_secure_shared`` the same over the secure
  channel (the worker decrypts its session's records itself).
- ``<workload>_step_ms_shared`` / ``_step_ms_worker`` and ``_worker_overhead``: median
  training step (step_bench's loop) against an executor running sessions in its own
  process and against one running each in a worker, in alternating rounds from one
  client process; ``_passive`` the same with the in-process executor on OpenMP's passive
  wait policy too, as workers are.
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
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import priority_bench  # noqa: E402 - after the path fix
import step_bench  # noqa: E402

STEP_WORKLOADS = ["mlp_tiny", "transformer_tiny"]
ROUND_TRIPS = 200


def first_op_seconds(flags: list[str], sessions: int, settle_s: float) -> tuple[float, float]:
    """Median time from dialing to the first op's result, over ``sessions`` sessions, and
    the median round trip of a sync point after it (µs)."""
    import torch

    import cumulus_p2p.remote as remote
    from cumulus_p2p.testing.executor import executor_process

    times, trips = [], []
    with executor_process(extra=flags) as (address, _):
        for i in range(sessions + 1):
            time.sleep(settle_s)  # the pool refills between sessions
            t0 = time.perf_counter()
            with remote.attach(address):
                x = torch.ones(4, device="cumulus")
                x.sum().item()
                if i:  # the first session warms this client process
                    times.append(time.perf_counter() - t0)
                for _ in range(ROUND_TRIPS):
                    t0 = time.perf_counter()
                    x.sum().item()
                    trips.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times), statistics.median(trips)


def secure_round_trip_us(flags: list[str]) -> float:
    """The median ``.item()`` round trip over the secure channel, on loopback."""
    import tempfile

    import torch

    import cumulus_p2p.remote as remote
    from cumulus_p2p.testing.executor import secure_executor_channel

    trips = []
    with tempfile.TemporaryDirectory() as data_dir:
        with secure_executor_channel(data_dir, extra=flags) as (channel, _):
            with remote.attach(channel=channel):
                x = torch.ones(4, device="cumulus")
                for i in range(ROUND_TRIPS + 20):
                    t0 = time.perf_counter()
                    x.sum().item()
                    if i >= 20:
                        trips.append((time.perf_counter() - t0) * 1e6)
    return round(statistics.median(trips), 1)


def step_overhead(rounds: int, steps: int, *, passive: bool) -> dict:
    """Median step per workload through each kind of executor, in alternating rounds.

    Workers run with OpenMP's passive wait policy (``supervisor._worker_environment``);
    ``passive`` gives the in-process executor that wait policy too, to separate what the
    worker process costs from what spinning OpenMP threads gain on an idle machine.
    """
    import cumulus_p2p.remote as remote
    from cumulus_p2p.testing.executor import executor_process

    saved = os.environ.get("OMP_WAIT_POLICY")
    if passive:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # inherited by both executors
    times: dict = {(n, m): [] for n in STEP_WORKLOADS for m in ("shared", "worker")}
    with (
        executor_process(extra=["--shared-process"]) as (shared, _),
        # No pool: a worker refilling the pool (importing torch) would run during the
        # other executor's round; each session starts its own before it is timed.
        executor_process(extra=["--worker-per-session", "--pool", "0"]) as (worker, _),
    ):
        for _ in range(rounds):
            for mode, address in (("shared", shared), ("worker", worker)):
                time.sleep(1.0)  # the previous round's worker has exited
                with remote.attach(address):
                    for name in STEP_WORKLOADS:
                        step = step_bench.trainer(name, "cumulus")
                        for _ in range(3):
                            step()
                        times[name, mode] += [step()[1] * 1e3 for _ in range(steps)]
    if passive:
        os.environ.pop("OMP_WAIT_POLICY")
        if saved is not None:
            os.environ["OMP_WAIT_POLICY"] = saved
    out = {}
    suffix = "_passive" if passive else ""
    for name in STEP_WORKLOADS:
        shared_ms = statistics.median(times[name, "shared"])
        worker_ms = statistics.median(times[name, "worker"])
        out[f"{name}_step_ms_shared{suffix}"] = round(shared_ms, 2)
        out[f"{name}_step_ms_worker{suffix}"] = round(worker_ms, 2)
        out[f"{name}_worker_overhead{suffix}"] = round(worker_ms / shared_ms - 1, 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs (within 60 s)")
    args = parser.parse_args()
    quick = args.quick
    sessions = 1 if quick else 5
    workers = ["--worker-per-session"]
    warm, trip_worker = first_op_seconds([*workers, "--pool", "1"], sessions, 3.0)
    cold, _ = first_op_seconds([*workers, "--pool", "0"], sessions, 0.5)
    result = {"lease_to_first_op_warm_s": warm, "lease_to_first_op_cold_s": cold}
    if not quick:
        shared, trip_shared = first_op_seconds(["--shared-process"], 5, 0.5)
        result["lease_to_first_op_shared_s"] = shared
        result["sync_round_trip_us_shared"] = round(trip_shared, 1)
    result["sync_round_trip_us_worker"] = round(trip_worker, 1)
    if not quick:
        result["sync_round_trip_us_secure_shared"] = secure_round_trip_us(["--shared-process"])
        result["sync_round_trip_us_secure_worker"] = secure_round_trip_us(workers)
    print("isolation_bench: first ops timed", file=sys.stderr, flush=True)
    rounds, steps = (1, 10) if quick else (4, 30)
    if not quick:
        result |= step_overhead(rounds, steps, passive=False)
    result |= step_overhead(rounds, steps, passive=True)
    print("isolation_bench: steps timed", file=sys.stderr, flush=True)
    result |= sharing(2.0 if quick else 12.0, with_on_demand=not quick)
    result = {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}
    print(json.dumps(result, indent=2))
    if not quick:
        out = ROOT / "benchmarks" / "results" / "isolation.json"
        out.write_text(json.dumps(result, indent=2) + "\n")


def sharing(seconds: float, *, with_on_demand: bool) -> dict:
    """Tenants' total throughput, one against four, and an on-demand tenant's latency."""
    run = priority_bench.measure
    _, one = run(True, seconds, with_background=True, isolation="worker", tenants=1)
    _, four = run(True, seconds, with_background=True, isolation="worker", tenants=4)
    out = {
        "one_tenant_steps_per_s": round(len(one) / seconds, 1),
        "four_tenants_steps_per_s": round(len(four) / seconds, 1),
    }
    if with_on_demand:
        alone, _ = run(True, seconds, with_background=False, isolation="worker")
        beside, _ = run(True, seconds, with_background=True, isolation="worker", tenants=3)
        out["on_demand_alone_ms"] = round(statistics.median(alone), 2)
        out["on_demand_beside_interruptible_ms"] = round(statistics.median(beside), 2)
        p90 = statistics.quantiles(beside, n=10)[-1]
        out["on_demand_beside_interruptible_p90_ms"] = round(p90, 2)
    return out


if __name__ == "__main__":
    main()
