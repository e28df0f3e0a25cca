"""Who is in a simulated network: hosts drawn from the GPU mix, jobs arriving over time."""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence

import simpy

from . import jobs
from .market import MICRO, Market, SimHost
from .world import GPU_MIX, PRICE_SIGMA, REGIONS, SHARES_PER_GPU, Workload, pick


def add_hosts(
    market: Market,
    count: int,
    rng: random.Random,
    *,
    contend_floor: float = 0.0,
    contend_shares: int = 0,
    overcommit: float = 1.0,
) -> list[SimHost]:
    """``count`` hosts: a GPU from the mix, a region, a price around the model's, a
    contend price of ``contend_floor`` times that price (0: no contending leases),
    ``contend_shares`` contending shares beyond the on-demand ones, and their memory
    sold ``overcommit`` times over."""
    hosts = []
    for i in range(count):
        model = pick(rng, GPU_MIX)
        gpu_price = model.price_per_gpu_hour * rng.lognormvariate(0.0, PRICE_SIGMA)
        price = max(1, round(gpu_price / SHARES_PER_GPU * MICRO))
        floor = round(price * contend_floor)
        region = rng.choice(REGIONS)
        shares = contend_shares if floor else 0
        host = market.add_host(
            f"host-{i}",
            model,
            region,
            price,
            contend_price=floor,
            contend_shares=shares,
            overcommit=overcommit,
        )
        hosts.append(host)
    return hosts


def mean_speed() -> float:
    """The fleet's mean speed relative to the reference GPU."""
    total = sum(m.weight for m in GPU_MIX)
    return sum(m.weight * m.perf_units / 100 for m in GPU_MIX) / total


def mean_hold_s(workloads: Sequence[Workload]) -> float:
    """Mean wall time a job of this mix holds a whole GPU, alone on an average one."""
    total = sum(w.weight for w in workloads)
    hold = sum(w.weight * statistics.fmean(w.compute_s) / w.duty for w in workloads)
    return hold / total / mean_speed()


def job_trace(
    rng: random.Random,
    workloads: Sequence[Workload],
    *,
    rate_per_s: float,
    horizon_s: float,
    **fields,
) -> list[jobs.Job]:
    """Jobs arriving as a Poisson process until ``horizon_s``; ``fields`` set the rest."""
    trace: list[jobs.Job] = []
    t = rng.expovariate(rate_per_s)
    while t < horizon_s:
        workload = pick(rng, workloads)
        shares, compute = rng.randint(*workload.shares), rng.uniform(*workload.compute_s)
        job = jobs.Job(len(trace), workload, shares, compute, rng.choice(REGIONS), t, **fields)
        trace.append(job)
        t += rng.expovariate(rate_per_s)
    return trace


def launch(
    env: simpy.Environment,
    market: Market,
    trace: Sequence[jobs.Job],
    rng: random.Random,
    *,
    run=jobs.run,
) -> None:
    """Start each job of ``trace`` at its arrival time, as ``run`` (``jobs.run``, or
    ``gangs.run`` for jobs of several GPUs) drives it."""

    def arrivals():
        for job in trace:
            yield env.timeout(max(0.0, job.arrived_s - env.now))
            env.process(run(env, market, job, rng))

    env.process(arrivals())


def with_fields(trace: Sequence[jobs.Job], **fields) -> list[jobs.Job]:
    """``Job.fresh`` of every job of ``trace``: the same arrivals, another policy."""
    return [job.fresh(**fields) for job in trace]
