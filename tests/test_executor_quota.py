"""A provider gives each lease its part of the device: its quota, and its time."""

import trio
import trio.testing

from cumulus_p2p.channel.transport import TrioFrameChannel
from cumulus_p2p.host.executor import Executor, ExecutorConfig
from cumulus_p2p.wire.protocol import PROTOCOL_VERSION, decode_frame, encode_frame


async def welcome_quota(executor: Executor, *, granted: int | None, asked: int | None) -> int:
    client_stream, server_stream = trio.testing.memory_stream_pair()
    client = TrioFrameChannel(client_stream)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            lambda: executor.run_session(TrioFrameChannel(server_stream), quota_bytes=granted)
        )
        options = {} if asked is None else {"quota": asked}
        await client.send_frame(encode_frame(["hello", PROTOCOL_VERSION, options]))
        header, _ = decode_frame(await client.receive_frame())
        await client.send_frame(encode_frame(["bye"]))
    assert header[0] == "welcome"
    return header[2]["quota"]


async def test_a_session_gets_the_quota_its_lease_grants():
    executor = Executor(ExecutorConfig(device="cpu", quota_bytes=8 << 20))
    assert await welcome_quota(executor, granted=2 << 20, asked=None) == 2 << 20


async def test_a_consumer_may_ask_for_less_but_never_more_than_granted():
    executor = Executor(ExecutorConfig(device="cpu", quota_bytes=8 << 20))
    assert await welcome_quota(executor, granted=2 << 20, asked=1 << 20) == 1 << 20
    assert await welcome_quota(executor, granted=2 << 20, asked=4 << 20) == 2 << 20


async def test_a_grant_above_the_executor_quota_is_capped():
    executor = Executor(ExecutorConfig(device="cpu", quota_bytes=8 << 20))
    assert await welcome_quota(executor, granted=64 << 20, asked=None) == 8 << 20


async def test_a_session_whose_time_is_up_is_parked_for_its_next_lease():
    executor = Executor(ExecutorConfig(device="cpu"))
    client_stream, server_stream = trio.testing.memory_stream_pair()
    client = TrioFrameChannel(client_stream)
    async with trio.open_nursery() as nursery:
        until = trio.current_time() + 0.2
        nursery.start_soon(
            lambda: executor.run_session(TrioFrameChannel(server_stream), until=until)
        )
        await client.send_frame(encode_frame(["hello", PROTOCOL_VERSION, {}]))
        header, _ = decode_frame(await client.receive_frame())
        token = header[2]["token"]
        with trio.fail_after(5):
            while executor.sessions:  # the lease runs out while the client is idle
                await trio.sleep(0.05)
    assert token in executor.cache


def test_a_dynamic_ops_input_is_freed_when_its_handle_goes_without_the_gc():
    # On a GPU the collector runs tens of 256 MiB results late: a reference cycle that
    # holds an op's inputs is an out-of-memory error there, not a leak to tidy later.
    import gc
    import weakref

    import torch

    from cumulus_p2p.host.session import DeviceContext, ExecutorSession, parse_batch
    from cumulus_p2p.wire.protocol import tensor_ext, tensor_layout

    session = ExecutorSession(DeviceContext(torch.device("cpu")), quota_bytes=1 << 24)

    def batch(seq: int, ops: list, frees: list) -> None:
        frame = b"".join(encode_frame(["batch", seq, ops, frees, ["sync"], []]))
        reply = session.run_batch(parse_batch(*decode_frame(bytearray(frame))))
        assert reply.error is None

    batch(1, [["aten.ones.default", [[1024]], {}, [[1, [1024], [1], 0]]]], [])
    anchor = weakref.ref(session._handles.get(1).anchor)
    ones = tensor_ext(1, tensor_layout(torch.float32, 0, (1024,), (1,)))
    gc.disable()
    try:
        batch(2, [["aten.nonzero.default", [ones], {}, ["dyn", 2]]], [])
        batch(3, [], [1, 2])
        assert anchor() is None
    finally:
        gc.enable()
