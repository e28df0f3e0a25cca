"""Tenants contending for one device: better ranks preempt at op boundaries, equals share,
an interruptible tenant alone runs at full speed, and results never depend on the cuts.

The turn rules are the sans-IO ``DeviceQueue`` with time passed in; the shells (the
executor cutting a batch between ops, the supervisor's flag, the worker reading it) are
driven in this process. The tests marked slow start executor processes.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import trio
import trio.testing

from cumulus_p2p.host.executor import Executor, ExecutorConfig
from cumulus_p2p.host.scheduler import (
    DEFAULT_SHARING,
    DeviceQueue,
    DeviceScheduler,
    Handback,
    Sharing,
    cpu_idle,
    cpu_nice,
    lease_rank,
)
from cumulus_p2p.host.supervisor import SupervisorConfig, WorkerSupervisor, _Worker
from cumulus_p2p.host.worker import SupervisorTurns
from cumulus_p2p.host.workerlink import TurnFlag, WorkerLink
from cumulus_p2p.testing import forkstart
from cumulus_p2p.testing.executor import one_batch
from cumulus_p2p.wire.protocol import TensorRef

ON_DEMAND = lease_rank(True, 900)
CHEAPER_ON_DEMAND = lease_rank(True, 100)
INTERRUPTIBLE = lease_rank(False, 100)
ROOT = Path(__file__).resolve().parents[1]

# --- the rules: when a turn ends -----------------------------------------------------------


def test_a_better_ranked_arrival_ends_the_turn_at_the_next_op() -> None:
    queue = DeviceQueue(quantum=0.02)
    assert queue.request("hog", INTERRUPTIBLE, now=0.0)
    assert queue.handback(0.001) is Handback.KEEP
    assert not queue.request("bystander", ON_DEMAND, now=0.001)
    assert queue.handback(0.001) is Handback.AT_NEXT_OP
    assert queue.release(now=0.002) == "bystander"
    assert queue.handback(0.002) is Handback.KEEP


def test_an_equal_ranked_waiter_ends_the_turn_after_its_quantum() -> None:
    queue = DeviceQueue(quantum=0.02)
    queue.request("a", ON_DEMAND, now=10.0)
    queue.request("b", ON_DEMAND, now=10.005)
    assert queue.handback(10.019) is Handback.AFTER_BATCH
    assert queue.review_at() == pytest.approx(10.02)
    assert queue.handback(10.02) is Handback.AT_NEXT_OP


def test_a_worse_ranked_waiter_never_cuts_a_batch_short() -> None:
    queue = DeviceQueue(quantum=0.02)
    queue.request("dear", ON_DEMAND, now=0.0)
    queue.request("cheap", CHEAPER_ON_DEMAND, now=0.0)
    queue.request("interruptible", INTERRUPTIBLE, now=0.0)
    assert queue.handback(100.0) is Handback.AFTER_BATCH
    assert queue.review_at() is None


def test_an_interruptible_tenant_alone_keeps_the_device() -> None:
    queue = DeviceQueue(quantum=0.02)
    assert queue.request("cheap", INTERRUPTIBLE, now=0.0)
    assert queue.handback(1e6) is Handback.KEEP
    assert queue.review_at() is None


def test_a_withdrawn_better_waiter_preempts_nobody() -> None:
    queue = DeviceQueue()
    queue.request("hog", INTERRUPTIBLE, now=0.0)
    queue.request("gone", ON_DEMAND, now=0.0)
    queue.withdraw("gone")
    assert queue.handback(1.0) is Handback.KEEP


def device_time_shares(op_seconds: tuple[float, float], total: float = 10.0) -> list[float]:
    """Two equal tenants, each always with work (ops of the given lengths), cutting turns
    where the queue says: the device time each one got."""
    queue = DeviceQueue(quantum=0.02)
    now, used = 0.0, [0.0, 0.0]
    queue.request(0, ON_DEMAND, now=now)
    queue.request(1, ON_DEMAND, now=now)
    while now < total:
        holder = queue.holder
        while True:  # the holder's ops, until its turn ends at an op boundary
            now += op_seconds[holder]
            used[holder] += op_seconds[holder]
            if queue.handback(now) is Handback.AT_NEXT_OP:
                break
        queue.release(now=now)
        queue.request(holder, ON_DEMAND, now=now)  # it still has work: back in line
    return [u / sum(used) for u in used]


@pytest.mark.parametrize("ops", [(0.001, 0.001), (0.0005, 0.007), (0.003, 0.0002)])
def test_equal_tenants_share_the_device_within_20_percent(ops) -> None:
    a, b = device_time_shares(ops)
    assert abs(a - b) <= 0.2 * max(a, b)


def test_devices_are_shared_concurrently_with_interruptible_tenants_weighted_lowest() -> None:
    assert SupervisorConfig().sharing is DEFAULT_SHARING is Sharing.CONCURRENT
    assert cpu_nice(ON_DEMAND) == cpu_nice(CHEAPER_ON_DEMAND) == 0
    assert cpu_nice(INTERRUPTIBLE) == 19
    assert cpu_idle(INTERRUPTIBLE) and not cpu_idle(ON_DEMAND)


# --- the shells: the supervisor's flag, the worker's reading of it ---------------------------


def exclusive_supervisor(*ranks: tuple, quantum: float = 0.02):
    """A supervisor taking exclusive turns, its workers (link ends in this process), the
    far ends of their links, and each worker's own mapping of its flag."""
    sup = WorkerSupervisor(
        SupervisorConfig(ExecutorConfig(device="cpu"), sharing=Sharing.EXCLUSIVE, quantum=quantum)
    )
    workers, far_ends, their_flags = [], [], []
    for pid, rank in enumerate(ranks, start=100):
        near, far = WorkerLink.pair()
        flag, fd = TurnFlag.create()
        worker = _Worker(SimpleNamespace(pid=pid), near, rank=rank, flag=flag)
        sup._workers[pid] = worker
        workers.append(worker)
        far_ends.append(WorkerLink(far))
        their_flags.append(TurnFlag(fd))
    return sup, workers, far_ends, their_flags


async def test_a_better_ranked_arrival_sets_the_holders_flag_at_once() -> None:
    sup, (hog, bystander), (to_hog, _), (hog_flag, _) = exclusive_supervisor(
        INTERRUPTIBLE, ON_DEMAND
    )
    sup._on_message(hog, ["acquire", 1])
    assert (await to_hog.receive())[0] == ["grant", 1]
    assert not hog_flag.is_set()
    sup._on_message(bystander, ["acquire", 1])
    assert hog_flag.is_set()
    assert (await to_hog.receive())[0] == ["yield"]


async def test_an_equal_ranked_waiter_sets_the_flag_only_once_the_quantum_is_spent() -> None:
    sup, (a, b), _links, (a_flag, _) = exclusive_supervisor(ON_DEMAND, ON_DEMAND, quantum=60.0)
    sup._on_message(a, ["acquire", 1])
    sup._on_message(b, ["acquire", 1])
    assert not a_flag.is_set()  # it hands back after its batch, or in a minute
    sup.queue.quantum = 0.0
    sup._review_turn()  # what the turn clock does when the quantum ends
    assert a_flag.is_set()


async def test_a_grant_clears_the_flag_left_from_the_last_turn() -> None:
    sup, (hog, bystander), _links, (hog_flag, _) = exclusive_supervisor(INTERRUPTIBLE, ON_DEMAND)
    sup._on_message(hog, ["acquire", 1])
    sup._on_message(bystander, ["acquire", 1])
    assert hog_flag.is_set()
    sup._on_message(hog, ["release"])
    sup._on_message(hog, ["acquire", 2])
    sup._on_message(bystander, ["release"])
    assert sup.queue.holder == (hog.pid, 2)
    assert not hog_flag.is_set()


async def test_a_flagged_worker_hands_its_turn_back_after_the_op_without_waiting_for_yield():
    supervisor_end, worker = WorkerLink.pair()
    flag, fd = TurnFlag.create()
    turns = SupervisorTurns(WorkerLink(worker), TurnFlag(fd))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(turns.acquire, ON_DEMAND)
        assert (await supervisor_end.receive())[0] == ["acquire", 1]
        turns.granted(1)
    assert turns.preemptive and not turns.preempted()
    flag.set()  # the supervisor's write; its yield is still on the way
    assert turns.preempted()
    turns.release()
    assert (await supervisor_end.receive())[0] == ["release"]


# --- the executor: a batch cut between ops ---------------------------------------------------


class CuttingScheduler(DeviceScheduler):
    """An executor's scheduler that ends the turn at every op boundary it is asked about
    (as if a better tenant arrived each time), and counts its turns."""

    def __init__(self, cut: bool) -> None:
        super().__init__()
        self.cut = cut
        self.turns = 0

    async def acquire(self, rank: tuple) -> None:
        await super().acquire(rank)
        self.turns += 1

    def preempted(self) -> bool:
        return self.cut or super().preempted()


def seeded_batch(seed: int, ops: int = 24) -> list:
    """A batch that draws from the session's generator and chains matmuls, then fetches."""
    shape, strides = [48, 48], [48, 1]

    def ref(handle: int) -> TensorRef:
        return TensorRef(handle, torch.float32, 0, (48, 48), (48, 1))

    records = [
        ["@seed", [seed], {}, None],
        ["aten.randn.default", [shape], {}, [[1, shape, strides, 0]]],
    ]
    for i in range(2, ops):
        name = "aten.randn.default" if i % 3 == 0 else "aten.mm.default"
        args = [shape] if name == "aten.randn.default" else [ref(i - 1), ref(i - 2 if i > 2 else 1)]
        records.append([name, args, {}, [[i, shape, strides, 0]]])
        if name == "aten.mm.default":
            records.append(["aten.tanh.default", [ref(i)], {}, [[1000 + i, shape, strides, 0]]])
    return ["batch", 1, records, [], ["fetch", ref(ops - 1)], []]


async def test_a_preempted_batch_hands_the_turn_back_between_ops_and_finishes_in_later_turns():
    executor = Executor(ExecutorConfig(device="cpu"))
    executor.scheduler = scheduler = CuttingScheduler(cut=True)
    batch = seeded_batch(1)
    await one_batch(executor, batch, rank=ON_DEMAND)
    assert scheduler.turns == len(batch[2])  # one turn per op: the frees and query ride the last
    assert scheduler.queue.holder is None


async def test_results_are_bit_identical_however_the_batches_are_cut_and_interleaved():
    whole = Executor(ExecutorConfig(device="cpu"))
    whole.scheduler = CuttingScheduler(cut=False)
    alone = await one_batch(whole, seeded_batch(7), rank=ON_DEMAND)
    other_alone = await one_batch(whole, seeded_batch(8), rank=ON_DEMAND)
    cut = Executor(ExecutorConfig(device="cpu"))
    cut.scheduler = CuttingScheduler(cut=True)  # two sessions, interleaved op by op
    replies = {}

    async def run(seed: int) -> None:
        replies[seed] = await one_batch(cut, seeded_batch(seed), rank=ON_DEMAND)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, 7)
        nursery.start_soon(run, 8)
    assert cut.scheduler.turns > 2 * len(seeded_batch(7)[2]) - 2  # they did alternate
    assert replies[7] == alone
    assert replies[8] == other_alone
    assert alone != other_alone


# --- real executors: shares measured --------------------------------------------------------

BENCH = ROOT / "benchmarks" / "contention_bench.py"


@contextmanager
def contention_executor() -> Iterator[dict[str, str]]:
    """A worker-per-session CPU executor for the length of the block: the address where
    sessions run on each lease (``bystander``: on-demand, ``lower``: interruptible)."""
    server = forkstart.popen(
        [sys.executable, str(BENCH), "--serve", "1"], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        top, low = server.stdout.readline().split()
        yield {"bystander": f"127.0.0.1:{top}", "lower": f"127.0.0.1:{low}"}
    finally:
        server.kill()
        server.wait()


def hog_rate(address: str, seconds: float, size: int = 512) -> float:
    """Ops per second of a hog running alone on the executor session at ``address``, its
    first second left out: the session's arrival starts its worker's replacement in the
    pool, a fork of the executor's zygote, which slowed the hog's first 0.3 s (measured)."""
    import json

    hog = forkstart.popen(
        [sys.executable, str(BENCH), "--client", "hog", address, str(seconds), str(size)]
        + ["--warmup", "1"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    durations = json.loads(hog.communicate(timeout=120)[0].strip().splitlines()[-1])
    return 1e3 * len(durations) / sum(durations)


@pytest.mark.slow  # starts an executor, its workers and four clients in turn
# An interruptible worker runs at nice 19: any other work on the machine (the parallel
# test workers) takes the CPU from it first, so it is measured alone.
@pytest.mark.timing
def test_an_interruptible_tenant_alone_on_a_cpu_runs_at_full_speed() -> None:
    # In turn, twice, each round's ratio: this test runs first in its tier, and processes
    # the tier before it left behind may still be exiting; any of them preempts a nice-19
    # worker (a clean CI run measured 459 against 580 so, and 0.97-1.03 of it alone). The
    # ratio is taken within a round: this machine's speed drifts between rounds (the
    # bystander alone measured 549 and then 687 ops/s in one run).
    ratios = []
    with contention_executor() as executor:
        for _ in range(2):
            lower = hog_rate(executor["lower"], seconds=1.5)
            bystander = hog_rate(executor["bystander"], seconds=1.5)
            ratios.append(lower / bystander)
    assert max(ratios) >= 0.8, ratios
