"""Scenario (c): hosts that come and go, with and without failover.

Hosts leave at a rate of 0-30% per hour (exponential times, so some leave within
minutes and some stay all day) and return after a downtime of 30 minutes on average,
with all shares on offer again. Long training jobs lease shares of them. *With
failover* a job checkpoints every ``interval`` and, when its host vanishes, leases
another host and resumes from its last checkpoint after the measured failover pause;
*without* it starts again from nothing, as a rented GPU that disappears forces today.

Whom a job leases from after a failure is decided by the node's own core
(``market.hostchoice``, driven by ``jobs.run``): a host that vanished is set aside for a
backoff and taken back once it announces again, and a job with no usable host waits up
to 30 minutes (``--wait-for-host``) before it gives up. On *small pools* the same jobs
also run under the policy the node had before: a host that failed once is excluded for
the rest of the job (``EXCLUDE_FOR_THE_JOB``); on a pool of a few hosts with churn, long
jobs run out of hosts under it.

*Jobs of N GPUs* (``gangs.py``) run data parallel on N hosts the market's gang planner
chooses; any one host lost sends every rank back to the last checkpoint. At 10%/h they
run with N of 1, 2, 4 and 8, the fleet's load the same (a job of N arrives N times less
often).

Read: the share of jobs that finish within the run, the GPU-hours computed and then
lost, and, at 10%/h, how the checkpoint interval trades lost work against the time
spent writing checkpoints; on small pools, how many jobs each policy finishes and how
long they were held waiting for a usable host; for jobs of N GPUs, the share of their
GPU-hours lost as N grows.
"""

from __future__ import annotations

import random

import simpy

from ..market.hostchoice import EXCLUDE_FOR_THE_JOB, BackoffPolicy
from . import gangs, jobs
from .market import Market, SimHost
from .population import add_hosts, job_trace, launch, mean_hold_s, with_fields
from .world import Workload

#: Long training runs (ASSUMED): hours of device time, a GPU's worth of memory or half.
LONG_TRAINING = {
    True: (Workload("long training", 0.7, (4, 8), (2 * 3600.0, 6 * 3600.0), 1.0),),
    False: (Workload("long training", 0.7, (4, 8), (4 * 3600.0, 12 * 3600.0), 1.0),),
}
#: Device seconds per burst: slowdown is not read here, so bursts are long and cheap.
BURST_S = 60.0
CHURN_PER_HOUR = (0.0, 0.1, 0.2, 0.3)
INTERVALS_S = (60.0, 300.0, 900.0, 1800.0, 3600.0)
DEFAULT_INTERVAL_S = 300.0
#: Checkpoint size: ASSUMED 2 GB, a ~125M-parameter model with fp32 Adam state.
STATE_MB = 2000.0
MEAN_DOWNTIME_S = 1800.0
#: Pools small enough that banning every host that failed once runs jobs out of hosts.
SMALL_POOLS = (3, 6)
SMALL_POOL_CHURN = (0.1, 0.3)
#: Seeds per small-pool row: a pool of three hosts runs only a handful of jobs per run.
SMALL_POOL_RUNS = 20
POLICIES = {"backoff": BackoffPolicy(), "exclude for the job": EXCLUDE_FOR_THE_JOB}
#: Ranks of the data-parallel jobs run at ``GANG_CHURN``.
GANG_SIZES = (1, 2, 4, 8)
GANG_CHURN = 0.1


def run(seed: int, *, quick: bool) -> dict:
    """Completion and waste per churn rate, and the checkpoint interval sweep at 10%/h."""
    hosts, horizon_h = (32, 36.0) if quick else (128, 96.0)
    rows = []
    for churn in CHURN_PER_HOUR:
        for failover in (True, False):
            interval = DEFAULT_INTERVAL_S if failover else None
            row = simulate(seed, churn, interval, hosts=hosts, horizon_h=horizon_h, quick=quick)
            rows.append({"churn_per_hour": churn, "failover": failover, **row})
    sweep = [
        {
            "interval_s": interval,
            **simulate(seed, 0.1, interval, hosts=hosts, horizon_h=horizon_h, quick=quick),
        }
        for interval in INTERVALS_S
    ]
    runs = 4 if quick else SMALL_POOL_RUNS
    small = [
        {
            "hosts": pool,
            "churn_per_hour": churn,
            "policy": name,
            "runs": runs,
            **_pooled_runs(seed, churn, pool, horizon_h, quick, policy, runs),
        }
        for pool in SMALL_POOLS
        for churn in SMALL_POOL_CHURN
        for name, policy in POLICIES.items()
    ]
    gang_rows = [
        {
            "gpus": gpus,
            "churn_per_hour": GANG_CHURN,
            **simulate(
                seed,
                GANG_CHURN,
                DEFAULT_INTERVAL_S,
                hosts=hosts,
                horizon_h=horizon_h,
                quick=quick,
                gpus=gpus,
            ),
        }
        for gpus in GANG_SIZES
    ]
    for row in gang_rows:
        spent = row["useful_gpu_hours"] + row["lost_gpu_hours"]
        row["lost_share"] = round(row["lost_gpu_hours"] / spent, 4) if spent else None
        row["failovers_per_job"] = round(row["failovers"] / row["jobs"], 3) if row["jobs"] else None
    return {
        "scenario": "churn",
        "seed": seed,
        "quick": quick,
        "hosts": hosts,
        "horizon_h": horizon_h,
        "state_mb": STATE_MB,
        "checkpoint_interval_s": DEFAULT_INTERVAL_S,
        "rows": rows,
        "interval_sweep_at_10_percent": sweep,
        "small_pools": small,
        "gangs": gang_rows,
    }


def simulate(
    seed: int,
    churn_per_hour: float,
    interval_s: float | None,
    *,
    hosts: int,
    horizon_h: float,
    quick: bool,
    policy: BackoffPolicy | None = None,
    gpus: int | None = None,
) -> dict:
    """One run; ``interval_s`` None means no failover: a lost job restarts. ``policy``:
    how the jobs' ``HostChoice`` sets failed hosts aside (the node's default if None).
    ``gpus``: every job runs data parallel on that many hosts (``gangs.py``), arriving
    that many times less often; None: single-device jobs (``jobs.py``)."""
    rng = random.Random(seed)
    env = simpy.Environment()
    market = Market(env, rng, mesh_nodes=hosts * 4)
    fleet = add_hosts(market, hosts, rng)
    horizon_s = horizon_h * 3600
    # Jobs arrive over the first third, at 0.6 of what the fleet could run whole, so
    # that without churn every one of them finishes within the run.
    workloads = LONG_TRAINING[quick]
    rate = 0.6 * hosts / mean_hold_s(workloads) / (gpus or 1)
    trace = job_trace(random.Random(seed + 1), workloads, rate_per_s=rate, horizon_s=horizon_s / 3)
    trace = with_fields(
        trace,
        checkpoint_every_s=interval_s,
        state_mb=STATE_MB,
        burst_s=BURST_S,
        host_policy=policy or BackoffPolicy(),
        gpus=gpus or 1,
    )
    if churn_per_hour > 0:
        churn_rng = random.Random(seed + 2)
        for host in fleet:
            env.process(come_and_go(env, market, host, churn_per_hour, churn_rng))
    launch(env, market, trace, rng, run=jobs.run if gpus is None else gangs.run)
    env.run(until=horizon_s)
    for granted in list(market.active.values()):
        market.settle(granted)
    done = [j for j in trace if j.done_s is not None]
    failed_over = [j for j in trace if j.failovers or j.restarts]
    return {
        "jobs": len(trace),
        "completion_rate": round(len(done) / len(trace), 4) if trace else None,
        "lost_gpu_hours": round(sum(j.lost_device_s for j in trace) / 3600, 3),
        "checkpoint_hours": round(sum(j.checkpoint_s for j in trace) / 3600, 3),
        "useful_gpu_hours": round(sum(j.compute_s * j.gpus for j in done) / 3600, 3),
        "failovers": sum(j.failovers for j in trace),
        "restarts": sum(j.restarts for j in trace),
        "gave_up": sum(j.gave_up_s is not None for j in trace),
        "jobs_failed_over": len(failed_over),
        "held_hours": round(sum(j.held_s for j in trace) / 3600, 3),
        "held_hours_per_job_failed_over": (
            round(sum(j.held_s for j in failed_over) / 3600 / len(failed_over), 3)
            if failed_over
            else None
        ),
        "cost": round(sum(j.cost for j in trace), 3),
    }


def _pooled_runs(
    seed: int,
    churn: float,
    hosts: int,
    horizon_h: float,
    quick: bool,
    policy: BackoffPolicy,
    runs: int,
) -> dict:
    """``simulate`` over ``runs`` seeds from ``seed`` on, its counts summed."""
    rows = [
        simulate(
            seed + 1000 * k,
            churn,
            DEFAULT_INTERVAL_S,
            hosts=hosts,
            horizon_h=horizon_h,
            quick=quick,
            policy=policy,
        )
        for k in range(runs)
    ]
    jobs = sum(r["jobs"] for r in rows)
    completed = sum(round(r["completion_rate"] * r["jobs"]) for r in rows if r["jobs"])
    failed_over = sum(r["jobs_failed_over"] for r in rows)
    held = sum(r["held_hours"] for r in rows)
    return {
        "jobs": jobs,
        "completion_rate": round(completed / jobs, 4) if jobs else None,
        "gave_up": sum(r["gave_up"] for r in rows),
        "failovers": sum(r["failovers"] for r in rows),
        "lost_gpu_hours": round(sum(r["lost_gpu_hours"] for r in rows), 3),
        "held_hours": round(held, 3),
        "held_hours_per_job_failed_over": round(held / failed_over, 3) if failed_over else None,
    }


def come_and_go(
    env: simpy.Environment, market: Market, host: SimHost, per_hour: float, rng: random.Random
):
    """A churning host: exponential lifetimes at ``per_hour`` departures an hour, each
    away ``MEAN_DOWNTIME_S`` on average (exponential too)."""
    while True:
        yield env.timeout(rng.expovariate(per_hour / 3600))
        market.leave(host)
        yield env.timeout(rng.expovariate(1 / MEAN_DOWNTIME_S))
        market.rejoin(host)
