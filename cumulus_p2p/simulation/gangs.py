"""Jobs of N GPUs in the simulated world: data parallel across N leased hosts, under churn.

A job of ``Job.gpus`` ranks leases one device per rank. The consumer ranks the offers and
lets the market's own core choose them (``market.gang.plan_gang``: the closest hosts, then
the fewest, then the cheapest), then proposes to each. Each step, every rank computes a
burst on its device and the ranks all-reduce their gradients: the step ends when the
slowest rank and the all-reduce are done. ``Job.compute_s`` is each rank's share of the
device time.

A host that vanishes takes its rank's step with it, and the job learns it at the step's
all-reduce: every rank goes back to the last checkpoint (DDP has one consistent state),
the lost hosts' leases end, and replacements for them alone are leased (the surviving
leases are kept) before the job goes on. Without failover the job starts over from
nothing on the same terms. So the chance that a step is lost grows with the number of
hosts: what the churn scenario's ``gangs`` rows measure.

All-reduce costs are ASSUMED, not measured here (``benchmarks/`` has no collective
bench yet): a ring all-reduce of ``GRADIENT_MB`` over links of ``LINK_MB_S`` between the
hosts, plus two round trips per ring step across the gang's diameter.
"""

from __future__ import annotations

import random

import simpy

from ..host.scheduler import lease_rank
from ..market.gang import plan_gang
from ..market.messages import PriorityClass
from .gpu import DeviceGone
from .jobs import RETRY_S, Job
from .market import Granted, Market
from .world import CHECKPOINT_S_PER_MB, FAILOVER_S, rtt_ms

#: Gradient bytes a step all-reduces (ASSUMED): the churn scenario's 125M-parameter
#: model, its gradients in fp32.
GRADIENT_MB = 500.0
#: Bandwidth between two hosts of a job (ASSUMED): 1 Gbit/s.
LINK_MB_S = 125.0


def allreduce_s(ranks: int, diameter_ms: float) -> float:
    """Seconds a ring all-reduce of ``GRADIENT_MB`` among ``ranks`` hosts takes: each
    sends and receives ``2 (n - 1) / n`` of the bytes, in ``2 (n - 1)`` steps that each
    wait a round trip across the gang at worst."""
    if ranks < 2:
        return 0.0
    steps = 2 * (ranks - 1)
    return steps / ranks * GRADIENT_MB / LINK_MB_S + steps * diameter_ms / 1000


def run(env: simpy.Environment, market: Market, job: Job, rng: random.Random):
    """The life of a job of ``job.gpus`` ranks, as a simpy process."""
    identity = market.identity()
    job.remaining_s = job.saved_s = job.compute_s
    members: list[Granted] = []
    try:
        while job.remaining_s > 0:
            if not (yield from _fill(env, market, job, identity, members, rng)):
                break  # gave up waiting for hosts
            if (yield from _steps(env, market, job, members)):
                break  # done
            lost = [g for g in members if not g.host.online]
            for granted in lost:
                members.remove(granted)
                job.cost += market.settle(granted)
            if job.checkpoint_every_s is None:
                job.restarts += 1
                job.saved_s = job.compute_s
            else:
                job.failovers += 1
            job.lost_device_s += (job.saved_s - job.remaining_s) * job.gpus
            job.remaining_s = job.saved_s
            yield env.timeout(FAILOVER_S)
    finally:
        for granted in members:
            granted.host.gpu.forget((job, granted.proposal.lease_id))
            job.cost += market.settle(granted)
    if job.gave_up_s is None:
        job.done_s = env.now


def _fill(env, market: Market, job: Job, identity, members: list[Granted], rng):
    """Lease devices until ``members`` holds ``job.gpus`` (a generator); False once the
    job gave up (held past ``patience_s`` after its first lease)."""
    consumer = identity.peer_id.to_base58()
    held_since = None

    def between_hosts(a: str, b: str) -> float:
        return rtt_ms(market.hosts[a].region, market.hosts[b].region)

    while len(members) < job.gpus:
        wanted = job.gpus - len(members)
        bid = market.bid(
            consumer, shares=job.shares, max_price=job.max_price, priority=job.priority
        )
        taken = {g.host.peer for g in members}
        ranked = market.rank(job.region, bid, limit=4 * job.gpus + 8)
        ranked = [r for r in ranked if r.offer.host not in taken]
        gang = plan_gang(ranked, wanted, rtt_ms=between_hosts)
        granted_now: list[Granted] = []
        for member in gang.members if gang is not None else ():
            granted = yield from market.lease(identity, job.region, bid, [member.offer])
            if granted is None:
                break
            granted_now.append(granted)
        if gang is not None and len(granted_now) == wanted:
            members.extend(granted_now)
            break
        for granted in granted_now:  # a gang leased in part cannot run: let it go
            job.cost += market.settle(granted)
        now = env.now
        held_since = now if held_since is None else held_since
        if job.leased_s is not None and now - held_since > job.patience_s:
            job.gave_up_s = now
            return False
        yield env.timeout(RETRY_S * rng.uniform(0.5, 1.5))
    if job.leased_s is None:
        job.leased_s = env.now
    elif held_since is not None:
        job.held_s += env.now - held_since
    return True


def _steps(env, market: Market, job: Job, members: list[Granted]):
    """Run steps on ``members`` until the job is done (True) or a host was lost (False),
    checkpointing every ``checkpoint_every_s`` (a generator)."""
    regions = [g.host.region for g in members]
    diameter = max((rtt_ms(a, b) for a in regions for b in regions), default=0.0)
    sync_s = allreduce_s(len(members), diameter)
    checkpoint_wall = job.state_mb * CHECKPOINT_S_PER_MB
    checkpointed_at = env.now
    on_demand = job.priority == PriorityClass.ON_DEMAND
    while job.remaining_s > 0:
        burst = min(job.burst_s, job.remaining_s)
        walls = [burst / (g.host.model.perf_units / 100) for g in members]
        ranks = [
            env.process(_burst(g, (job, g.proposal.lease_id), on_demand, wall, job.shares))
            for g, wall in zip(members, walls, strict=True)
        ]
        finished = yield env.all_of(ranks)
        if not all(finished.values()) or not all(g.host.online for g in members):
            return False
        yield env.timeout(sync_s)
        job.remaining_s -= burst
        job.busy_wall_s += max(walls) + sync_s
        job.ideal_s += max(walls)
        every = job.checkpoint_every_s
        if every is not None and env.now - checkpointed_at >= every and job.remaining_s > 0:
            yield env.timeout(checkpoint_wall)
            job.checkpoint_s += checkpoint_wall * job.gpus
            job.saved_s, checkpointed_at = job.remaining_s, env.now
    return True


def _burst(granted: Granted, ticket, on_demand: bool, wall: float, shares: int):
    """One rank's burst on its device: True once computed, False if its host left."""
    rank = lease_rank(on_demand, granted.proposal.price)
    try:
        yield from granted.host.gpu.compute(ticket, rank, wall, shares)
    except DeviceGone:
        return False
    return True
