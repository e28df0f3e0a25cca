"""The supervisor–worker link and device turns across worker processes.

The link is a real socket pair; the supervisor's side of the turn rules is driven with
workers that are link ends in this process (what a worker process would send, sent).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import trio
import trio.testing

from cumulus_p2p.channel.transport import Handover
from cumulus_p2p.host.executor import ExecutorConfig
from cumulus_p2p.host.scheduler import lease_rank
from cumulus_p2p.host.supervisor import (
    MAX_WAITING_TURNS,
    SessionView,
    SupervisorConfig,
    WorkerSupervisor,
    _Handed,
    _Worker,
)
from cumulus_p2p.host.worker import SupervisorTurns, Worker, WorkerSpec
from cumulus_p2p.host.workerlink import MAX_MESSAGE, LinkClosedError, WorkerLink
from cumulus_p2p.testing.executor import one_batch
from cumulus_p2p.wire.protocol import TensorRef

ON_DEMAND = lease_rank(True, 900)
INTERRUPTIBLE = lease_rank(False, 100)


def link_pair() -> tuple[WorkerLink, WorkerLink]:
    ours, theirs = WorkerLink.pair()
    return ours, WorkerLink(theirs)


async def nothing_arrives(link: WorkerLink) -> bool:
    with trio.move_on_after(0.1):
        await link.receive()
        return False
    return True


async def holding_a_turn() -> tuple[WorkerLink, SupervisorTurns]:
    """A worker whose on-demand acquire the supervisor granted: (supervisor end, turns)."""
    supervisor, worker = link_pair()
    turns = SupervisorTurns(worker)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(turns.acquire, ON_DEMAND)
        assert (await supervisor.receive())[0] == ["acquire", 1]
        turns.granted(1)
    return supervisor, turns


# --- the link ----------------------------------------------------------------------------


async def test_a_message_arrives_whole_with_the_socket_it_carries():
    a, b = link_pair()
    left, right = socket.socketpair()
    await a.send(["session", {"quota": 5}], left.fileno())
    message, fd = await b.receive()
    assert message == ["session", {"quota": 5}]
    os.write(fd, b"hi")
    assert right.recv(2) == b"hi"
    os.close(fd)


async def test_a_closed_link_is_reported_as_closed():
    a, b = link_pair()
    a.close()
    with pytest.raises(LinkClosedError, match="closed"):
        await b.receive()


@pytest.mark.parametrize("packet", [b"\xc1", b"\x92\x01", b"\x91\x01", b"\x90"])
async def test_a_packet_that_is_not_a_named_message_is_refused(packet):
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    link = WorkerLink(ours)
    theirs.send(packet)
    with pytest.raises(LinkClosedError, match="malformed"):
        await link.receive()


# --- the worker's side: turns kept until asked for ------------------------------------------


async def test_a_granted_turn_is_kept_across_batches_without_a_message():
    supervisor, turns = await holding_a_turn()
    turns.release()
    await turns.acquire(ON_DEMAND)
    turns.release()
    assert await nothing_arrives(supervisor)


async def test_a_yield_asked_during_a_batch_hands_the_turn_back_when_it_ends():
    supervisor, turns = await holding_a_turn()
    turns.yield_asked()
    assert await nothing_arrives(supervisor)
    turns.release()
    assert (await supervisor.receive())[0] == ["release"]


async def test_a_yield_asked_between_batches_hands_the_turn_back_at_once():
    supervisor, turns = await holding_a_turn()
    turns.release()
    turns.yield_asked()
    assert (await supervisor.receive())[0] == ["release"]


async def test_an_acquire_cancelled_while_waiting_tells_the_supervisor():
    supervisor, worker = link_pair()
    turns = SupervisorTurns(worker)
    with trio.move_on_after(0.1):
        await turns.acquire(ON_DEMAND)
    assert (await supervisor.receive())[0] == ["acquire", 1]
    assert (await supervisor.receive())[0] == ["cancel", 1]


# --- the supervisor's side: turns across workers, in lease rank -----------------------------


def supervisor_with(
    *ranks: tuple,
    device_bytes: int | None = None,
    blob_dir: Path | None = None,
    ram_bytes: int | None = None,
) -> tuple[WorkerSupervisor, list[_Worker], list[WorkerLink]]:
    """A supervisor of workers at ``ranks`` that are link ends here, on a CPU whose memory
    is bounded at ``device_bytes``, and evicted to a blob store at ``blob_dir``."""
    store = None if blob_dir is None else str(blob_dir)
    config = ExecutorConfig(
        device="cpu", device_bytes=device_bytes, blob_dir=store, ram_bytes=ram_bytes
    )
    sup = WorkerSupervisor(SupervisorConfig(config))
    workers, far_ends = [], []
    for pid, rank in enumerate(ranks, start=100):
        near, far = link_pair()
        worker = _Worker(SimpleNamespace(pid=pid), near, rank=rank)
        sup._workers[pid] = worker
        workers.append(worker)
        far_ends.append(far)
    return sup, workers, far_ends


async def test_turns_pass_to_the_best_ranked_waiting_worker():
    sup, (holder, cheap, dear), (to_holder, to_cheap, to_dear) = supervisor_with(
        ON_DEMAND, INTERRUPTIBLE, ON_DEMAND
    )
    sup._on_message(holder, ["acquire", 1])
    assert (await to_holder.receive())[0] == ["grant", 1]
    sup._on_message(cheap, ["acquire", 1])
    assert (await to_holder.receive())[0] == ["yield"]
    sup._on_message(dear, ["acquire", 1])
    sup._on_message(holder, ["release"])
    assert (await to_dear.receive())[0] == ["grant", 1]
    assert (await to_dear.receive())[0] == ["yield"]  # the cheap one still waits
    sup._on_message(dear, ["release"])
    assert (await to_cheap.receive())[0] == ["grant", 1]
    assert await nothing_arrives(to_cheap)  # nobody waits: it keeps the turn


async def test_a_dead_holders_turn_passes_on():
    sup, (holder, other), (_, to_other) = supervisor_with(ON_DEMAND, ON_DEMAND)
    sup._on_message(holder, ["acquire", 1])
    sup._on_message(other, ["acquire", 1])
    holder.ready.set()
    holder.process.returncode = 0  # it exited cleanly: no device check
    sup._forget(holder)
    assert (await to_other.receive())[0] == ["grant", 1]


@pytest.mark.parametrize(
    "message",
    [
        ["acquire", "1"],
        ["acquire"],
        ["cancel", None],
        ["release", 1],
        ["launch", 1],
        ["stats", 5],
        ["stats", -1, 0, None, None, "device"],
        ["stats", 1, "lots", None, None, "device"],
        ["stats", 1, 0],
        ["stats", 1, 0, None, None],  # where its memory is goes unsaid
        ["stats", 1, 0, -1.0, 2.0, "device"],
        ["stats", 1, 0, 1.0, float("nan"), "device"],
        ["stats", 1, 0, "1 ms", None, "device"],
        ["stats", 1, 0, None, None, "the moon"],
        ["stats", 1, 0, None, None, "device", 0, -1],  # held bytes
        ["stats", 1, 0, None, None, "device", 0, "1 GiB"],
        ["stats", 1, 0, None, None, "device", 0, 0, 0],
        ["room", 1],
        ["room", -1, 4096],
        ["room", 1, "lots"],
        ["traffic", 1, -5],
        ["traffic", "1", 5],
        ["traffic", 1, 5, -1],  # collectives' bytes between hosts
        ["traffic", 1, 5, "lots"],
        ["traffic", 1, 5, 6, 7],
        ["ended", 1, "done", 0],
        ["ended", 1],
        ["ended", 1, None],
        ["token", 7],
        ["token", "t" * 300],
    ],
)
def test_a_worker_breaking_the_link_protocol_is_cut_off(message):
    sup, (worker,), _ = supervisor_with(ON_DEMAND)
    with pytest.raises(LinkClosedError):
        sup._on_message(worker, message)


# --- the device check after a worker fails -------------------------------------------------


async def wait_until(predicate, timeout: float = 60.0) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.05)


async def kill_a_pooled_worker(sup: WorkerSupervisor) -> None:
    await wait_until(lambda: sup.ready_workers >= 1)
    os.kill(sup._idle[0].pid, signal.SIGKILL)


@pytest.mark.slow  # starts a supervisor, its workers and a device check
async def test_a_killed_worker_gets_the_device_checked_and_the_pool_refilled():
    sup = WorkerSupervisor(SupervisorConfig(ExecutorConfig(device="cpu"), pool=1))
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        await kill_a_pooled_worker(sup)
        await wait_until(lambda: not sup.health.healthy)
        assert "checking the device after worker" in sup.health.reason
        assert "killed by SIGKILL" in sup.health.reason
        await wait_until(lambda: sup.health.healthy and sup.ready_workers == 1)
        nursery.cancel_scope.cancel()


@pytest.mark.slow  # starts a supervisor, its workers and a device check
async def test_a_device_that_fails_its_check_is_reported_and_gets_no_new_worker():
    sup = WorkerSupervisor(SupervisorConfig(ExecutorConfig(device="cpu"), pool=1))
    sup.device = torch.device("meta")  # stands in for a broken GPU: its check cannot pass
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        await kill_a_pooled_worker(sup)
        await wait_until(lambda: "failed its check" in sup.health.reason)
        assert not sup.health.healthy
        await trio.sleep(0.5)
        assert sup.workers == 0
        nursery.cancel_scope.cancel()


async def test_a_yield_right_behind_the_grant_waits_for_the_granted_batch():
    supervisor, worker = link_pair()
    turns = SupervisorTurns(worker)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(turns.acquire, ON_DEMAND)
        await supervisor.receive()
        turns.granted(1)
        turns.yield_asked()  # others wait: the supervisor asks for it back at once
    assert await nothing_arrives(supervisor)  # the granted batch runs first
    turns.release()
    with trio.fail_after(5):  # a lost yield would keep the turn forever
        assert (await supervisor.receive())[0] == ["release"]


def test_a_workers_stats_are_what_status_shows_for_its_consumers_session():
    sup, (worker,), _ = supervisor_with(ON_DEMAND)
    sup.sessions[1] = SessionView(worker.pid, owner=b"k" * 32)
    sup._on_message(worker, ["stats", 120, 4096, 0.5, 12.0, "disk"])
    stats = sup.session_stats(b"k" * 32)
    assert (stats.ops, stats.bytes_in_use, stats.tier) == (120, 4096, "disk")
    assert (stats.wait_p50_ms, stats.wait_p99_ms) == (0.5, 12.0)
    assert sup.session_stats(b"x" * 32) is None


def test_a_standby_workers_held_bytes_reach_status():
    sup, (worker,), _ = supervisor_with(ON_DEMAND)
    sup.sessions[1] = SessionView(worker.pid, owner=b"k" * 32)
    sup._on_message(worker, ["stats", 3, 0, None, None, "device", 0, 5 * 2**20])
    assert sup.session_stats(b"k" * 32).held_bytes == 5 * 2**20


# --- memory across workers: past the device's bound, the supervisor asks for evictions ----


async def test_past_the_device_bound_the_worker_the_policy_names_is_asked_to_evict(tmp_path):
    sup, (busy, cheap), (to_busy, to_cheap) = supervisor_with(
        ON_DEMAND, INTERRUPTIBLE, device_bytes=1000, blob_dir=tmp_path
    )
    sup._on_message(busy, ["stats", 5, 600, None, None, "device"])
    sup._on_message(cheap, ["stats", 5, 600, None, None, "device"])
    with trio.fail_after(5):
        # The worse-ranked payer moves as much as the room needs.
        assert (await to_cheap.receive())[0] == ["evict", "disk", 200]
    assert await nothing_arrives(to_busy)
    # Asked once: its report that it still holds the memory does not ask again at once.
    assert cheap.evicting
    sup._on_message(cheap, ["stats", 5, 600, None, None, "disk"])
    assert not cheap.evicting and await nothing_arrives(to_cheap)


async def test_within_the_device_bound_or_without_one_nobody_is_asked_to_evict(tmp_path):
    for bound in (None, 1200):
        sup, workers, far_ends = supervisor_with(
            ON_DEMAND, INTERRUPTIBLE, device_bytes=bound, blob_dir=tmp_path
        )
        for worker in workers:
            sup._on_message(worker, ["stats", 5, 600, None, None, "device"])
        assert all([await nothing_arrives(far) for far in far_ends])


async def test_off_a_gpu_sessions_go_to_host_memory_until_it_is_full_then_to_disk(tmp_path):
    sup, (cheap, older, newer), (to_cheap, to_older, _) = supervisor_with(
        INTERRUPTIBLE, ON_DEMAND, ON_DEMAND, device_bytes=1000, blob_dir=tmp_path, ram_bytes=700
    )
    sup.device = torch.device("cuda", 0)  # what the supervisor of a GPU host sees (no GPU here)
    sup._on_message(cheap, ["stats", 5, 600, None, None, "device"])
    sup._on_message(older, ["stats", 5, 600, None, None, "device"])
    with trio.fail_after(5):
        assert (await to_cheap.receive())[0] == ["evict", "ram", 200]
    sup._on_message(cheap, ["stats", 5, 600, None, None, "ram", 400])
    sup._on_message(newer, ["stats", 5, 600, None, None, "device"])
    with trio.fail_after(5):
        assert (await to_cheap.receive())[0] == ["evict", "ram", 600]  # its last 400 go
        # Host memory will hold all 600 of the first's of its 700: the rest go to disk.
        assert (await to_older.receive())[0] == ["evict", "disk", 200]


async def test_an_on_demand_holder_of_the_exclusive_turn_is_not_evicted_in_its_turn(tmp_path):
    sup, (holder, other), (to_holder, to_other) = supervisor_with(
        ON_DEMAND, ON_DEMAND, device_bytes=1000, blob_dir=tmp_path
    )
    sup._on_message(holder, ["acquire", 1])
    assert (await to_holder.receive())[0] == ["grant", 1]
    # The holder reports first: the least recently used, which would go but for its turn.
    sup._on_message(holder, ["stats", 5, 600, None, None, "device"])
    sup._on_message(other, ["stats", 5, 600, None, None, "device"])
    with trio.fail_after(5):
        assert (await to_other.receive())[0] == ["evict", "disk", 200]
    assert await nothing_arrives(to_holder)


@contextlib.asynccontextmanager
async def bounded_pair(tmp_path: Path):
    """A supervisor of two on-demand workers (as ``supervisor_with``) on a device bounded
    at 1000 bytes, with a nursery for the tasks that answer room requests."""
    sup, workers, far_ends = supervisor_with(
        ON_DEMAND, ON_DEMAND, device_bytes=1000, blob_dir=tmp_path
    )
    async with trio.open_nursery() as nursery:
        sup._nursery = nursery
        yield sup, workers, far_ends


async def test_a_session_coming_back_gets_its_room_once_the_others_evicted(tmp_path):
    async with bounded_pair(tmp_path) as (sup, (coming, idle), (to_coming, to_idle)):
        sup._on_message(idle, ["stats", 5, 600, None, None, "device"])
        sup._on_message(coming, ["stats", 5, 600, None, None, "disk"])
        sup._on_message(coming, ["room", 1, 600])
        with trio.fail_after(5):
            assert (await to_idle.receive())[0] == ["evict", "disk", 200]
        assert await nothing_arrives(to_coming)  # not before the other's memory moved
        sup._on_message(idle, ["stats", 5, 600, None, None, "device"])  # not moved yet
        assert await nothing_arrives(to_coming)
        sup._on_message(idle, ["stats", 5, 600, None, None, "disk", 400])  # its coldest 200
        with trio.fail_after(5):
            assert (await to_coming.receive())[0] == ["roomed", 1]


async def test_a_session_that_fits_gets_its_room_at_once(tmp_path):
    async with bounded_pair(tmp_path) as (sup, (coming, other), (to_coming, to_other)):
        sup._on_message(other, ["stats", 5, 300, None, None, "device"])
        sup._on_message(coming, ["room", 1, 600])
        with trio.fail_after(5):
            assert (await to_coming.receive())[0] == ["roomed", 1]
        assert await nothing_arrives(to_other)


async def test_a_room_request_counts_as_the_askers_size_until_its_next_report(tmp_path):
    async with bounded_pair(tmp_path) as (sup, (grown, other), (to_grown, to_other)):
        sup._on_message(other, ["stats", 5, 300, None, None, "device"])
        # It has not reported yet: its question says what it holds now.
        sup._on_message(grown, ["room", 1, 800])
        assert grown.stats.bytes_in_use == 800
        with trio.fail_after(5):
            assert (await to_other.receive())[0] == ["evict", "disk", 100]
        sup._on_message(other, ["stats", 5, 300, None, None, "disk"])
        with trio.fail_after(5):
            assert (await to_grown.receive())[0] == ["roomed", 1]
        # A newcomer's question now weighs the grown session's 800 bytes.
        sup._on_message(other, ["room", 2, 300])
        with trio.fail_after(5):
            assert (await to_grown.receive())[0] == ["evict", "disk", 100]


def worker_of(*, memory_bounded: bool) -> tuple[WorkerLink, Worker]:
    """A worker in this process (supervisor end, worker) of a host bounded or not."""
    supervisor, link = link_pair()
    spec = WorkerSpec("cpu", 1 << 30, 1 << 26, 60.0, 1 << 30, memory_bounded=memory_bounded)
    return supervisor, Worker(link, spec)


#: A batch that leaves its session holding one tensor of 4 KiB, then fetches it.
GROWING_BATCH = [
    "batch",
    1,
    [["aten.ones.default", [[1024]], {}, [[1, [1024], [1], 0]]]],
    [],
    ["fetch", TensorRef(1, torch.float32, 0, (1024,), (1,))],
    [],
]


async def test_a_grown_session_of_a_bounded_host_asks_its_supervisor_for_room():
    supervisor, worker = worker_of(memory_bounded=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: one_batch(worker.executor, GROWING_BATCH, rank=ON_DEMAND))
        with trio.fail_after(5):
            (message, _) = await supervisor.receive()
        nursery.cancel_scope.cancel()
    assert message == ["room", 1, 4096]


async def test_a_batch_that_says_it_grows_has_its_room_asked_before_its_ops_run():
    supervisor, worker = worker_of(memory_bounded=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            lambda: one_batch(worker.executor, [*GROWING_BATCH, 4096], rank=ON_DEMAND)
        )
        with trio.fail_after(5):
            (message, _) = await supervisor.receive()
        (session,) = worker.executor.sessions.values()
        ran = session.stats.ops
        nursery.cancel_scope.cancel()
    assert message == ["room", 1, 4096]
    assert ran == 0


async def test_a_worker_of_a_host_without_a_device_bound_never_asks_for_room():
    supervisor, worker = worker_of(memory_bounded=False)
    with trio.fail_after(5):
        await one_batch(worker.executor, GROWING_BATCH, rank=ON_DEMAND)
    assert await nothing_arrives(supervisor)


def test_a_worker_asking_for_turns_without_end_is_cut_off():
    sup, (holder, greedy), _ = supervisor_with(ON_DEMAND, ON_DEMAND)
    sup._on_message(holder, ["acquire", 1])
    for number in range(1, MAX_WAITING_TURNS + 1):
        sup._on_message(greedy, ["acquire", number])
    with pytest.raises(LinkClosedError, match="more turns"):
        sup._on_message(greedy, ["acquire", MAX_WAITING_TURNS + 1])


@pytest.mark.slow  # starts a supervisor, its workers and a device check
async def test_workers_that_cannot_start_in_their_namespace_start_without_it(tmp_path):
    gone = tmp_path / "removed-data-dir"  # mounting over it fails, as a broken setup would
    config = SupervisorConfig(ExecutorConfig(device="cpu"), pool=1, hidden=(gone,))
    sup = WorkerSupervisor(config)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        await wait_until(lambda: sup.ready_workers >= 1)
        assert not sup.sandboxed
        assert sup.health.healthy
        nursery.cancel_scope.cancel()


# --- handing sessions over ---------------------------------------------------------------


def handed_to(worker: _Worker, sup: WorkerSupervisor) -> _Handed:
    return _Handed(sup, worker, 1, SessionView(worker.pid))


async def test_a_session_with_more_pipelined_than_the_link_carries_is_cut_off():
    sup, (worker,), (far,) = supervisor_with(ON_DEMAND)
    ours, theirs = trio.testing.memory_stream_pair()
    handed = handed_to(worker, sup)
    too_much = Handover(ours, b"x" * MAX_MESSAGE)
    await handed.start(too_much, bytearray(b"hello"), {})
    assert handed.done.is_set()
    assert "more before its welcome than a session may" in handed.ended
    assert await theirs.receive_some() == b""  # the consumer's connection is closed
    assert await nothing_arrives(far)


async def test_the_bytes_a_worker_reports_are_metered_and_shown():
    sup, (worker,), _ = supervisor_with(ON_DEMAND)
    counted = []
    handed = handed_to(worker, sup)
    worker.handed[1] = handed
    handed._on_bytes = counted.append
    sup._on_message(worker, ["traffic", 1, 4096])
    sup._on_message(worker, ["traffic", 2, 999])  # no such session: ignored
    assert counted == [4096]
    assert handed.view.bytes_carried == 4096
    sup._on_message(worker, ["ended", 1, "consumer closed the session"])
    assert handed.done.is_set()
    assert handed.ended == "consumer closed the session"


async def test_the_bytes_a_workers_collectives_carried_between_hosts_are_metered_apart():
    sup, (worker,), _ = supervisor_with(ON_DEMAND)
    handed = handed_to(worker, sup)
    worker.handed[1] = handed
    frames, peers = [], []
    handed._on_bytes, handed._on_peer_bytes = frames.append, peers.append
    sup._on_message(worker, ["traffic", 1, 300, 4096])
    sup._on_message(worker, ["traffic", 1, 200, 0])
    assert (frames, peers) == ([300, 200], [4096])


async def test_a_resume_for_a_session_whose_worker_died_is_answered_with_how_it_died():
    sup, (worker,), (far,) = supervisor_with(ON_DEMAND)
    handed = handed_to(worker, sup)
    worker.handed[1] = handed
    far.close()  # the worker is gone
    worker.process = SimpleNamespace(pid=100, returncode=-signal.SIGKILL)
    worker.ready.set()
    sup._checking = True  # a device check is under way (none is run in this test)
    sup._forget(worker)
    ours, _ = trio.testing.memory_stream_pair()
    why = await handed.resume(ours, b"hello", b"")
    assert why == "the worker process running it was killed by SIGKILL (a host failure)"
