"""A consumer's job in the simulated world: lease, compute in turns, survive its host.

A job needs ``compute_s`` seconds of device time on the reference GPU (an RTX 4090;
faster GPUs need proportionally less). It leases shares through the market, then
alternates bursts on the leased GPU with idle time so that, alone on a GPU, it computes
``duty`` of the time. When its host vanishes it either fails over (a new lease, the
state from its last checkpoint, the measured failover pause) or, without failover,
starts again from nothing.

Whom it leases from is the node's own choice, made by the same sans-IO core
(``market.hostchoice.HostChoice``): the ranked offers go in, ``Propose``, ``Wait`` or
``GiveUp`` comes out. A host that vanished is set aside for a backoff and taken back once
it announces again; a job with no usable host after a failure waits for one up to its
``patience_s`` (the node's ``--wait-for-host``), then gives up. The first match waits as
long as it takes (demand queues in these worlds).
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass, field

import simpy

from ..host.scheduler import lease_rank
from ..market.hostchoice import BackoffPolicy, GiveUp, HostChoice, Wait
from ..market.messages import Bid, PriorityClass
from .gpu import DeviceGone
from .market import Market
from .world import CHECKPOINT_S_PER_MB, FAILOVER_S, Workload

#: Device seconds (reference GPU) per burst; see ``gpu.py`` on why the length is free.
BURST_S = 5.0
#: How long a consumer that found no offer waits before bidding again.
RETRY_S = 30.0


class Preempted(Exception):
    """The job's host gave its shares to an on-demand lease."""


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
    host_policy: BackoffPolicy = BackoffPolicy()
    patience_s: float = 1800.0  # after a failure: how long to wait for a usable host
    state_mb: float = 1000.0
    burst_s: float = BURST_S
    gpus: int = 1  # ranks, each on a device of its own (``gangs.run``); compute_s is each one's
    # Outcomes.
    leased_s: float | None = None
    done_s: float | None = None
    busy_wall_s: float = 0.0  # wall time it spent computing, at its hosts' speeds
    ideal_s: float = 0.0  # wall time it would have needed alone on the GPUs it got
    cost: float = 0.0
    remaining_s: float = 0.0  # reference device seconds still to compute
    saved_s: float = 0.0  # remaining_s as of the last checkpoint
    paid_share_price: list[int] = field(default_factory=list)
    leased_models: list[str] = field(default_factory=list)  # each lease's GPU, in order
    failovers: int = 0
    restarts: int = 0
    preemptions: int = 0
    gave_up_s: float | None = None  # when it gave up waiting for a usable host
    held_s: float = 0.0  # wall time held after failures, waiting for a usable host
    lost_device_s: float = 0.0  # reference device seconds computed, then lost
    checkpoint_s: float = 0.0

    def fresh(self, **fields) -> Job:
        """A copy with no outcomes (``dataclasses.replace`` would share the price list)
        and ``fields`` changed: the same job, run under another policy."""
        return dataclasses.replace(self, paid_share_price=[], leased_models=[], **fields)

    @property
    def slowdown(self) -> float | None:
        """Its wall time on the GPUs over what it would have taken alone on them."""
        if self.done_s is None or self.leased_s is None or self.ideal_s <= 0:
            return None
        return (self.done_s - self.leased_s) / self.ideal_s


def run(env: simpy.Environment, market: Market, job: Job, rng: random.Random):
    """The job's life, as a simpy process."""
    identity = market.identity()
    job.remaining_s = job.saved_s = job.compute_s
    choice = HostChoice(job.host_policy, job.patience_s)
    choice.search(now=market.now(), patience_s=math.inf)
    while job.remaining_s > 0:
        granted = yield from find_lease(env, market, job, choice, identity, rng)
        if granted is None:
            break
        job.paid_share_price.append(granted.proposal.price)
        job.leased_models.append(granted.host.model.name)
        host = granted.host
        host.jobs[env.active_process] = None
        lost = False
        try:
            yield from _work(env, job, host, granted, rng, market)
        except Preempted:
            # Unblamed: the host is set aside until it announces again, as the node does.
            # Counted as losing the work since the checkpoint, though the host parks the
            # state: a resume elsewhere restores from the checkpoint.
            lost = True
            job.preemptions += 1
            choice.left(host.peer, now=market.now())
        except (simpy.Interrupt, DeviceGone):
            lost = True
            set_aside(choice, market, host.peer, granted.proposal.offer_nonce)
            if job.checkpoint_every_s is None:
                job.restarts += 1
                job.saved_s = job.compute_s
            else:
                job.failovers += 1
        finally:
            host.jobs.pop(env.active_process, None)
            host.gpu.forget(job)
            job.cost += market.settle(granted)
        if lost:  # back to the last checkpoint (a restart's is the start), then reattach
            job.lost_device_s += job.saved_s - job.remaining_s
            job.remaining_s = job.saved_s
            yield env.timeout(FAILOVER_S)  # noticing the loss and reattaching (measured)
            choice.search(now=market.now())
    if job.gave_up_s is None:
        job.done_s = env.now


def find_lease(env, market: Market, job: Job, choice: HostChoice, identity, rng: random.Random):
    """Bid, rank and propose as ``choice`` says until a host grants (a generator):
    returns the ``Granted``, or None once the job gave up (``job.gave_up_s`` set). Counts
    the job's first lease (``leased_s``) and the time it was held waiting (``held_s``)."""
    consumer = identity.peer_id.to_base58()

    # Each round bids anew, but only a round that proposes reads its bid: ranking reads
    # the terms, the same every round. Most rounds find nothing and wait, so a round
    # draws its bid's ids and builds the bid (a Bid checks every field) only to propose.
    def bid(ids: tuple[str, int]) -> Bid:
        return market.bid(
            consumer, shares=job.shares, max_price=job.max_price, priority=job.priority, ids=ids
        )

    asked = bid(("terms", 0))
    held_since: float | None = None
    while True:
        ids = market.bid_ids()
        ranked = market.rank(job.region, asked)
        now = market.now()
        offers = {}
        for candidate in ranked:
            choice.see_offer(candidate.offer.host, candidate.offer.nonce, now=now)
            offers.setdefault(candidate.offer.host, candidate.offer)
        decision = choice.next_step(list(offers), now=now)
        if type(decision) is GiveUp:
            job.gave_up_s = env.now
            return None
        granted = None
        if type(decision) is not Wait:
            granted = yield from market.lease(
                identity,
                job.region,
                bid(ids),
                [offers[h] for h in decision.hosts],
                pay_as_bid=job.pay_as_bid,
                unreachable=lambda host: choice.failed(host, now=market.now()),
            )
        if granted is None:
            held_since = env.now if held_since is None else held_since
            yield env.timeout(RETRY_S * rng.uniform(0.5, 1.5))
            continue
        choice.leased(granted.host.peer, now=market.now())
        if job.leased_s is None:
            job.leased_s = env.now
        elif held_since is not None:
            job.held_s += env.now - held_since
        return granted


def set_aside(choice: HostChoice, market: Market, peer: str, nonce: int) -> None:
    """Tell the choice ``peer`` failed, after every offer of its the book still holds
    (they are from before the failure), as the node's shell does."""
    now = market.now()
    for resting in market.book.offers():
        if resting.order.host == peer:
            choice.see_offer(peer, resting.order.nonce, now=now)
    choice.failed(peer, now=now, nonce=nonce)


def _work(env, job: Job, host, granted, rng: random.Random, market: Market):
    """Compute on ``host`` until the job is done, checkpointing as it goes; stops at a
    burst's end once the host preempted its lease.

    Raises:
        Preempted: the host gave the lease's shares to an on-demand lease.
    """
    speed = host.model.perf_units / 100
    rank = lease_rank(job.priority == PriorityClass.ON_DEMAND, granted.proposal.price)
    checkpoint_wall = job.state_mb * CHECKPOINT_S_PER_MB
    checkpointed_at = env.now
    while job.remaining_s > 0:
        burst = min(job.burst_s, job.remaining_s)
        wall = burst / speed
        idle = wall * (1 - job.workload.duty) / job.workload.duty
        yield env.timeout(rng.expovariate(1 / idle) if idle > 0 else 0)
        if granted.proposal.lease_id in market.preempted:
            raise Preempted
        yield from host.gpu.compute(job, rank, wall, job.shares)
        job.remaining_s -= burst
        job.busy_wall_s += wall
        job.ideal_s += wall + idle
        every = job.checkpoint_every_s
        if every is not None and env.now - checkpointed_at >= every and job.remaining_s > 0:
            yield env.timeout(checkpoint_wall)
            job.checkpoint_s += checkpoint_wall
            job.saved_s, checkpointed_at = job.remaining_s, env.now
