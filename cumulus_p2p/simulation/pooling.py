"""Scenario (a): fractional pooling against whole-GPU allocation.

The same hosts and the same arriving jobs run twice. Under *whole-GPU* allocation each
job leases all of a GPU's shares, as on a marketplace that rents whole cards. Under
*pooling* it leases the shares its memory needs, and the tenants of a GPU take turns
on it through the executor's ``DeviceQueue``. Two loads: *saturated* (jobs arrive four
times faster than whole GPUs free up, so every GPU always has someone waiting: this is
where utilization is read) and *moderate* (0.8 of whole-GPU capacity: queueing time,
cost and earnings are read there).

The mix and inference run pooled twice more, on hosts that sell their memory 1.5 and 2
times over (``--overcommit``): more tenants per GPU, whose idle memory is paged out to
make room (``gpu.py``). Utilization and slowdown are read against the pooled run at 1.0.
"""

from __future__ import annotations

import random
import statistics

import simpy

from .market import Market
from .population import add_hosts, job_trace, launch, mean_hold_s, with_fields
from .world import SHARES_PER_GPU, WORKLOADS

#: hosted.ai's whole-GPU utilization figures, which pooling should lift toward 100%.
CLAIMED_WHOLE_GPU = {"inference": 0.15, "fine-tuning": 0.50, "training": 0.70}
LOADS = {"saturated": 4.0, "moderate": 0.8}
MIXES = {**{w.name: (w,) for w in WORKLOADS}, "mix": WORKLOADS}
#: The overcommitted policies, run on the mix: policy name -> memory sold over held.
OVERCOMMITTED = {"pooled-1.5x": 1.5, "pooled-2x": 2.0}
#: The mixes run overcommitted: the mix, and inference, whose GPUs fill up on memory
#: (eight tenants of 1-2 shares) while their compute idles.
OVERCOMMITTED_MIXES = ("inference", "mix")


def run(seed: int, *, quick: bool) -> dict:
    """Every mix under both policies and both loads; returns the scenario's figures."""
    hosts, horizon_h = (8, 6.0) if quick else (48, 24.0)
    rows = []
    for load_name, load in LOADS.items():
        for mix_name, mix in MIXES.items():
            paged = mix_name in OVERCOMMITTED_MIXES
            policies = ["whole-GPU", "pooled"] + (list(OVERCOMMITTED) if paged else [])
            for policy in policies:
                row = simulate(seed, mix, policy, load, hosts=hosts, horizon_h=horizon_h)
                rows.append({"mix": mix_name, "policy": policy, "load": load_name, **row})
    return {
        "scenario": "pooling",
        "seed": seed,
        "quick": quick,
        "hosts": hosts,
        "horizon_h": horizon_h,
        "loads": LOADS,
        "claimed_whole_gpu_utilization": CLAIMED_WHOLE_GPU,
        "rows": rows,
    }


def simulate(seed: int, mix, policy: str, load: float, *, hosts: int, horizon_h: float) -> dict:
    """One run: ``load`` times whole-GPU capacity of ``mix`` jobs under ``policy``."""
    rng = random.Random(seed)
    env = simpy.Environment()
    market = Market(env, rng, mesh_nodes=hosts * 4)
    fleet = add_hosts(market, hosts, rng, overcommit=OVERCOMMITTED.get(policy, 1.0))
    horizon_s, warmup_s = horizon_h * 3600, 3600.0
    rate = load * hosts / mean_hold_s(mix)
    trace = job_trace(random.Random(seed + 1), mix, rate_per_s=rate, horizon_s=horizon_s)
    if policy == "whole-GPU":
        trace = with_fields(trace, shares=SHARES_PER_GPU)
    launch(env, market, trace, rng)
    env.run(until=warmup_s)
    busy_at_warmup = sum(h.gpu.busy_s for h in fleet)
    env.run(until=horizon_s)
    busy = sum(h.gpu.busy_s for h in fleet) - busy_at_warmup
    paging = sum(h.gpu.paging_s for h in fleet)
    for granted in list(market.active.values()):  # bill what is still running
        market.settle(granted)
    done = [j for j in trace if j.done_s is not None]
    waits = [j.leased_s - j.arrived_s for j in trace if j.leased_s is not None]
    compute_h = sum(j.compute_s for j in done) / 3600
    return {
        "utilization": round(busy / (hosts * (horizon_s - warmup_s)), 4),
        "overcommit": OVERCOMMITTED.get(policy, 1.0),
        # The device's time spent copying tenants' memory in and out (the whole run).
        "paging_share": round(paging / (hosts * horizon_s), 4),
        "page_ins": sum(h.gpu.page_ins for h in fleet),
        "jobs_arrived": len(trace),
        "jobs_done": len(done),
        "never_leased": sum(j.leased_s is None for j in trace),
        "queue_wait_mean_s": round(statistics.fmean(waits), 1) if waits else None,
        "queue_wait_p95_s": round(_p95(waits), 1) if waits else None,
        "slowdown_mean": round(statistics.fmean(j.slowdown for j in done), 3) if done else None,
        "cost_per_compute_hour": round(sum(j.cost for j in done) / compute_h, 4) if done else None,
        "host_earnings_per_gpu_hour": round(sum(h.earned for h in fleet) / (hosts * horizon_h), 4),
        "refusals": dict(market.refusals),
    }


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
