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


def run(session: ExecutorSession, seq: int, ops: list, query=None):
    frame = b"".join(encode_frame(["batch", seq, ops, [], query or ["sync"], []]))
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


def test_a_piece_damaged_on_disk_is_that_sessions_error_never_its_data(tmp_path):
    session, store = a_session(tmp_path)
    session.evict(Tier.DISK)
    (piece,) = [p for p in (tmp_path / "blobs").iterdir() if len(p.name) == 64]
    damaged = bytearray(piece.read_bytes())
    damaged[100] ^= 0xFF
    piece.write_bytes(bytes(damaged))
    with pytest.raises(BlobMismatchError, match="evicted to disk is damaged"):
        doubled(session, 2)


def test_a_disk_that_cannot_keep_the_pieces_leaves_the_session_on_the_device(tmp_path):
    session, _ = a_session(tmp_path, cap=1024)
    before = doubled(session, 2)
    with pytest.raises(OSError, match="could not keep"):
        session.evict(Tier.DISK)
    assert session.tier is Tier.DEVICE
    assert doubled(session, 3)[: N * 4] == before[: N * 4]


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


# --- the executor: quotas adding up to more than the device, sessions evicted to fit -----


class Tenant:
    """A session of the in-process executor, driven frame by frame over a memory stream."""

    def __init__(self, executor, nursery, rank) -> None:
        import trio.testing

        from cumulus_p2p.channel.transport import TrioFrameChannel

        client, server = trio.testing.memory_stream_pair()
        self.channel = TrioFrameChannel(client)
        nursery.start_soon(lambda: executor.run_session(TrioFrameChannel(server), rank=rank))
        self.seq = 0

    async def hello(self) -> None:
        from cumulus_p2p.wire.protocol import PROTOCOL_VERSION

        await self.channel.send_frame(encode_frame(["hello", PROTOCOL_VERSION, {}]))
        assert decode_frame(await self.channel.receive_frame())[0][0] == "welcome"

    async def batch(self, ops: list, query: list, frees: tuple = ()) -> tuple:
        self.seq += 1
        frame = ["batch", self.seq, ops, list(frees), query, []]
        await self.channel.send_frame(encode_frame(frame))
        header, area = decode_frame(await self.channel.receive_frame())
        assert header[2] is None, header
        return header, area

    async def stats(self) -> dict:
        return (await self.batch([], ["stats"]))[0][3]


async def test_quotas_past_the_device_evict_the_least_recently_used_and_results_stay_exact(
    tmp_path,
):
    import trio

    from cumulus_p2p.host.executor import Executor, ExecutorConfig

    # Room on the device for two tenants' storages, not three.
    config = ExecutorConfig(device="cpu", blob_dir=str(tmp_path), device_bytes=2 * N * 4 + 4096)
    executor = Executor(config)
    async with trio.open_nursery() as nursery:
        tenants = [Tenant(executor, nursery, rank=(0, -100)) for _ in range(3)]
        for tenant in tenants:
            await tenant.hello()
            await tenant.batch([["aten.ones.default", [[N]], {}, [[1, [N], [1], 0]]]], ["sync"])
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
