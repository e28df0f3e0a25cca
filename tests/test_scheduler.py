"""Tenants of one device take turns by rank: on-demand before interruptible, dearer first."""

from __future__ import annotations

import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from cumulus_p2p.channel.transport import TrioFrameChannel
from cumulus_p2p.host.executor import Executor, ExecutorConfig
from cumulus_p2p.host.scheduler import DeviceQueue, DeviceScheduler, lease_rank
from cumulus_p2p.testing.executor import one_batch
from cumulus_p2p.wire.protocol import PROTOCOL_VERSION, decode_frame, encode_frame

CHEAP_INTERRUPTIBLE = lease_rank(False, 100)
DEAR_ON_DEMAND = lease_rank(True, 900)


def test_a_free_device_is_granted_at_once() -> None:
    queue = DeviceQueue()
    assert queue.request("a", (0, 0))
    assert queue.holder == "a"


def test_on_demand_runs_before_interruptible_and_dearer_before_cheaper() -> None:
    assert lease_rank(True, 10) < lease_rank(False, 10_000)
    assert lease_rank(True, 900) < lease_rank(True, 100)
    assert lease_rank(False, 900) < lease_rank(False, 100)


@given(st.lists(st.tuples(st.integers(0, 1), st.integers(-5, 5)), max_size=30))
def test_waiters_are_served_best_rank_first_and_in_arrival_order_among_equals(ranks) -> None:
    queue = DeviceQueue()
    queue.request("holder", (0, 0))
    for i, rank in enumerate(ranks):
        assert not queue.request(i, rank)
    served = []
    while (ticket := queue.release()) is not None:
        served.append(ticket)
    assert served == sorted(range(len(ranks)), key=lambda i: (ranks[i], i))
    assert queue.holder is None


def test_a_withdrawn_waiter_is_skipped() -> None:
    queue = DeviceQueue()
    queue.request("holder", (0, 0))
    queue.request("gone", (0, 0))
    queue.request("next", (1, 0))
    queue.withdraw("gone")
    assert queue.waiting == 1
    assert queue.release() == "next"


async def test_a_cancelled_waiter_does_not_hold_up_the_next() -> None:
    scheduler = DeviceScheduler()
    await scheduler.acquire((0, 0))
    got = []

    async def wait_for_turn(name, rank, task_status=trio.TASK_STATUS_IGNORED):
        with trio.CancelScope() as scope:
            task_status.started(scope)
            await scheduler.acquire(rank)
            got.append(name)
            scheduler.release()

    async with trio.open_nursery() as nursery:
        doomed = await nursery.start(wait_for_turn, "cancelled", (0, 0))
        await nursery.start(wait_for_turn, "next", (1, 0))
        await trio.testing.wait_all_tasks_blocked()
        doomed.cancel()
        await trio.testing.wait_all_tasks_blocked()
        scheduler.release()
    assert got == ["next"]
    assert scheduler.queue.holder is None


class RecordingScheduler(DeviceScheduler):
    """The executor's scheduler, noting the rank of each turn it grants."""

    def __init__(self) -> None:
        super().__init__()
        self.granted: list[tuple] = []

    async def acquire(self, rank: tuple) -> None:
        await super().acquire(rank)
        self.granted.append(rank)


async def sync_once(executor: Executor, rank: tuple) -> None:
    await one_batch(executor, ["batch", 1, [], [], ["sync"], []], rank=rank)


async def test_a_dear_on_demand_session_overtakes_a_cheap_interruptible_one_for_the_device():
    executor = Executor(ExecutorConfig(device="cpu"))
    executor.scheduler = scheduler = RecordingScheduler()
    busy = (-1, 0)
    await scheduler.acquire(busy)  # a batch in progress
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sync_once, executor, CHEAP_INTERRUPTIBLE)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(sync_once, executor, DEAR_ON_DEMAND)
        await trio.testing.wait_all_tasks_blocked()
        assert scheduler.queue.waiting == 2
        scheduler.release()
    assert scheduler.granted == [busy, DEAR_ON_DEMAND, CHEAP_INTERRUPTIBLE]


async def test_a_session_shows_how_long_it_waited_for_the_device():
    executor = Executor(ExecutorConfig(device="cpu"))
    await executor.scheduler.acquire((-1, 0))  # another tenant's batch in progress
    client_stream, server_stream = trio.testing.memory_stream_pair()
    client = TrioFrameChannel(client_stream)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(executor.run_session, TrioFrameChannel(server_stream))
        await client.send_frame(encode_frame(["hello", PROTOCOL_VERSION, {}]))
        assert decode_frame(await client.receive_frame())[0][0] == "welcome"
        assert executor.session_stats(None).wait_p99_ms is None  # no turn asked for yet
        await client.send_frame(encode_frame(["batch", 1, [], [], ["sync"], []]))
        # Held 200 ms from when the session asked for its turn, not from when it was sent.
        while not executor.scheduler.queue.waiting:
            await trio.sleep(0.001)
        await trio.sleep(0.2)
        executor.scheduler.release()
        await client.receive_frame()
        stats = executor.session_stats(None)
        assert 200 <= stats.wait_p50_ms == stats.wait_p99_ms < 2000
        await client.send_frame(encode_frame(["bye"]))
