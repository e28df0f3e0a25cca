"""Scenario: bandwidth (issue 28): where checkpoints go, over real link rates, under churn.

Usage: python simulations/bandwidth.py [--seed N] [--quick] [--out DIR]

Theory of operation
-------------------
A session's state (weights, gradients, optimizer moments: 16 bytes per parameter with
fp32 Adam, so 1-16 GB for models of 60M-1B parameters) has to survive its host. Where
the checkpoints go decides which link carries them, and links differ by an order of
magnitude: a consumer at home has 100 Mbit/s or less, hosts in data centres 1 Gbit/s or
more between them. Two placements are compared:

- ``consumer`` (the code today): at each checkpoint the pieces that changed since the
  last one cross the consumer's *downlink* (``remote/checkpoint.py`` reads only pieces
  its store lacks, and pieces an upload filled count as held). A failover to a fresh host
  re-uploads the whole state over the consumer's *uplink*. Training waits while a
  checkpoint is read (it is taken at a sync point, in the op stream).
- ``standby`` (issue 28's design, modelled here to size it): the changed
  pieces go host-to-host to a standby host the consumer leased for storage; a failover
  pulls the whole state from the standby over host links; the consumer's link carries the
  manifest of piece digests only. ``standby`` stalls training as today's checkpoints do;
  ``standby-background`` takes the snapshot at a sync point and streams it while training
  goes on: no stall, but the next checkpoint waits until the previous one has arrived,
  so checkpoints are further apart when they take longer than the interval. This is
  what ``remote.attach(standby=...)`` does, but for the host's in-memory copy of the
  changed pieces at the sync point, which the model leaves out.

Two outputs:

1. **Steady state** per state size, training kind, placement and consumer link, in
   closed form (``steady_state``): checkpoint time per interval, the share of training
   time it takes, consumer-link bytes per hour, and the time a failover takes to resume.
   The ``calibration`` block sets the same formulas against ``benchmarks/realsize_bench.py``
   on its shaped links (BENCHMARKS.md, "Real sizes on shaped links").
2. **Churn**: the churn scenario's world (``cumulus_p2p.simulation``: real ``OrderBook``,
   ``rank_offers``, ``HostChoice``, signed leases, ``DeviceQueue``; hosts leaving at 10%
   per hour for 30 minutes on average) with every byte a job moves taking time on a link.
   The checkpoint schedule is the client's own ``remote.failover.CheckpointPolicy``, fed
   simulated time: a checkpoint at the first sync point once the interval has passed
   since the last one ended, and the interval started over after a restore.

The link model: every consumer has an uplink and a downlink, every host a host-to-host
uplink and downlink. A transfer holds its links, one transfer at a time per link, for
``bytes / rate`` of simulated time (a host-to-host transfer holds the sender's uplink and
the receiver's downlink; a consumer transfer holds only the consumer's link, whose rate
is 10x below the host's side). Rates are the nominal ones times the goodput measured on
the shaped links (95.7 of 100 Mbit/s, 959.5 of 1000).

Left out: fair sharing of one link by concurrent transfers (they queue instead; the
last finishes at the same time), round trips and TCP slow start per transfer, the op
stream's own bytes, disk and hashing speed (hashing a piece costs ~0.1 s per GiB
measured, ignored), memory for copy-on-write (a full fine-tune rewrites every storage
each step, so a background snapshot doubles the state's memory), fetching base weights
from peers (every upload comes from the consumer), the standby's storage price, a second
standby, and ``--checkpoint-to both``. A standby that leaves loses its copy (ASSUMED:
its disk goes with it); the job learns of it at its next checkpoint, which then sends the
whole state to a new standby; if the primary fails first, the only copy is gone and the
job starts over from the consumer's initial upload.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, fields

import simpy

from cumulus_p2p.blobs.names import PIECE, piece_count
from cumulus_p2p.host.scheduler import lease_rank
from cumulus_p2p.market.hostchoice import BackoffPolicy, HostChoice
from cumulus_p2p.market.messages import PriorityClass
from cumulus_p2p.node.consumer import ConsumerOptions
from cumulus_p2p.remote.failover import CheckpointPolicy
from cumulus_p2p.simulation.churn import LONG_TRAINING, come_and_go
from cumulus_p2p.simulation.cli import run_and_save, scenario_parser
from cumulus_p2p.simulation.gpu import DeviceGone
from cumulus_p2p.simulation.jobs import Job, find_lease, set_aside
from cumulus_p2p.simulation.market import Granted, Market, SimHost
from cumulus_p2p.simulation.population import add_hosts, job_trace, mean_hold_s
from cumulus_p2p.simulation.world import FAILOVER_S

GB = 1e9
MBIT = 1e6 / 8  # bytes per second
#: MEASURED (BENCHMARKS.md, "Real sizes on shaped links"): one TCP stream's goodput on the
#: links shaped with ``tc tbf``, 95.7 Mbit/s of 100 and 959.5 Mbit/s of 1000.
CONSUMER_GOODPUT = 0.957
HOST_GOODPUT = 0.9595
#: Host-to-host links, nominal (the bench's; data-centre hosts often have more).
HOST_MBIT = 1000.0
#: The consumer's default checkpoint interval (``cumulus-node --consume``).
INTERVAL_S: float = next(
    f.default for f in fields(ConsumerOptions) if f.name == "checkpoint_interval"
)
#: Device seconds (reference GPU) between sync points. Real steps are shorter; a burst
#: this long keeps the runs cheap while checkpoints still come within ~a third of an
#: interval of being due.
BURST_S = 10.0
#: Storages in a session (ASSUMED: a transformer's few hundred tensors, their optimizer
#: moments, adapters): each is one manifest entry with at least one piece digest.
STORAGES = 1000
#: A manifest's bytes per piece digest (64 hex characters in msgpack) and per entry.
DIGEST_BYTES = 66
ENTRY_BYTES = 16
STATE_GB = (1, 2, 4, 8, 16)
CHURN_PER_HOUR = 0.1


@dataclass(frozen=True, slots=True)
class LinkProfile:
    """A consumer's connection, nominal Mbit/s each way."""

    name: str
    down_mbit: float
    up_mbit: float

    @property
    def down(self) -> float:
        return self.down_mbit * MBIT * CONSUMER_GOODPUT

    @property
    def up(self) -> float:
        return self.up_mbit * MBIT * CONSUMER_GOODPUT


#: The bench's consumer link, shaped to 100 Mbit/s both ways.
SHAPED = LinkProfile("100/100 Mbit/s", 100.0, 100.0)
#: A home connection (ASSUMED: issue 28's 16 Mbit/s uplink, a 100 Mbit/s downlink).
HOME = LinkProfile("100/16 Mbit/s", 100.0, 16.0)
PROFILES = (SHAPED, HOME)
HOST_RATE = HOST_MBIT * MBIT * HOST_GOODPUT


@dataclass(frozen=True, slots=True)
class Training:
    """What a kind of training writes per interval and what the consumer uploads."""

    name: str
    changed: float  # share of the state written between two checkpoints
    uploaded: float  # share of the state the consumer uploads at the start


#: Every step writes every weight, gradient and moment; the consumer uploads the fp32
#: weights (4 of 16 bytes per parameter), the rest is born on the host.
FULL = Training("full fine-tune", 1.0, 0.25)
#: A frozen base and small adapters (ASSUMED ~0.1% of the state with their moments):
#: the consumer uploads the base, the steps write the adapters alone.
ADAPTERS = Training("adapters", 0.001, 0.999)
TRAININGS = (FULL, ADAPTERS)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where checkpoints go, and whether training waits for them."""

    name: str
    standby: bool
    stalls: bool
    built: bool


CONSUMER = Placement("consumer", standby=False, stalls=True, built=True)
STANDBY = Placement("standby", standby=True, stalls=True, built=False)
STANDBY_BACKGROUND = Placement("standby-background", standby=True, stalls=False, built=False)
PLACEMENTS = (CONSUMER, STANDBY, STANDBY_BACKGROUND)


def manifest_bytes(state_bytes: float) -> float:
    """The manifest the consumer keeps: every storage's entry and every piece's digest."""
    return (piece_count(math.ceil(state_bytes)) + STORAGES) * DIGEST_BYTES + (
        STORAGES * ENTRY_BYTES
    )


# --- 1. the steady state, in closed form ---------------------------------------------------


def steady_state(
    state_bytes: float,
    training: Training,
    placement: Placement,
    profile: LinkProfile = SHAPED,
    *,
    interval_s: float = INTERVAL_S,
) -> dict:
    """One session on one host, no churn: what its checkpoints and a failover cost.

    A checkpoint starts once ``interval_s`` has passed since the previous one ended
    (sync points taken as continuous); a stalling one adds its transfer to the cycle.
    """
    changed = state_bytes * training.changed
    manifest = manifest_bytes(state_bytes)
    if placement.standby:
        checkpoint_s = changed / HOST_RATE
        consumer_per_checkpoint = manifest
        resume_s = FAILOVER_S + state_bytes / HOST_RATE
        failover_consumer = manifest
    else:
        checkpoint_s = changed / profile.down
        consumer_per_checkpoint = changed
        resume_s = FAILOVER_S + state_bytes / profile.up
        failover_consumer = state_bytes
    if placement.stalls:
        cycle_s = interval_s + checkpoint_s
        share = checkpoint_s / cycle_s
    else:  # the next snapshot waits for the previous one to arrive
        cycle_s = max(interval_s, checkpoint_s)
        share = 0.0
    floor_s = state_bytes / (HOST_MBIT * MBIT)  # the bench's floor: nominal host rate
    return {
        "profile": profile.name,
        "state_gb": round(state_bytes / GB, 3),
        "training": training.name,
        "placement": placement.name,
        "built": placement.built,
        "checkpoint_bytes": round(changed),
        "checkpoint_s": round(checkpoint_s, 2),
        "checkpoint_every_s": round(cycle_s, 1),
        "checkpoint_time_share": round(share, 4),
        "consumer_bytes_per_hour": round(consumer_per_checkpoint * 3600 / cycle_s),
        "checkpoint_consumer_bytes_share": round(consumer_per_checkpoint / changed, 5),
        "checkpoint_consumer_state_share": round(consumer_per_checkpoint / state_bytes, 6),
        "failover_resume_s": round(resume_s, 1),
        "failover_resume_over_floor": round(resume_s / floor_s, 2),
        "failover_consumer_bytes_share": round(failover_consumer / state_bytes, 6),
    }


#: ``benchmarks/realsize_bench.py``, full run (BENCHMARKS.md): a 1 GiB embedding trained
#: with plain SGD, so the state is the parameters alone, every one written each step.
BENCH_STATE = 1024**3
BENCH_TRAINING = Training("bench: SGD on a 1 GiB embedding", 1.0, 1.0)
BENCH_MEASURED = {
    "checkpoint_s": 91.3,
    "checkpoint_time_share": 0.75,
    "checkpoint_consumer_bytes_share": 1.005,
    "failover_resume_s": 93.6,
    "failover_resume_over_floor": 10.9,
}


def calibration() -> list[dict]:
    """The closed form for the bench's session, beside what the bench measured."""
    model = steady_state(BENCH_STATE, BENCH_TRAINING, CONSUMER, SHAPED)
    return [{"key": k, "model": model[k], "measured": v} for k, v in BENCH_MEASURED.items()]


# --- 2. the churn scenario, with links ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class Setup:
    """What every job of one run trains, and where its checkpoints go."""

    state_bytes: float
    training: Training
    placement: Placement
    profile: LinkProfile = SHAPED
    interval_s: float = INTERVAL_S


@dataclass(frozen=True, slots=True)
class Size:
    """How big a churn run is."""

    hosts: int
    horizon_h: float
    quick_jobs: bool  # the churn scenario's shorter jobs (2-6 h instead of 4-12 h)
    churn_per_hour: float = CHURN_PER_HOUR


FULL_SIZE = Size(hosts=128, horizon_h=96.0, quick_jobs=False)
QUICK_SIZE = Size(hosts=32, horizon_h=36.0, quick_jobs=True)


@dataclass(eq=False)
class Links:
    """One party's two directions, each carrying one transfer at a time."""

    up: simpy.Resource
    down: simpy.Resource

    @classmethod
    def of(cls, env: simpy.Environment) -> Links:
        return cls(simpy.Resource(env, 1), simpy.Resource(env, 1))


@dataclass(eq=False)
class Copy:
    """Where a job's latest checkpoint lives."""

    saved: bool = False  # False: nothing but the consumer's initial upload
    consumer_holds: float = 0.0  # bytes of the state in the consumer's store
    standby: SimHost | None = None
    # The standby's GPU when it took the copy: a host that left and came back has a new
    # one, and (ASSUMED) lost the copy with its disk.
    standby_gpu: object = None
    standby_full: bool = False  # the standby holds a whole checkpoint


@dataclass(eq=False)
class Traffic:
    """What one job moved, and what it spent moving it."""

    consumer_up: float = 0.0
    consumer_down: float = 0.0
    consumer_checkpoint: float = 0.0  # of those: checkpoints and their manifests
    consumer_restore: float = 0.0  # restores after a failover (uploads and manifests)
    host_to_host: float = 0.0
    leased_s: float = 0.0  # under leases that ended
    leased_since: float | None = None  # when the lease it holds began
    checkpoints: int = 0
    resume_s: list[float] = field(default_factory=list)
    state_lost: int = 0  # the only copy went with the standby: the job started over


@dataclass(eq=False)
class World:
    env: simpy.Environment
    market: Market
    setup: Setup
    links: dict[str, Links]
    rng: random.Random  # the jobs' draws
    standby_rng: random.Random


def simulate(seed: int, setup: Setup, size: Size) -> dict:
    """One churn run in which every job trains ``setup``; per-job outcomes summed."""
    rng = random.Random(seed)
    env = simpy.Environment()
    market = Market(env, rng, mesh_nodes=size.hosts * 4)
    fleet = add_hosts(market, size.hosts, rng)
    world = World(
        env, market, setup, {h.name: Links.of(env) for h in fleet}, rng, random.Random(seed + 3)
    )
    horizon_s = size.horizon_h * 3600
    workloads = LONG_TRAINING[size.quick_jobs]
    # As in the churn scenario: arrivals over the first third, at 0.6 of the fleet.
    rate = 0.6 * size.hosts / mean_hold_s(workloads)
    trace = job_trace(
        random.Random(seed + 1),
        workloads,
        rate_per_s=rate,
        horizon_s=horizon_s / 3,
        checkpoint_every_s=setup.interval_s,
        burst_s=BURST_S,
        host_policy=BackoffPolicy(),
    )
    traffic = [Traffic() for _ in trace]
    if size.churn_per_hour > 0:
        churn_rng = random.Random(seed + 2)
        for host in fleet:
            env.process(come_and_go(env, market, host, size.churn_per_hour, churn_rng))

    def arrivals():
        for job, moved in zip(trace, traffic, strict=True):
            yield env.timeout(max(0.0, job.arrived_s - env.now))
            env.process(_job(world, job, moved))

    env.process(arrivals())
    env.run(until=horizon_s)
    for granted in list(market.active.values()):
        market.settle(granted)
    return _summary(setup, trace, traffic, now=env.now)


def _summary(setup: Setup, trace: Sequence[Job], traffic: Sequence[Traffic], *, now: float) -> dict:
    done = [j for j in trace if j.done_s is not None]
    leased_s = sum(
        t.leased_s + (now - t.leased_since if t.leased_since is not None else 0.0) for t in traffic
    )
    resumes = [s for t in traffic for s in t.resume_s]
    computed_h = sum(j.compute_s for j in done) / 3600
    consumer = sum(t.consumer_up + t.consumer_down for t in traffic)
    return {
        "state_gb": round(setup.state_bytes / GB, 3),
        "training": setup.training.name,
        "placement": setup.placement.name,
        "built": setup.placement.built,
        "jobs": len(trace),
        "completion_rate": round(len(done) / len(trace), 4) if trace else None,
        "completion_h_mean": (
            round(statistics.fmean(j.done_s - j.arrived_s for j in done) / 3600, 2)
            if done
            else None
        ),
        # Wall time from the first lease to the end over what the job needed on its GPUs.
        "stretch_mean": (
            round(statistics.fmean((j.done_s - j.leased_s) / j.ideal_s for j in done), 3)
            if done
            else None
        ),
        "training_share_of_lease": round(sum(j.ideal_s for j in trace) / leased_s, 4)
        if leased_s
        else None,
        "checkpoint_share_of_lease": round(sum(j.checkpoint_s for j in trace) / leased_s, 4)
        if leased_s
        else None,
        "checkpoints": sum(t.checkpoints for t in traffic),
        "consumer_gb_per_lease_hour": round(consumer / GB / (leased_s / 3600), 3)
        if leased_s
        else None,
        "consumer_checkpoint_gb_per_lease_hour": (
            round(sum(t.consumer_checkpoint for t in traffic) / GB / (leased_s / 3600), 4)
            if leased_s
            else None
        ),
        "consumer_restore_gb": round(sum(t.consumer_restore for t in traffic) / GB, 2),
        "consumer_up_gb": round(sum(t.consumer_up for t in traffic) / GB, 2),
        "consumer_down_gb": round(sum(t.consumer_down for t in traffic) / GB, 2),
        "host_to_host_gb": round(sum(t.host_to_host for t in traffic) / GB, 2),
        "failovers": sum(j.failovers for j in trace),
        "resume_s_mean": round(statistics.fmean(resumes), 1) if resumes else None,
        "state_lost": sum(t.state_lost for t in traffic),
        "gave_up": sum(j.gave_up_s is not None for j in trace),
        "lost_gpu_hours": round(sum(j.lost_device_s for j in trace) / 3600, 2),
        "cost_per_compute_hour": round(sum(j.cost for j in trace) / computed_h, 3)
        if computed_h
        else None,
    }


def _job(world: World, job: Job, traffic: Traffic):
    """A job's life, as ``simulation.jobs.run`` leads it, with its bytes on links."""
    env, market = world.env, world.market
    identity = market.identity()
    link = Links.of(env)
    copy = Copy()
    job.remaining_s = job.saved_s = job.compute_s
    choice = HostChoice(job.host_policy, job.patience_s)
    choice.search(now=market.now(), patience_s=math.inf)
    while job.remaining_s > 0:
        granted = yield from find_lease(env, market, job, choice, identity, world.rng)
        if granted is None:
            break
        host = granted.host
        host.jobs[env.active_process] = None
        traffic.leased_since = env.now
        lost = False
        try:
            yield from _resume(world, job, traffic, link, host, copy)
            yield from _work(world, job, traffic, link, host, granted, copy)
        except (simpy.Interrupt, DeviceGone):
            lost = True
            set_aside(choice, market, host.peer, granted.proposal.offer_nonce)
            job.failovers += 1
            job.lost_device_s += job.saved_s - job.remaining_s
            job.remaining_s = job.saved_s
        finally:
            host.jobs.pop(env.active_process, None)
            job.cost += market.settle(granted)
            traffic.leased_s += env.now - traffic.leased_since
            traffic.leased_since = None
        if lost:  # noticing the loss and reattaching (measured)
            yield env.timeout(FAILOVER_S)
            choice.search(now=market.now())
    if job.gave_up_s is None:
        job.done_s = env.now


def _resume(world: World, job: Job, traffic: Traffic, link: Links, host: SimHost, copy: Copy):
    """Bring the state onto a freshly leased ``host``: the initial upload, or a restore."""
    env, setup = world.env, world.setup
    state = setup.state_bytes
    started = env.now
    if copy.saved and setup.placement.standby:
        standby = copy.standby
        if standby is host and _intact(copy):
            copy.standby = None  # the state is here already; the next checkpoint re-places it
        elif _intact(copy):
            yield from _move(
                env, state, HOST_RATE, world.links[standby.name].up, _down(world, host)
            )
            traffic.host_to_host += state
            traffic.consumer_down += manifest_bytes(state)  # the manifest, to check pieces
            traffic.consumer_restore += manifest_bytes(state)
        if not _intact(copy) and standby is not host:
            # The standby left with the only copy: the job starts over.
            traffic.state_lost += 1
            job.lost_device_s += job.compute_s - job.saved_s
            job.remaining_s = job.saved_s = job.compute_s
            copy.saved, copy.standby = False, None
        else:
            traffic.resume_s.append(FAILOVER_S + env.now - started)
            return
    elif copy.saved:  # from the consumer's checkpoint, over its uplink
        yield from _move(env, state, setup.profile.up, link.up)
        traffic.consumer_up += state
        traffic.consumer_restore += state
        traffic.resume_s.append(FAILOVER_S + env.now - started)
        return
    uploaded = state * setup.training.uploaded
    yield from _move(env, uploaded, setup.profile.up, link.up)
    traffic.consumer_up += uploaded
    copy.consumer_holds = uploaded  # an upload that fills a storage is never read back


def _work(world, job: Job, traffic: Traffic, link: Links, host: SimHost, granted: Granted, copy):
    """Compute on ``host`` until done, checkpointing when the client's policy says so."""
    env, setup = world.env, world.setup
    speed = host.model.perf_units / 100
    rank = lease_rank(job.priority == PriorityClass.ON_DEMAND, granted.proposal.price)
    policy = CheckpointPolicy(setup.interval_s)
    policy.taken(now=env.now)  # a fresh session, or a restore: the interval starts over
    in_flight: simpy.Process | None = None
    try:
        while job.remaining_s > 0:
            burst = min(job.burst_s, job.remaining_s)
            wall = burst / speed
            idle = wall * (1 - job.workload.duty) / job.workload.duty
            yield env.timeout(world.rng.expovariate(1 / idle) if idle > 0 else 0)
            yield from host.gpu.compute(job, rank, wall)
            job.remaining_s -= burst
            job.busy_wall_s += wall
            job.ideal_s += wall + idle
            if job.remaining_s <= 0 or (in_flight is not None and in_flight.is_alive):
                continue
            # A sync point. The log holds this interval's op frames (bytes > 0), far
            # below ``max_log_bytes`` for a training loop, so the interval decides.
            if not policy.due(now=env.now, log_bytes=1, at_sync_point=True):
                continue
            snapshot = job.remaining_s
            if setup.placement.stalls:
                started = env.now
                yield from _checkpoint(world, job, traffic, link, host, copy, snapshot)
                job.checkpoint_s += env.now - started
                policy.taken(now=env.now)
            else:
                policy.taken(now=env.now)
                in_flight = env.process(
                    _in_background(world, job, traffic, link, host, copy, snapshot)
                )
    finally:
        if in_flight is not None and in_flight.is_alive:
            in_flight.interrupt("the session ended")


def _in_background(world, job, traffic, link, host, copy, snapshot):
    try:
        yield from _checkpoint(world, job, traffic, link, host, copy, snapshot)
    except simpy.Interrupt:
        pass  # the host is gone (or the job done): this checkpoint never completed


def _checkpoint(world, job: Job, traffic: Traffic, link, host: SimHost, copy: Copy, snapshot):
    """Move the pieces that changed to where checkpoints go; on arrival it is the one a
    failover resumes from."""
    env, setup = world.env, world.setup
    state = setup.state_bytes
    changed = state * setup.training.changed
    if setup.placement.standby:
        if copy.standby is None or copy.standby is host or not _intact(copy):
            candidates = [h for h in world.market.hosts.values() if h.online and h is not host]
            if not candidates:
                return
            copy.standby = world.standby_rng.choice(candidates)
            copy.standby_gpu, copy.standby_full = copy.standby.gpu, False
        nbytes = changed if copy.standby_full else state  # a new standby holds nothing
        standby = copy.standby
        yield from _move(env, nbytes, HOST_RATE, world.links[host.name].up, _down(world, standby))
        traffic.host_to_host += nbytes
        traffic.consumer_down += manifest_bytes(state)
        traffic.consumer_checkpoint += manifest_bytes(state)
        if not _intact(copy):
            return  # it left while the pieces were on their way
        copy.standby_full = True
    else:
        nbytes = max(changed, state - copy.consumer_holds)
        yield from _move(env, nbytes, setup.profile.down, link.down)
        traffic.consumer_down += nbytes
        traffic.consumer_checkpoint += nbytes
        copy.consumer_holds = state
    copy.saved = True
    job.saved_s = snapshot
    traffic.checkpoints += 1


def _intact(copy: Copy) -> bool:
    standby = copy.standby
    return standby is not None and standby.online and standby.gpu is copy.standby_gpu


def _down(world: World, host: SimHost) -> simpy.Resource:
    return world.links[host.name].down


def _move(env: simpy.Environment, nbytes: float, rate: float, *links: simpy.Resource):
    """Hold ``links`` (in this order: a sender's uplink before a receiver's downlink, so
    no two transfers wait on each other) for ``nbytes / rate`` seconds."""
    with ExitStack() as held:
        for one in links:
            yield held.enter_context(one.request())
        yield env.timeout(nbytes / rate)


# --- the run -------------------------------------------------------------------------------


def run(seed: int, *, quick: bool) -> dict:
    """The steady-state table, the calibration, and the churn runs."""
    size = QUICK_SIZE if quick else FULL_SIZE
    churn_gb = (1, 16) if quick else STATE_GB
    steady = [
        steady_state(gb * GB, training, placement, profile)
        for profile in PROFILES
        for gb in STATE_GB
        for training in TRAININGS
        for placement in PLACEMENTS
    ]
    churn = [
        simulate(seed, Setup(gb * GB, training, placement), size)
        for gb in churn_gb
        for training in TRAININGS
        for placement in PLACEMENTS
    ]
    return {
        "scenario": "bandwidth",
        "seed": seed,
        "quick": quick,
        "inputs": {
            "interval_s": INTERVAL_S,
            "failover_s": FAILOVER_S,
            "piece_bytes": PIECE,
            "host_to_host_mbit": HOST_MBIT,
            "consumer_goodput": CONSUMER_GOODPUT,
            "host_goodput": HOST_GOODPUT,
            "profiles": [asdict(p) for p in PROFILES],
            "trainings": [asdict(t) for t in TRAININGS],
            "placements": [asdict(p) for p in PLACEMENTS],
        },
        "calibration": calibration(),
        "steady": steady,
        "churn": {
            "profile": SHAPED.name,
            "hosts": size.hosts,
            "horizon_h": size.horizon_h,
            "churn_per_hour": size.churn_per_hour,
            "rows": churn,
        },
    }


def report(result: dict) -> str:
    """The result as markdown tables."""
    lines = [
        f"# Bandwidth and checkpoint placement (seed {result['seed']}"
        f"{', quick' if result['quick'] else ''})",
        "",
        "`standby-background` models `remote.attach(standby=...)` (less the host's copy).",
        "",
        "## Calibration: the closed form against `realsize_bench.py` (1 GiB, 100 Mbit/s)",
        "",
        "| key | model | measured |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {c['key']} | {c['model']} | {c['measured']} |" for c in result["calibration"]]
    lines += [
        "",
        f"## Steady state, {result['inputs']['interval_s']:.0f} s interval",
        "",
        "| consumer link | state GB | training | placement | checkpoint s | share of time "
        "| consumer MB/h | failover resume s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["steady"]:
        lines.append(
            f"| {r['profile']} | {r['state_gb']:g} | {r['training']} | {r['placement']} "
            f"| {r['checkpoint_s']:g} | {r['checkpoint_time_share']:.1%} "
            f"| {r['consumer_bytes_per_hour'] / 1e6:,.1f} | {r['failover_resume_s']:g} |"
        )
    churn = result["churn"]
    lines += [
        "",
        f"## Churn: {churn['hosts']} hosts, {churn['horizon_h']:g} h, "
        f"{churn['churn_per_hour']:.0%} leaving per hour, consumer link {churn['profile']}",
        "",
        "| state GB | training | placement | completed | completion h | stretch "
        "| checkpoint share | consumer GB per lease-h, all (checkpoints) | resume s | state lost "
        "| lost GPU-h |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in churn["rows"]:
        lines.append(
            f"| {r['state_gb']:g} | {r['training']} | {r['placement']} "
            f"| {r['completion_rate']:.0%} of {r['jobs']} | {r['completion_h_mean']} "
            f"| {r['stretch_mean']} | {r['checkpoint_share_of_lease']:.1%} "
            f"| {r['consumer_gb_per_lease_hour']} ({r['consumer_checkpoint_gb_per_lease_hour']}) "
            f"| {r['resume_s_mean']} "
            f"| {r['state_lost']} | {r['lost_gpu_hours']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    args = scenario_parser(__doc__).parse_args(argv)
    return run_and_save("bandwidth", args, lambda: run(args.seed, quick=args.quick), report)


if __name__ == "__main__":
    main()
