"""Scenario (b): price against priority on shared GPUs.

Fine-tuning jobs arrive faster than the fleet can serve them, so every GPU is shared
and contended. Each job bids a multiple of the market's median share price (0.6x to
2x). Three strategies over the same jobs:

- *ask*: half the jobs on-demand, half interruptible, each proposing the offer's own
  price, as ``cumulus-node`` did before contending leases;
- *pay-as-bid*: the same, proposing the bid's limit (a lease may pay more than the
  asking price, and the executor's ``DeviceQueue`` serves dearer leases first);
- *contend*: every host also sells ``CONTEND_SHARES`` contending shares beyond its
  on-demand ones, at a contend price of ``CONTEND_FLOOR`` of its ask, and the
  interruptible half bids ``--priority contend`` instead: it pays the contend price
  (``market.pricing``), and ranks below on-demand tenants on the device. The on-demand
  half of that run, run alone (the contending jobs left out), is the baseline its
  slowdown is compared with;
- *contend-pay-as-bid*: the same market, but a contending tenant pays its bid's limit
  (at most the ask): the pricing ``market.pricing`` was chosen against;
- *whole-gpu*: the same jobs renting whole GPUs on demand at the ask, one tenant per GPU,
  as the marketplaces without sharing rent them: the baseline of host earnings.

Read, per bid level and class: how many jobs got a lease, how long they waited for it,
how much slower than alone they ran, and what they paid against the median. The
top-level keys are issue 31's, from the contend run: ``contending_saving``,
``on_demand_slowdown_ratio``, ``leased_within_1h_at_0_8``, ``mix_utilization`` (device
time computed over device time there was) and ``host_earnings_over_whole_gpu`` (hosts'
earnings per GPU-hour over the whole-gpu run's); ``contending_saving_pay_as_bid`` is the
saving under the other pricing.
"""

from __future__ import annotations

import random
import statistics

import simpy

from ..market.messages import PriorityClass
from .market import Market
from .population import add_hosts, job_trace, launch, mean_hold_s
from .world import SHARES_PER_GPU, WORKLOADS

FINE_TUNING = tuple(w for w in WORKLOADS if w.name == "fine-tuning")
MULTIPLIERS = (0.6, 0.8, 1.0, 1.25, 1.5, 2.0)
STRATEGIES = ("ask", "pay-as-bid", "contend-pay-as-bid", "contend")
CLASSES = {
    "on-demand": PriorityClass.ON_DEMAND,
    "interruptible": PriorityClass.INTERRUPTIBLE,
    "contend": PriorityClass.CONTEND,
}
#: A host's contend price, as a fraction of its ask, in the contend strategies.
CONTEND_FLOOR = 0.4
#: Contending shares a host sells beyond its on-demand ones, in the contend strategies.
CONTEND_SHARES = SHARES_PER_GPU
#: The cheaper class each strategy's other half of the jobs bids in.
_CHEAPER = {
    "ask": PriorityClass.INTERRUPTIBLE,
    "pay-as-bid": PriorityClass.INTERRUPTIBLE,
    "contend-pay-as-bid": PriorityClass.CONTEND,
    "contend": PriorityClass.CONTEND,
}


def run(seed: int, *, quick: bool) -> dict:
    """Every strategy over the same jobs; rows per strategy, class and bid level."""
    hosts, horizon_h = (12, 8.0) if quick else (48, 24.0)
    rows, savings, runs = [], {}, {}
    for strategy in STRATEGIES:
        runs[strategy] = simulate(seed, strategy, hosts=hosts, horizon_h=horizon_h)
        jobs, median, _, _ = runs[strategy]
        for class_name, priority in CLASSES.items():
            for m in MULTIPLIERS:
                group = [j for j, jm in jobs if j.priority == priority and jm == m]
                if not group:
                    continue
                rows.append(
                    {
                        "strategy": strategy,
                        "class": class_name,
                        "bid_multiple": m,
                        **_figures(group, median),
                    }
                )
        savings[strategy] = _saving([j for j, _ in jobs], _CHEAPER[strategy])
    alone = simulate(seed, "contend", hosts=hosts, horizon_h=horizon_h, on_demand_only=True)[0]
    whole = simulate(seed, "whole-gpu", hosts=hosts, horizon_h=horizon_h)
    return {
        "scenario": "priority",
        "seed": seed,
        "quick": quick,
        "hosts": hosts,
        "horizon_h": horizon_h,
        "rows": rows,
        "interruptible_saving": {k: savings[k] for k in ("ask", "pay-as-bid")},
        "claimed_interruptible_saving": "50-80% (Vast.ai)",
        **_contend_keys(runs["contend"], alone, whole_gpu_earnings=whole[3]),
        "contending_saving_pay_as_bid": savings["contend-pay-as-bid"],
        "whole_gpu_leased_share": round(
            sum(j.leased_s is not None for j, _ in whole[0]) / len(whole[0]), 3
        ),
    }


def simulate(
    seed: int, strategy: str, *, hosts: int, horizon_h: float, on_demand_only: bool = False
):
    """One run; returns the jobs with their bid multiples, the median share price, the
    fleet's utilization (device time computed over device time there was) and the hosts'
    earnings per GPU-hour. ``on_demand_only``: the same run without the jobs of the
    cheaper class."""
    rng = random.Random(seed)
    env = simpy.Environment()
    market = Market(env, rng, mesh_nodes=hosts * 4)
    contend = strategy.startswith("contend")
    fleet = add_hosts(
        market,
        hosts,
        rng,
        contend_floor=CONTEND_FLOOR if contend else 0.0,
        contend_shares=CONTEND_SHARES if contend else 0,
    )
    median = statistics.median(h.price for h in fleet)
    rate = 3.0 * hosts / mean_hold_s(FINE_TUNING)
    trace = job_trace(
        random.Random(seed + 1), FINE_TUNING, rate_per_s=rate, horizon_s=horizon_h * 3600
    )
    bids = random.Random(seed + 2)
    jobs = []
    for job in trace:
        m = bids.choice(MULTIPLIERS)
        # Drawn in every strategy (whole-gpu ignores it), so each run gets the same bids.
        priority = bids.choice([PriorityClass.ON_DEMAND, _CHEAPER.get(strategy)])
        if on_demand_only and priority is not PriorityClass.ON_DEMAND:
            continue
        jobs.append((job.fresh(**_terms(strategy, priority, round(m * median))), m))
    launch(env, market, [j for j, _ in jobs], rng)
    env.run(until=horizon_h * 3600)
    for granted in list(market.active.values()):
        market.settle(granted)
    utilization = sum(h.gpu.busy_s for h in fleet) / (len(fleet) * horizon_h * 3600)
    earnings = sum(h.earned for h in fleet) / (len(fleet) * horizon_h)
    return jobs, median, utilization, earnings


def _terms(strategy: str, priority: PriorityClass | None, max_price: int) -> dict:
    """How a job bids under ``strategy``; ``whole-gpu`` rents a whole GPU on demand."""
    if strategy == "whole-gpu":
        return {"max_price": max_price, "shares": SHARES_PER_GPU}
    pays_bid = strategy == "pay-as-bid" or (
        strategy == "contend-pay-as-bid" and priority is PriorityClass.CONTEND
    )
    return {"max_price": max_price, "priority": priority, "pay_as_bid": pays_bid}


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


def _saving(jobs, cheaper: PriorityClass) -> float | None:
    """1 - (mean price the cheaper class paid) / (mean price on-demand leases paid), on
    the same GPU model: the ratio per model, weighted by the cheaper class's leases there.
    (Across models, a lease on an H100 and one on an RTX 4090 would be compared.)"""
    paid: dict[tuple, list[int]] = {}
    for job in jobs:
        for price, model in zip(job.paid_share_price, job.leased_models, strict=True):
            paid.setdefault((job.priority, model), []).append(price)
    ratios, weights = [], []
    for (priority, model), prices in paid.items():
        on_demand = paid.get((PriorityClass.ON_DEMAND, model))
        if priority is cheaper and on_demand:
            ratios.append(statistics.fmean(prices) / statistics.fmean(on_demand))
            weights.append(len(prices))
    if not ratios:
        return None
    ratio = sum(r * w for r, w in zip(ratios, weights, strict=True)) / sum(weights)
    return round(1 - ratio, 3)


def _contend_keys(contend_run, alone: list, *, whole_gpu_earnings: float) -> dict:
    """Issue 31's figures, from the contend run, its on-demand jobs run alone, and the
    hosts' earnings per GPU-hour renting whole GPUs."""
    jobs, _, utilization, earnings = contend_run
    on_demand = _mean_slowdown(j for j, _ in jobs if j.priority == PriorityClass.ON_DEMAND)
    by_itself = _mean_slowdown(j for j, _ in alone)
    at_0_8 = [j for j, m in jobs if j.priority == PriorityClass.CONTEND and m == 0.8]
    within = [j for j in at_0_8 if j.leased_s is not None and j.leased_s - j.arrived_s <= 3600]
    return {
        "contending_saving": _saving([j for j, _ in jobs], PriorityClass.CONTEND),
        "on_demand_slowdown_ratio": (
            round(on_demand / by_itself, 3) if on_demand and by_itself else None
        ),
        "leased_within_1h_at_0_8": round(len(within) / len(at_0_8), 3) if at_0_8 else None,
        "mix_utilization": round(utilization, 3),
        "host_earnings_over_whole_gpu": (
            round(earnings / whole_gpu_earnings, 3) if whole_gpu_earnings else None
        ),
        "contend_floor": CONTEND_FLOOR,
    }


def _mean_slowdown(jobs) -> float | None:
    slowdowns = [j.slowdown for j in jobs if j.slowdown is not None]
    return statistics.fmean(slowdowns) if slowdowns else None
