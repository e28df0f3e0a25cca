"""A session's memory off the device and back (issue 32): host RAM and the disk tier.

On a CPU executor the device tier is the session's own memory, so the whole path runs
here: storages written to the host's blob store as named pieces, let go, and read back,
checked, before the next batch.
"""

from __future__ import annotations

import pytest
import torch

from cumulus_p2p._errors import BlobMismatchError
from cumulus_p2p.blobs.store import BlobStore
from cumulus_p2p.host.eviction import Tier
from cumulus_p2p.host.session import DeviceContext, ExecutorSession, parse_batch
from cumulus_p2p.testing.executor import MemoryTenant, cpu_executor
from cumulus_p2p.wire.protocol import (
    decode_frame,
    encode_frame,
    split_blobs,
    tensor_ext,
    tensor_layout,
)

N = 300_000  # 1.2 MB: a storage of one piece


def ref(handle: int):
    return tensor_ext(handle, tensor_layout(torch.float32, 0, (N,), (1,)))


def run(session: ExecutorSession, seq: int, ops: list, query=None, frees=()):
    frame = b"".join(encode_frame(["batch", seq, ops, list(frees), query or ["sync"], []]))
    reply = session.run_batch(parse_batch(*decode_frame(bytearray(frame))))
    assert reply.error is None, reply.error
    return reply


def a_session(tmp_path, cap: int = 1 << 30, ctx=None) -> tuple[ExecutorSession, BlobStore]:
    """A session holding a random storage (handle 1), on a CPU with a blob store; in
    ``ctx`` when given (sessions of one executor share its generator, each with its state)."""
    store = BlobStore(tmp_path / "blobs", cap)
    ctx = ctx or DeviceContext(torch.device("cpu"), blobs=store)
    session = ExecutorSession(ctx, quota_bytes=1 << 26)
    run(session, 1, [["aten.randn.default", [[N]], {}, [[1, [N], [1], 0]]]])
    return session, store


def doubled(session: ExecutorSession, seq: int) -> bytes:
    """Handle 1 times two, and a fresh random draw, read back."""
    ops = [
        ["aten.mul.Tensor", [ref(1), 2.0], {}, [[10 + seq, [N], [1], 0]]],
        ["aten.randn.default", [[N]], {}, [[20 + seq, [N], [1], 0]]],
    ]
    value = run(session, seq, ops, ["fetch", ref(10 + seq)]).blobs[0]
    draw = run(session, seq + 100, [], ["fetch", ref(20 + seq)]).blobs[0]
    return bytes(value) + bytes(draw)


@pytest.mark.parametrize("tier", [Tier.RAM, Tier.DISK])
def test_an_evicted_session_runs_its_next_batch_with_bit_identical_results(tmp_path, tier):
    ctx = DeviceContext(torch.device("cpu"), blobs=BlobStore(tmp_path / "blobs", 1 << 30))
    stayed, _ = a_session(tmp_path, ctx=ctx)
    moved, _ = a_session(tmp_path, ctx=ctx)
    assert moved.evict(tier) == N * 4
    assert moved.tier is tier
    assert doubled(moved, 2) == doubled(stayed, 2)
    assert moved.tier is Tier.DEVICE


def test_on_disk_the_storages_memory_is_let_go_and_the_pieces_are_pinned(tmp_path):
    session, store = a_session(tmp_path)
    session.evict(Tier.DISK)
    (entry,) = (e for _, e in session._handles.items())
    assert entry.anchor.numel() == 0
    assert store.statistics().nbytes == N * 4
    store.cap = 0
    assert not store.put(*_blob(b"squeezed"))  # the pinned piece cannot be evicted for it


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: data[:100] + bytes([data[100] ^ 0xFF]) + data[101:],  # a flipped bit
        lambda data: data[: len(data) // 2],  # truncated
    ],
    ids=["flipped", "truncated"],
)
def test_a_piece_damaged_on_disk_is_that_sessions_error_never_its_data(tmp_path, damage):
    session, store = a_session(tmp_path)
    session.evict(Tier.DISK)
    (piece,) = [p for p in (tmp_path / "blobs").iterdir() if len(p.name) == 64]
    piece.write_bytes(damage(piece.read_bytes()))
    with pytest.raises(BlobMismatchError, match="evicted to disk is damaged"):
        doubled(session, 2)


def test_a_disk_that_cannot_keep_the_pieces_leaves_the_session_on_the_device(tmp_path):
    session, _ = a_session(tmp_path, cap=1024)
    before = doubled(session, 2)
    with pytest.raises(OSError, match="could not keep"):
        session.evict(Tier.DISK)
    assert session.tier is Tier.DEVICE
    assert doubled(session, 3)[: N * 4] == before[: N * 4]


def test_the_disk_tiers_cap_holds_across_sessions(tmp_path):
    # Room on disk for one session's storage, not two.
    store = BlobStore(tmp_path / "blobs", N * 4 + N * 2)
    ctx = DeviceContext(torch.device("cpu"), blobs=store)
    first, _ = a_session(tmp_path, ctx=ctx)
    second, _ = a_session(tmp_path, ctx=ctx)
    doubled(second, 2)  # storages of its own (both drew the same first storage)
    first.evict(Tier.DISK)
    with pytest.raises(OSError, match="could not keep"):
        second.evict(Tier.DISK)  # the first's pinned piece is not evicted for it
    assert store.statistics().nbytes <= store.cap
    assert (first.tier, second.tier) == (Tier.DISK, Tier.DEVICE)


def test_closing_an_evicted_session_unpins_its_pieces(tmp_path):
    session, store = a_session(tmp_path)
    session.evict(Tier.DISK)
    session.close()
    store.cap = 16
    assert store.put(*_blob(b"room now"))  # the session's piece made way


def test_the_device_tier_is_not_a_tier_to_evict_to(tmp_path):
    session, _ = a_session(tmp_path)
    with pytest.raises(ValueError):
        session.evict(Tier.DEVICE)


def _blob(data: bytes):
    from cumulus_p2p.blobs.names import digest

    return digest(data), memoryview(data)


@pytest.mark.parametrize("tier", [Tier.RAM, Tier.DISK])
def test_evicted_storage_by_storage_the_longest_unused_leave_first_and_results_stay_exact(
    tmp_path, tier
):
    session, _ = a_session(tmp_path)  # handle 1, made in batch 1
    run(session, 2, [["aten.randn.default", [[N]], {}, [[2, [N], [1], 0]]]])
    run(session, 3, [["aten.mul.Tensor", [ref(1), 2.0], {}, [[3, [N], [1], 0]]]])
    expected = bytes(run(session, 4, [], ["fetch", ref(2)]).blobs[0])
    run(session, 5, [["aten.add.Tensor", [ref(1), ref(3)], {}, [[4, [N], [1], 0]]]])
    # Handle 2 went unnamed since batch 4; 1, 3 and 4 were named in batch 5.
    assert session.evict(tier, need=N * 4) == N * 4
    assert session.tier is tier and session.bytes_on_device == 3 * N * 4
    assert session.evict(tier, need=N * 4) == N * 4  # one more, up to what is asked
    assert session.bytes_on_device == 2 * N * 4
    assert (session.evictions, session.evicted_bytes) == (2, 2 * N * 4)
    assert bytes(run(session, 6, [], ["fetch", ref(2)]).blobs[0]) == expected
    assert session.tier is tier and session.bytes_on_device == 3 * N * 4  # 2 alone came back
    for seq, handle in enumerate((1, 3, 4), start=7):
        run(session, seq, [], ["fetch", ref(handle)])
    assert session.tier is Tier.DEVICE and session.bytes_on_device == 4 * N * 4


def test_a_batch_brings_back_only_the_storages_it_names_and_lets_go_of_those_it_frees(tmp_path):
    session, _ = a_session(tmp_path)  # handle 1
    run(session, 2, [["aten.mul.Tensor", [ref(1), 2.0], {}, [[2, [N], [1], 0]]]])
    run(session, 3, [["aten.mul.Tensor", [ref(1), 3.0], {}, [[3, [N], [1], 0]]]])
    expected = bytes(run(session, 4, [], ["fetch", ref(2)]).blobs[0])
    session.evict(Tier.DISK)
    assert bytes(run(session, 5, [], ["fetch", ref(2)]).blobs[0]) == expected
    assert session.tier is Tier.DISK and session.bytes_on_device == N * 4
    run(session, 6, [], ["sync"], frees=[1, 3])  # freed where they lie, never read back
    assert session.tier is Tier.DEVICE and session.stats.bytes_in_use == N * 4
    assert _pins(tmp_path / "blobs") == 0


@pytest.mark.parametrize(
    ("cache_bytes", "blob_store", "tier"),
    [(1 << 30, True, Tier.RAM), (N * 4 - 1, True, Tier.DISK), (N * 4 - 1, False, Tier.RAM)],
    ids=["fits the host cache", "past the host cache", "past it, no disk"],
)
def test_off_a_gpu_a_parked_session_goes_to_disk_only_past_the_host_caches_budget(
    tmp_path, cache_bytes, blob_store, tier
):
    store = tmp_path / "blobs" if blob_store else None
    executor = cpu_executor(store, cache_bytes=cache_bytes)
    session, _ = a_session(tmp_path, ctx=executor.ctx)
    executor.ctx.device = torch.device("cuda", 0)  # a GPU host's, as far as the choice goes
    assert executor._park_tier(session) is tier


# --- the executor: quotas adding up to more than the device, sessions evicted to fit -----


class Tenant(MemoryTenant):
    """A session of the in-process executor, its batches numbered."""

    def __init__(self, executor, nursery, rank) -> None:
        super().__init__(executor, nursery, rank=rank)
        self.seq = 0

    async def batch(self, ops: list, query: list, frees: tuple = (), grows: int = 0) -> tuple:
        """Send a batch (saying it creates ``grows`` bytes of storages) and read its reply."""
        self.seq += 1
        frame = ["batch", self.seq, ops, list(frees), query, [], grows]
        await self.channel.send_frame(encode_frame(frame))
        header, area = decode_frame(await self.channel.receive_frame())
        assert header[2] is None, header
        return header, area

    async def stats(self) -> dict:
        return (await self.batch([], ["stats"]))[0][3]

    async def open_with_ones(self) -> None:
        """Open the session and make its tensor 1: ``N`` ones, on the device."""
        await self.hello()
        await self.batch([["aten.ones.default", [[N]], {}, [[1, [N], [1], 0]]]], ["sync"])


async def test_quotas_past_the_device_evict_the_least_recently_used_and_results_stay_exact(
    tmp_path,
):
    import trio

    # Room on the device for two tenants' storages, not three.
    executor = cpu_executor(tmp_path, device_bytes=2 * N * 4 + 4096)
    async with trio.open_nursery() as nursery:
        tenants = [Tenant(executor, nursery, rank=(0, -100)) for _ in range(3)]
        for tenant in tenants:
            await tenant.open_with_ones()
        # The third made room by evicting the first, the least recently used.
        assert [(await t.stats())["tier"] for t in tenants[1:]] == ["device", "device"]
        assert [s.tier.value for s in executor.sessions.values()] == ["disk", "device", "device"]
        for step in range(2):  # round robin: each batch brings its tenant back
            for i, tenant in enumerate(tenants):
                old, new = 1 + step, 2 + step
                add = ["aten.add.Tensor", [ref(old), float(i + 1)], {}, [[new, [N], [1], 0]]]
                await tenant.batch([add], ["sync"], frees=[old])
        sums = []
        for tenant in tenants:
            total = ["aten.sum.default", [ref(3)], {}, [[99, [], [], 0]]]
            scalar = tensor_ext(99, tensor_layout(torch.float32, 0, (), ()))
            header, area = await tenant.batch([total], ["fetch", scalar])
            (value,) = split_blobs(area, header[4])
            sums.append(torch.frombuffer(bytearray(value), dtype=torch.float32).item())
        tiers = [s.tier.value for s in executor.sessions.values()]
        for tenant in tenants:
            await tenant.channel.send_frame(encode_frame(["bye"]))
    assert sums == [N * (1 + 2 * (i + 1)) for i in range(3)]
    assert sorted(tiers) == ["device", "device", "disk"]


async def test_a_batch_that_says_it_grows_past_the_device_evicts_another_before_it_runs(
    tmp_path,
):
    import trio

    executor = cpu_executor(tmp_path, device_bytes=2 * N * 4 + 4096)
    async with trio.open_nursery() as nursery:
        idle, growing = (Tenant(executor, nursery, rank=(0, -100)) for _ in range(2))
        await idle.open_with_ones()
        await growing.open_with_ones()
        more = ["aten.ones.default", [[N]], {}, [[2, [N], [1], 0]]]
        await growing.batch([more], ["sync"], grows=N * 4)
        tiers = [s.tier.value for s in executor.sessions.values()]
        for tenant in (idle, growing):
            await tenant.channel.send_frame(encode_frame(["bye"]))
    assert tiers == ["disk", "device"]


async def test_making_room_moves_only_the_storages_the_room_needs(tmp_path):
    import trio

    executor = cpu_executor(tmp_path, device_bytes=3 * N * 4 + 4096)
    async with trio.open_nursery() as nursery:
        older, newer = (Tenant(executor, nursery, rank=(0, -100)) for _ in range(2))
        await older.open_with_ones()
        await older.batch([["aten.ones.default", [[N]], {}, [[2, [N], [1], 0]]]], ["sync"])
        await newer.open_with_ones()
        await newer.batch(
            [["aten.ones.default", [[N]], {}, [[2, [N], [1], 0]]]], ["sync"], grows=N * 4
        )
        on_device = [s.bytes_on_device for s in executor.sessions.values()]
        for tenant in (older, newer):
            await tenant.channel.send_frame(encode_frame(["bye"]))
    assert on_device == [N * 4, 2 * N * 4]  # the older gave up one storage of its two


async def test_an_evicted_session_that_fits_comes_back_ahead_of_its_turn(tmp_path):
    import trio

    executor = cpu_executor(tmp_path, device_bytes=4 * N * 4)
    async with trio.open_nursery() as nursery:
        tenant = Tenant(executor, nursery, rank=(0, -100))
        await tenant.open_with_ones()
        (session,) = executor.sessions.values()
        session.evict(Tier.DISK)
        await executor.scheduler.acquire((0, -100))  # another tenant's long turn
        added = ["aten.add.Tensor", [ref(1), 1.0], {}, [[2, [N], [1], 0]]]
        replied = trio.Event()

        async def waiting_batch():
            await tenant.batch([added], ["fetch", ref(2)])
            replied.set()

        nursery.start_soon(waiting_batch)
        await _until(lambda: session.tier is Tier.DEVICE)
        assert session.stats.ops == 1 and not replied.is_set()  # its op waits for a turn
        executor.scheduler.release()
        await replied.wait()
        await tenant.channel.send_frame(encode_frame(["bye"]))


async def test_two_evictions_asked_at_once_move_the_session_once_and_fail_nothing(tmp_path):
    """A supervisor's second ``evict`` may come while the first waits for the turn: the
    second finds the session gone from the device, and says it moved nothing."""
    import trio

    executor = cpu_executor(tmp_path, device_bytes=4 * N * 4)
    async with trio.open_nursery() as nursery:
        tenant = Tenant(executor, nursery, rank=(0, -100))
        await tenant.open_with_ones()
        await executor.scheduler.acquire((0, -100))  # both evictions wait for the turn
        moved = []

        async def evict_all():
            moved.append(await executor.evict_all())

        async with trio.open_nursery() as evictions:
            evictions.start_soon(evict_all)
            evictions.start_soon(evict_all)
            await trio.testing.wait_all_tasks_blocked()
            executor.scheduler.release()
        (session,) = executor.sessions.values()
        assert sorted(moved) == [0, N * 4] and session.tier is Tier.DISK
        await tenant.channel.send_frame(encode_frame(["bye"]))


async def test_a_dropped_tenants_memory_is_parked_on_disk_and_its_resume_is_exact(tmp_path):
    """A preempted lease's session is hung up and parked (``Provider.end_preempted``): on
    a device with bounded room its storages leave it, and come back exactly."""
    import trio

    executor = cpu_executor(tmp_path, device_bytes=4 * N * 4)
    async with trio.open_nursery() as nursery:
        tenant = Tenant(executor, nursery, rank=(1, 0))
        token = (await tenant.hello())["token"]
        await tenant.batch([["aten.randn.default", [[N]], {}, [[1, [N], [1], 0]]]], ["sync"])
        expected = bytes((await tenant.batch([], ["fetch", ref(1)]))[1])
        await tenant.channel.aclose()  # hung up, as a preempted lease is
        await _until(lambda: executor.cache.statistics().entries == 1)
        (parked,) = [e.value for e in executor.cache._entries.values()]
        assert parked.tier is Tier.DISK
        assert executor.cache.statistics().bytes == 0  # none of the cache's host memory
        again = Tenant(executor, nursery, rank=(1, 0))
        assert (await again.hello("resume", {"token": token}))["resumed"]
        assert bytes((await again.batch([], ["fetch", ref(1)]))[1]) == expected
        await again.channel.send_frame(encode_frame(["bye"]))


async def test_an_older_parked_session_moves_to_disk_for_a_newer_one_and_both_resume_exactly(
    tmp_path,
):
    """The host cache's memory holds one session: when a second is parked, the first goes
    to disk instead of being dropped, and each tenant resumes where it was."""
    import trio

    executor = cpu_executor(tmp_path, cache_bytes=N * 4 + 4096)
    async with trio.open_nursery() as nursery:
        tokens, expected = [], []
        for parked in (1, 2):
            tenant = Tenant(executor, nursery, rank=(1, 0))
            tokens.append((await tenant.hello())["token"])
            await tenant.batch([["aten.randn.default", [[N]], {}, [[1, [N], [1], 0]]]], ["sync"])
            expected.append(bytes((await tenant.batch([], ["fetch", ref(1)]))[1]))
            await tenant.channel.aclose()  # its consumer vanished
            await _until(lambda n=parked: executor.cache.statistics().entries == n)
        first, second = [e.value for e in executor.cache._entries.values()]
        assert (first.tier, second.tier) == (Tier.DISK, Tier.RAM)
        assert executor.cache.statistics().bytes == N * 4
        for token, data in zip(tokens, expected, strict=True):
            again = Tenant(executor, nursery, rank=(1, 0))
            assert (await again.hello("resume", {"token": token}))["resumed"]
            assert bytes((await again.batch([], ["fetch", ref(1)]))[1]) == data
            await again.channel.send_frame(encode_frame(["bye"]))


@pytest.mark.slow  # tenant processes
async def test_a_sigkilled_consumers_session_leaves_no_tier_holding_anything(tmp_path):
    """Two tenant processes on room for one: the paused one is evicted to disk, then
    SIGKILLed. Once its grace ends, no tier holds anything of it: no session, nothing
    parked, no piece pinned (each pin is an open descriptor on the store)."""
    import signal

    import trio

    from cumulus_p2p.testing.tenant import Tenant as TenantProcess

    store = tmp_path / "blobs"
    executor = cpu_executor(store, device_bytes=200_000, cache_grace=0.5)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(executor.serve_tcp)
        address = f"127.0.0.1:{port}"
        killed = TenantProcess(address, "mlp", 4, pause_after=2)
        await trio.to_thread.run_sync(killed.read)  # its welcome
        assert (await trio.to_thread.run_sync(killed.read)) == {"paused": 2}
        other = TenantProcess(address, "mlp", 4)
        assert "losses" in await trio.to_thread.run_sync(other.finish)
        assert [s.tier for s in executor.sessions.values()] == [Tier.DISK]
        assert _pins(store) > 0
        killed.proc.send_signal(signal.SIGKILL)
        killed.proc.wait()
        await _until(lambda: executor.idle, timeout=10)
        assert _pins(store) == 0
        nursery.cancel_scope.cancel()


def _pins(store) -> int:
    """This process's open descriptors on ``store``'s files: the pinned pieces."""
    import os

    fds = os.listdir("/proc/self/fd")
    targets = []
    for fd in fds:
        try:
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    return sum(t.startswith(str(store)) for t in targets)


async def _until(condition, timeout: float = 5.0) -> None:
    import trio

    with trio.fail_after(timeout):
        while not condition():
            await trio.sleep(0.02)
