"""Scenario (b): price against priority on shared GPUs.

Fine-tuning jobs arrive faster than the fleet can serve them, so every GPU is shared
and contended. Each job bids a multiple of the market's median share price (0.6x to
2x) and is on-demand or interruptible, half and half. Two strategies over the same
jobs: *ask*, proposing each offer's own price as ``cumulus-node`` does today, and
*pay-as-bid*, proposing the bid's limit (a lease may pay more than the asking price,
and the executor's ``DeviceQueue`` serves dearer leases first within a class).

Read, per bid level and class: how many jobs got a lease, how long they waited for it,
how much slower than alone they ran, and what they paid against the median.
"""

from __future__ import annotations

import random
import statistics

import simpy

from ..market.messages import PriorityClass
from .market import Market
from .population import add_hosts, job_trace, launch, mean_hold_s
from .world import WORKLOADS

FINE_TUNING = tuple(w for w in WORKLOADS if w.name == "fine-tuning")
MULTIPLIERS = (0.6, 0.8, 1.0, 1.25, 1.5, 2.0)
STRATEGIES = ("ask", "pay-as-bid")
CLASSES = {"on-demand": PriorityClass.ON_DEMAND, "interruptible": PriorityClass.INTERRUPTIBLE}


def run(seed: int, *, quick: bool) -> dict:
    """Both strategies over the same jobs; rows per strategy, class and bid level."""
    hosts, horizon_h = (12, 8.0) if quick else (48, 24.0)
    rows, savings = [], {}
    for strategy in STRATEGIES:
        jobs, median = simulate(seed, strategy, hosts=hosts, horizon_h=horizon_h)
        for class_name, priority in CLASSES.items():
            for m in MULTIPLIERS:
                group = [j for j, jm in jobs if j.priority == priority and jm == m]
                rows.append(
                    {
                        "strategy": strategy,
                        "class": class_name,
                        "bid_multiple": m,
                        **_figures(group, median),
                    }
                )
        savings[strategy] = _interruptible_saving([j for j, _ in jobs], median)
    return {
        "scenario": "priority",
        "seed": seed,
        "quick": quick,
        "hosts": hosts,
        "horizon_h": horizon_h,
        "rows": rows,
        "interruptible_saving": savings,
        "claimed_interruptible_saving": "50-80% (Vast.ai)",
    }


def simulate(seed: int, strategy: str, *, hosts: int, horizon_h: float):
    """One run; returns the jobs with their bid multiples, and the median share price."""
    rng = random.Random(seed)
    env = simpy.Environment()
    market = Market(env, rng, mesh_nodes=hosts * 4)
    fleet = add_hosts(market, hosts, rng)
    median = statistics.median(h.price for h in fleet)
    rate = 3.0 * hosts / mean_hold_s(FINE_TUNING)
    trace = job_trace(
        random.Random(seed + 1), FINE_TUNING, rate_per_s=rate, horizon_s=horizon_h * 3600
    )
    bids = random.Random(seed + 2)
    jobs = []
    for job in trace:
        m = bids.choice(MULTIPLIERS)
        priority = bids.choice(list(CLASSES.values()))
        jobs.append(
            (
                job.fresh(
                    max_price=round(m * median),
                    priority=priority,
                    pay_as_bid=strategy == "pay-as-bid",
                ),
                m,
            )
        )
    launch(env, market, [j for j, _ in jobs], rng)
    env.run(until=horizon_h * 3600)
    for granted in list(market.active.values()):
        market.settle(granted)
    return jobs, median


def _figures(group, median: int) -> dict:
    leased = [j for j in group if j.leased_s is not None]
    done = [j for j in leased if j.done_s is not None]
    paid = [p for j in leased for p in j.paid_share_price]
    return {
        "jobs": len(group),
        "leased_share": round(len(leased) / len(group), 3) if group else None,
        "wait_mean_s": round(statistics.fmean(j.leased_s - j.arrived_s for j in leased), 1)
        if leased
        else None,
        "slowdown_mean": round(statistics.fmean(j.slowdown for j in done), 3) if done else None,
        "paid_vs_median": round(statistics.fmean(paid) / median, 3) if paid else None,
    }


def _interruptible_saving(jobs, median: int) -> float | None:
    """1 - (mean price interruptible leases paid) / (mean price on-demand ones paid)."""
    paid = {
        priority: [p for j in jobs if j.priority == priority for p in j.paid_share_price]
        for priority in CLASSES.values()
    }
    if not all(paid.values()):
        return None
    ratio = statistics.fmean(paid[PriorityClass.INTERRUPTIBLE]) / statistics.fmean(
        paid[PriorityClass.ON_DEMAND]
    )
    return round(1 - ratio, 3)
