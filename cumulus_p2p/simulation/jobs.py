"""A consumer's job in the simulated world: lease, compute in turns, survive its host.

A job needs ``compute_s`` seconds of device time on the reference GPU (an RTX 4090;
faster GPUs need proportionally less). It leases shares through the market, then
alternates bursts on the leased GPU with idle time so that, alone on a GPU, it computes
``duty`` of the time. When its host vanishes it either fails over (a new lease, the
state from its last checkpoint, the measured failover pause) or, without failover,
starts again from nothing.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

import simpy

from ..market.messages import PriorityClass
from ..remote.scheduler import lease_rank
from .gpu import DeviceGone
from .market import Market
from .world import CHECKPOINT_S_PER_MB, FAILOVER_S, Workload

#: Device seconds (reference GPU) per burst; see ``gpu.py`` on why the length is free.
BURST_S = 5.0
#: How long a consumer that found no offer waits before bidding again.
RETRY_S = 30.0


@dataclass(eq=False)
class Job:
    """One job: what it needs, how it bids, and what happened to it."""

    index: int
    workload: Workload
    shares: int
    compute_s: float
    region: str
    arrived_s: float
    max_price: int = 2**40
    priority: PriorityClass = PriorityClass.ON_DEMAND
    pay_as_bid: bool = False
    checkpoint_every_s: float | None = None  # None: no failover (restart instead)
    state_mb: float = 1000.0
    burst_s: float = BURST_S
    # Outcomes.
    leased_s: float | None = None
    done_s: float | None = None
    busy_wall_s: float = 0.0  # wall time it spent computing, at its hosts' speeds
    ideal_s: float = 0.0  # wall time it would have needed alone on the GPUs it got
    cost: float = 0.0
    remaining_s: float = 0.0  # reference device seconds still to compute
    saved_s: float = 0.0  # remaining_s as of the last checkpoint
    paid_share_price: list[int] = field(default_factory=list)
    failovers: int = 0
    restarts: int = 0
    lost_device_s: float = 0.0  # reference device seconds computed, then lost
    checkpoint_s: float = 0.0

    def fresh(self, **fields) -> Job:
        """A copy with no outcomes (``dataclasses.replace`` would share the price list)
        and ``fields`` changed: the same job, run under another policy."""
        return dataclasses.replace(self, paid_share_price=[], **fields)

    @property
    def slowdown(self) -> float | None:
        """Its wall time on the GPUs over what it would have taken alone on them."""
        if self.done_s is None or self.leased_s is None or self.ideal_s <= 0:
            return None
        return (self.done_s - self.leased_s) / self.ideal_s


def run(env: simpy.Environment, market: Market, job: Job, rng: random.Random):
    """The job's life, as a simpy process."""
    identity = market.identity()
    consumer = identity.peer_id.to_base58()
    job.remaining_s = job.saved_s = job.compute_s
    avoid: frozenset[str] = frozenset()
    while job.remaining_s > 0:
        bid = market.bid(consumer, shares=job.shares, max_price=job.max_price,
                         priority=job.priority)  # fmt: skip
        granted = yield from market.lease(identity, job.region, bid, pay_as_bid=job.pay_as_bid,
                                          avoid=avoid)  # fmt: skip
        if granted is None:
            yield env.timeout(RETRY_S * rng.uniform(0.5, 1.5))
            continue
        if job.leased_s is None:
            job.leased_s = env.now
        job.paid_share_price.append(granted.proposal.price)
        host = granted.host
        host.jobs[env.active_process] = None
        lost = False
        try:
            yield from _work(env, job, host, granted, rng)
        except (simpy.Interrupt, DeviceGone):
            lost = True
            # Its offer may still rest in stale books; once back, the host is fair game.
            avoid = frozenset({host.peer})
            if job.checkpoint_every_s is None:
                job.restarts += 1
                job.saved_s = job.compute_s
            else:
                job.failovers += 1
            job.lost_device_s += job.saved_s - job.remaining_s
            job.remaining_s = job.saved_s
        finally:
            host.jobs.pop(env.active_process, None)
            job.cost += market.settle(granted)
        if lost:  # noticing the loss and reattaching (measured; a restart pays it too)
            yield env.timeout(FAILOVER_S)
    job.done_s = env.now


def _work(env, job: Job, host, granted, rng: random.Random):
    """Compute on ``host`` until the job is done, checkpointing as it goes."""
    speed = host.model.perf_units / 100
    rank = lease_rank(job.priority == PriorityClass.ON_DEMAND, granted.proposal.price)
    checkpoint_wall = job.state_mb * CHECKPOINT_S_PER_MB
    checkpointed_at = env.now
    while job.remaining_s > 0:
        burst = min(job.burst_s, job.remaining_s)
        wall = burst / speed
        idle = wall * (1 - job.workload.duty) / job.workload.duty
        yield env.timeout(rng.expovariate(1 / idle) if idle > 0 else 0)
        yield from host.gpu.compute(job, rank, wall)
        job.remaining_s -= burst
        job.busy_wall_s += wall
        job.ideal_s += wall + idle
        every = job.checkpoint_every_s
        if every is not None and env.now - checkpointed_at >= every and job.remaining_s > 0:
            yield env.timeout(checkpoint_wall)
            job.checkpoint_s += checkpoint_wall
            job.saved_s, checkpointed_at = job.remaining_s, env.now
