"""A native session's memory off the device and back (issues 30 and 32), as a Python
session's is (``test_session_tiers.py``): host RAM and the disk tier.

On a CPU executor the device tier is the session's own memory, so the whole path runs
here: the replay loop's storages written to the host's blob store as named pieces, let
go, and made again and filled, checked, before the next request that needs them. The
replay library registers nothing with the dispatcher, so these run in the test process.
"""

from __future__ import annotations

import pytest
import torch

from cumulus_p2p.blobs.names import digest
from cumulus_p2p.blobs.store import BlobStore
from cumulus_p2p.host.eviction import Tier
from cumulus_p2p.native.records import (
    Alloc,
    Free,
    HostTensor,
    Op,
    Readback,
    TensorRef,
    Upload,
    encode,
)
from cumulus_p2p.testing.executor import MemoryTenant, cpu_executor
from cumulus_p2p.wire import native as wire

pytestmark = pytest.mark.native

N = 300_000  # 1.2 MB of float32: a storage of one piece
DATA = torch.linspace(-1.0, 1.0, N)


def ref(handle: int) -> TensorRef:
    return TensorRef(handle, 0, "float32", (N,), (1,))


def upload(handle: int) -> list:
    host = HostTensor("float32", (N,), DATA.numpy().tobytes())
    return [Alloc(handle, N * 4), Upload(ref(handle), host)]


def add(src: int, dst: int, value: float) -> list:
    """``dst = src + value`` (a CPU scalar tensor), then ``src`` freed."""
    return [Op("aten::add.Scalar", (ref(src), value, 1), (ref(dst),)), Free(src)]


def blob(data: bytes) -> tuple[str, memoryview]:
    return digest(data), memoryview(data)


class Client:
    """Requests to one native session, encoded against its op name table."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self._sent = 0

    def request(self, *records, kind: int = wire.BATCH, grows: int = 0) -> bytes:
        batch = encode(records, self.names)
        new, self._sent = self.names[self._sent :], len(self.names)
        return b"".join(wire.request(kind, new, batch, reply=True, grows=grows))


def a_session(tmp_path, cap: int = 1 << 30):
    """A ReplaySession on a CPU with a blob store, holding ``DATA`` (handle 1)."""
    from cumulus_p2p.native.executor import ReplaySession, new_replayer

    store = BlobStore(tmp_path / "blobs", cap)
    session, client = ReplaySession(new_replayer("cpu", 1 << 26), store), Client()
    assert run(session, client.request(*upload(1))) == []
    return session, client, store


def run(session, frame: bytes) -> list[bytes] | tuple:
    going, reply = session.run(frame)
    assert going
    answer = wire.parse_reply(b"".join(reply))
    return answer if isinstance(answer, tuple) else [bytes(part) for part in answer]


def read(session, client, handle: int) -> torch.Tensor:
    (data,) = run(session, client.request(Readback(ref(handle))))
    return torch.frombuffer(bytearray(data), dtype=torch.float32)


@pytest.mark.parametrize("tier", [Tier.RAM, Tier.DISK])
def test_an_evicted_native_session_runs_its_next_batch_with_the_same_results(tmp_path, tier):
    session, client, _ = a_session(tmp_path)
    assert session.evict(tier) == N * 4
    assert session.tier is tier
    assert run(session, client.request(*add(1, 2, 0.5))) == []
    assert session.tier is Tier.DEVICE
    assert torch.equal(read(session, client, 2), DATA + 0.5)


def test_on_disk_its_memory_is_let_go_and_the_pieces_are_pinned(tmp_path):
    session, _, store = a_session(tmp_path)
    session.evict(Tier.DISK)
    assert session.live_bytes == 0 and session.bytes_on_device == 0
    assert session.stats.bytes_in_use == N * 4  # still its own, against its quota
    assert store.statistics().nbytes == N * 4
    store.cap = 0
    assert not store.put(*blob(b"squeezed"))  # the pinned piece cannot go for it


def test_a_piece_damaged_on_disk_fails_the_session_and_says_why(tmp_path):
    session, client, _ = a_session(tmp_path)
    session.evict(Tier.DISK)
    (piece,) = [p for p in (tmp_path / "blobs").iterdir() if len(p.name) == 64]
    data = piece.read_bytes()
    piece.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    record, kind, message = run(session, client.request(Readback(ref(1))))
    assert kind == "evicted" and "evicted to disk is damaged" in message
    assert run(session, client.request())[1] == "evicted"  # and every later reply


def test_a_disk_that_cannot_keep_the_pieces_leaves_the_session_on_the_device(tmp_path):
    session, client, store = a_session(tmp_path, cap=1024)
    with pytest.raises(OSError, match="could not keep"):
        session.evict(Tier.DISK)
    assert session.tier is Tier.DEVICE and session.live_bytes == N * 4
    assert torch.equal(read(session, client, 1), DATA)
    assert store.statistics().nbytes == 0


def test_closing_an_evicted_native_session_unpins_its_pieces(tmp_path):
    session, _, store = a_session(tmp_path)
    session.evict(Tier.DISK)
    session.close()
    store.cap = 16
    assert store.put(*blob(b"room now"))  # the session's piece made way


def test_the_device_tier_is_not_a_tier_to_evict_to(tmp_path):
    session, _, _ = a_session(tmp_path)
    with pytest.raises(ValueError):
        session.evict(Tier.DEVICE)


def a_session_of_three(tmp_path):
    """A session holding ``DATA`` three times (handles 1, 2, 3), in which a batch read
    handle 1 last and none has named handle 2 since it was made."""
    session, client, store = a_session(tmp_path)
    run(session, client.request(*upload(2)))
    run(session, client.request(*upload(3)))
    read(session, client, 1)
    return session, client, store


def test_making_room_moves_only_the_longest_unused_storages_the_room_needs(tmp_path):
    session, _, store = a_session_of_three(tmp_path)
    assert session.evict(Tier.DISK, need=N * 4) == N * 4  # handle 2: one storage is room enough
    assert session.bytes_on_device == 2 * N * 4
    assert session.stats.bytes_in_use == 3 * N * 4  # all three still its own
    assert store.statistics().nbytes == N * 4
    assert session.evict(Tier.DISK, need=N * 4) == N * 4  # then handle 3, not handle 1
    assert session.bytes_on_device == N * 4


def test_a_session_evicted_storage_by_storage_runs_on_with_the_same_results(tmp_path):
    session, client, _ = a_session_of_three(tmp_path)
    session.evict(Tier.DISK, need=N * 4)
    session.evict(Tier.DISK, need=N * 4)
    assert run(session, client.request(*add(2, 4, 0.5), *add(3, 5, 0.25))) == []
    assert session.tier is Tier.DEVICE and session.bytes_on_device == 3 * N * 4
    assert torch.equal(read(session, client, 4), DATA + 0.5)
    assert torch.equal(read(session, client, 5), DATA + 0.25)
    assert torch.equal(read(session, client, 1), DATA)


def test_parking_a_partly_evicted_session_takes_the_rest_off_the_device(tmp_path):
    session, client, _ = a_session_of_three(tmp_path)
    session.evict(Tier.DISK, need=N * 4)
    assert session.park(Tier.DISK) == 0
    assert session.bytes_on_device == 0 and session.stats.bytes_in_use == 3 * N * 4
    session.unpark()
    assert torch.equal(read(session, client, 2), DATA)


# --- one by one: a batch brings back the storages it names --------------------------


def upload_scaled(handle: int, scale: float) -> list:
    """``DATA * scale`` under ``handle``: each storage's own pieces on disk."""
    host = HostTensor("float32", (N,), (DATA * scale).numpy().tobytes())
    return [Alloc(handle, N * 4), Upload(ref(handle), host)]


def a_session_of_distinct_three(
    tmp_path, quota: int = 1 << 26, device: str = "cpu", tier=Tier.DISK
):
    """A session holding ``DATA * handle`` under handles 1, 2 and 3, all evicted to ``tier``."""
    from cumulus_p2p.native.executor import ReplaySession, new_replayer

    store = BlobStore(tmp_path / "blobs", 1 << 30)
    session, client = ReplaySession(new_replayer(device, quota), store), Client()
    for handle in (1, 2, 3):
        assert run(session, client.request(*upload_scaled(handle, handle))) == []
    assert session.evict(tier) == 3 * N * 4
    return session, client, store


def test_a_batch_brings_back_only_the_storages_it_names(tmp_path):
    session, client, store = a_session_of_distinct_three(tmp_path)
    assert torch.equal(read(session, client, 2), DATA * 2)
    assert session.bytes_on_device == N * 4  # handle 2 alone
    assert session.tier is Tier.DISK and session.stats.bytes_in_use == 3 * N * 4
    assert torch.equal(read(session, client, 3), DATA * 3)
    assert torch.equal(read(session, client, 1), DATA)
    assert session.tier is Tier.DEVICE and session.bytes_on_device == 3 * N * 4


def test_a_storage_freed_off_the_device_is_let_go_without_coming_back(tmp_path):
    session, client, store = a_session_of_distinct_three(tmp_path)
    for piece in (tmp_path / "blobs").iterdir():  # were any read back, it would fail
        if len(piece.name) == 64:
            piece.write_bytes(b"damaged")
    assert run(session, client.request(Free(1), Free(2), Free(3))) == []
    assert session.failure is None and session.tier is Tier.DEVICE
    assert session.stats.bytes_in_use == 0
    store.cap = 16
    assert store.put(*blob(b"room now"))  # none of the three pieces is pinned any more


def test_storages_off_the_device_still_count_against_the_quota(tmp_path):
    session, client, _ = a_session_of_distinct_three(tmp_path, quota=4 * N * 4)
    assert run(session, client.request(*upload_scaled(4, 4))) == []
    _, kind, message = run(session, client.request(*upload_scaled(5, 5)))
    assert kind == "out_of_memory" and f"holds {4 * N * 4} of its quota" in message


def test_an_op_whose_output_is_a_storage_off_the_device_brings_it_back_first(tmp_path):
    session, client, _ = a_session_of_distinct_three(tmp_path)
    # 1 + 3 into handle 2, which is off the device: written in place, not made anew.
    op = Op("aten::add.out", (ref(1), ref(3), 1, ref(2)), (ref(2),))
    assert run(session, client.request(op)) == []
    assert torch.equal(read(session, client, 2), DATA * 4)
    assert session.stats.bytes_in_use == 3 * N * 4


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU: host memory is a tier there"
)
def test_on_a_gpu_storages_in_host_memory_go_on_to_disk_from_there(tmp_path):
    session, client, store = a_session_of_distinct_three(tmp_path, device="cuda", tier=Tier.RAM)
    assert session.bytes_on_device == 0 and session.tier is Tier.RAM
    assert session.evict(Tier.DISK) == 3 * N * 4  # the copies, written from host memory
    assert session.tier is Tier.DISK and store.statistics().nbytes == 3 * N * 4
    assert torch.equal(read(session, client, 2), DATA * 2)
    assert session.bytes_on_device == N * 4


def test_parked_in_host_memory_then_on_disk_it_runs_on_with_the_same_results(tmp_path):
    session, client, store = a_session_of_three(tmp_path)
    session.park(Tier.RAM)
    assert session.park(Tier.DISK) == 0
    assert session.tier is Tier.DISK and session.bytes_on_device == 0
    assert store.statistics().nbytes == N * 4  # three storages of the same bytes: one piece
    session.unpark()
    assert torch.equal(read(session, client, 3), DATA)


# --- the executor: native tenants past the device's room, evicted to fit ---------------


class Tenant(MemoryTenant):
    """A native session of the in-process executor, over a memory stream."""

    def __init__(self, executor, nursery, rank) -> None:
        super().__init__(executor, nursery, rank=rank)
        self.client = Client()

    async def hello(self, opening: str = "hello", options: dict | None = None) -> dict:
        return await super().hello(opening, {"native": wire.VERSION} | (options or {}))

    async def batch(self, *records, grows: int = 0) -> list[bytes]:
        await self.channel.send_frame([self.client.request(*records, grows=grows)])
        answer = wire.parse_reply(await self.channel.receive_frame())
        assert not isinstance(answer, tuple), answer
        return [bytes(part) for part in answer]

    async def bye(self) -> None:
        await self.channel.send_frame(wire.request(wire.BYE, [], b"", reply=False))


async def test_native_tenants_past_the_device_evict_the_least_recently_used_exactly(tmp_path):
    import trio

    # Room on the device for two tenants' storages, not three.
    executor = cpu_executor(tmp_path, device_bytes=2 * N * 4 + 4096)
    async with trio.open_nursery() as nursery:
        tenants = [Tenant(executor, nursery, rank=(0, -100)) for _ in range(3)]
        for tenant in tenants:
            await tenant.hello()
            await tenant.batch(*upload(1))
        for tenant in tenants[1:]:
            await tenant.batch()  # a batch sees what the last one grew to, and makes room
        # The second made room by evicting the first, the least recently used.
        assert [s.tier.value for s in executor.sessions.values()] == ["disk", "device", "device"]
        for step in range(2):  # round robin: each batch brings its tenant back
            for i, tenant in enumerate(tenants):
                await tenant.batch(*add(1 + step, 2 + step, float(i + 1)))
        results = [await tenant.batch(Readback(ref(3))) for tenant in tenants]
        tiers = sorted(s.tier.value for s in executor.sessions.values())
        for tenant in tenants:
            await tenant.bye()
    for i, (data,) in enumerate(results):
        assert torch.equal(
            torch.frombuffer(bytearray(data), dtype=torch.float32), DATA + (i + 1) + (i + 1)
        )
    assert tiers == ["device", "device", "disk"]


async def test_a_native_batch_that_says_it_grows_past_the_device_evicts_another_first(tmp_path):
    import trio

    executor = cpu_executor(tmp_path, device_bytes=2 * N * 4 + 4096)
    async with trio.open_nursery() as nursery:
        idle, growing = (Tenant(executor, nursery, rank=(0, -100)) for _ in range(2))
        for tenant in (idle, growing):
            await tenant.hello()
            await tenant.batch(*upload(1))
        await growing.batch(*upload(2), grows=N * 4)
        tiers = [s.tier.value for s in executor.sessions.values()]
        for tenant in (idle, growing):
            await tenant.bye()
    assert tiers == ["disk", "device"]


def test_only_a_batch_says_how_far_it_grows():
    batch = b"".join(wire.request(wire.BATCH, ["aten::add.Scalar"], b"", reply=True, grows=7))
    assert wire.growth(batch) == 7
    assert wire.growth(b"".join(wire.request(wire.KEEP, [], b"", reply=True))) == 0
    assert wire.growth(batch[:5]) == 0  # too short to say: parse_request refuses it
    assert wire.parse_request(batch)[2] == ["aten::add.Scalar"]


async def test_a_dropped_native_tenant_is_parked_on_disk_and_resumes_exactly(tmp_path):
    import trio

    executor = cpu_executor(tmp_path, device_bytes=4 * N * 4)
    async with trio.open_nursery() as nursery:
        tenant = Tenant(executor, nursery, rank=(1, 0))
        token = (await tenant.hello())["token"]
        await tenant.batch(*upload(1))
        await tenant.channel.aclose()  # hung up, as a preempted lease is
        with trio.fail_after(5):
            while executor.cache.statistics().entries != 1:
                await trio.sleep(0.02)
        (parked,) = [e.value for e in executor.cache._entries.values()]
        assert parked.tier is Tier.DISK
        assert executor.cache.statistics().bytes == 0  # none of the cache's host memory
        again = Tenant(executor, nursery, rank=(1, 0))
        again.client = tenant.client  # the same session's name table
        assert (await again.hello("resume", {"token": token}))["resumed"]
        (data,) = await again.batch(Readback(ref(1)))
        await again.bye()
    assert torch.equal(torch.frombuffer(bytearray(data), dtype=torch.float32), DATA)
