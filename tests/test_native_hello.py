"""How the host's executor opens a native session, and what it does with bad frames.

The executor's side needs only the replay library, which any process may load, so these
run in the test process against a real ``cumulus-executor`` (no native device here).
"""

from __future__ import annotations

import contextlib

import pytest

from cumulus_p2p.channel.transport import SocketFrameChannel
from cumulus_p2p.testing.executor import executor_process
from cumulus_p2p.wire import native as wire
from cumulus_p2p.wire.protocol import PROTOCOL_VERSION, decode_frame, encode_frame

pytestmark = [pytest.mark.slow, pytest.mark.native]


@pytest.fixture(scope="module")
def executor():
    with executor_process(quota="1MiB") as (address, proc):
        host, port = address.split(":")
        yield host, int(port)
        assert proc.poll() is None, "a bad session took the executor down"


@contextlib.contextmanager
def _hello(executor, options: dict):
    channel = SocketFrameChannel.connect(*executor)
    try:
        channel.send_frame(encode_frame(["hello", PROTOCOL_VERSION, options]))
        yield decode_frame(channel.recv_frame())[0], channel
    finally:
        channel.close()


def _empty_batch(channel: SocketFrameChannel):
    """Send an empty batch and return its reply (``wire.parse_reply``)."""
    channel.send_frame(wire.request(wire.BATCH, [], b"", reply=True))
    return wire.parse_reply(channel.recv_frame())


def test_a_native_hello_is_welcomed_with_the_sessions_quota(executor):
    with _hello(executor, {"native": wire.VERSION, "quota": 1 << 40}) as (welcome, channel):
        assert welcome[0] == "welcome"
        assert welcome[2]["native"] == wire.VERSION
        assert welcome[2]["quota"] == 1 << 20  # capped at the executor's
        assert _empty_batch(channel) == []


def test_a_native_hello_of_another_version_is_refused_naming_both(executor):
    with _hello(executor, {"native": wire.VERSION + 1}) as (header, _):
        assert header[0] == "fatal"
        assert f"native version {wire.VERSION + 1}" in header[1]
        assert f"speaks {wire.VERSION}" in header[1]


@pytest.mark.parametrize(
    "frame",
    [b"", b"\x09\x01\x00\x00\x00\x00", b"\x01\x01\xff\xff\xff\xff"],
    ids=["empty", "unknown kind", "name table truncated"],
)
def test_a_malformed_request_ends_the_session_with_a_reason(executor, frame):
    with _hello(executor, {"native": wire.VERSION}) as (welcome, channel):
        assert welcome[0] == "welcome"
        channel.send_frame([frame])
        header, _ = decode_frame(channel.recv_frame())
        assert header[0] == "fatal"
        assert "request" in header[1] or "kind" in header[1]
    with _hello(executor, {"native": wire.VERSION}) as (welcome, channel):
        assert _empty_batch(channel) == []  # the executor serves the next session


def test_a_malformed_record_fails_the_batch_and_every_later_reply(executor):
    with _hello(executor, {"native": wire.VERSION}) as (_, channel):
        channel.send_frame(wire.request(wire.BATCH, [], b"\xfe\x00\x00", reply=True))
        record, kind, _ = wire.parse_reply(channel.recv_frame())
        assert (record, kind) == (0, "malformed")
        assert _empty_batch(channel)[:2] == (0, "malformed")


def test_a_host_that_cannot_build_the_replay_loop_refuses_saying_what_is_missing(tmp_path):
    nothing_built = {"CUMULUS_NATIVE_BUILD_DIR": str(tmp_path), "CXX": "no-such-compiler"}
    with executor_process(env=nothing_built) as (address, _):
        host, port = address.split(":")
        with _hello((host, int(port)), {"native": wire.VERSION}) as (header, _):
            assert header[0] == "fatal"
            assert "this host cannot run native sessions" in header[1]
            assert "no C++ compiler ('no-such-compiler' is not on PATH)" in header[1]
            assert "run without the native device" in header[1]


def _restore(channel: SocketFrameChannel, sources: list, entries: list):
    """Send a RESTORE and return its reply (``wire.parse_reply``)."""
    body = wire.encode_restore(sources, entries)
    channel.send_frame(wire.request(wire.RESTORE, [], body, reply=True))
    return wire.parse_reply(channel.recv_frame())


def test_pieces_kept_for_a_standby_are_pulled_by_the_grant_of_the_welcomes_token(
    executor, tmp_path
):
    import trio

    from cumulus_p2p.blobs.names import digest
    from cumulus_p2p.blobs.service import Source, grant_of, pull
    from cumulus_p2p.blobs.store import BlobStore
    from cumulus_p2p.native import records

    data = b"kept"
    upload = records.Upload(
        records.TensorRef(1, 0, "uint8", (4,), (1,)), records.HostTensor("uint8", (4,), data)
    )
    with _hello(executor, {"native": wire.VERSION}) as (welcome, channel):
        batch = records.encode([records.Alloc(1, 4), upload], [])
        channel.send_frame(wire.request(wire.BATCH, [], batch, reply=False))
        channel.send_frame(wire.request(wire.KEEP, [], b"", reply=True))
        (manifest,) = wire.parse_reply(channel.recv_frame())
        assert wire.parse_manifest(manifest) == [(1, 4, [digest(data)])]
        source = Source("{}:{}".format(*executor), grant_of(welcome[2]["token"]))
        store = BlobStore(tmp_path / "standby", cap=1 << 20)
        pulled = trio.run(lambda: pull(store, [source], [digest(data)], max_frame=1 << 20))
        assert pulled.fetched_bytes == 4 and bytes(store.pin(digest(data)).read()) == data


def test_a_malformed_restore_ends_the_session_with_a_reason(executor):
    with _hello(executor, {"native": wire.VERSION}) as (_, channel):
        channel.send_frame(wire.request(wire.RESTORE, [], b"\xc1", reply=True))
        header, _ = decode_frame(channel.recv_frame())
        assert header[0] == "fatal" and "restore" in header[1]


def test_a_restore_whose_pieces_no_source_has_fails_and_leaves_no_storage(executor):
    from cumulus_p2p.blobs.names import digest

    nowhere = [["127.0.0.1:1", "ab" * 32]]  # nothing listens on port 1
    with _hello(executor, {"native": wire.VERSION}) as (_, channel):
        record, kind, why = _restore(channel, nowhere, [(1, 4, [digest(b"four")])])
        assert (record, kind) == (-1, "restore") and "no source" in why
        # The storage is gone and the session goes on: the handle can be made again.
        channel.send_frame(wire.request(wire.BATCH, [], _alloc(1, 4), reply=True))
        assert wire.parse_reply(channel.recv_frame()) == []


def test_a_restore_over_the_quota_makes_no_storage(executor):
    from cumulus_p2p.blobs.names import PIECE, digest

    big = 2 << 20  # over the executor's 1 MiB
    digests = [digest(bytes([i])) for i in range(-(-big // PIECE))]
    with _hello(executor, {"native": wire.VERSION}) as (_, channel):
        record, kind, why = _restore(channel, [], [(1, big, digests)])
        assert (record, kind) == (-1, "restore") and "could not be made" in why
        assert _empty_batch(channel) == []


def test_a_restore_from_a_source_that_refuses_the_grant_fails_saying_so(executor):
    from cumulus_p2p.blobs.names import digest

    host, port = executor
    stranger = [[f"{host}:{port}", "cd" * 32]]  # this executor, a grant it never gave
    with _hello(executor, {"native": wire.VERSION}) as (_, channel):
        record, kind, why = _restore(channel, stranger, [(1, 4, [digest(b"four")])])
        assert (record, kind) == (-1, "restore") and "grant" in why


def _alloc(handle: int, nbytes: int) -> bytes:
    from cumulus_p2p.native import records

    return records.encode([records.Alloc(handle, nbytes)], [])


def test_a_resume_no_session_here_answers_is_refused_and_a_hello_may_follow(executor):
    resume = {"token": "f" * 32, "native": wire.VERSION}
    channel = SocketFrameChannel.connect(*executor)
    try:
        channel.send_frame(encode_frame(["resume", PROTOCOL_VERSION, resume]))
        assert decode_frame(channel.recv_frame())[0][0] == "refused"
        channel.send_frame(encode_frame(["hello", PROTOCOL_VERSION, {"native": wire.VERSION}]))
        assert decode_frame(channel.recv_frame())[0][0] == "welcome"
        assert _empty_batch(channel) == []
    finally:
        channel.close()


def test_a_dropped_session_is_resumed_with_the_count_of_batches_it_received(executor):
    with _hello(executor, {"native": wire.VERSION}) as (welcome, channel):
        token = welcome[2]["token"]
        channel.send_frame(wire.request(wire.BATCH, [], _alloc(1, 4), reply=False))
        assert _empty_batch(channel) == []
    resume = {"token": token, "native": wire.VERSION}
    channel = SocketFrameChannel.connect(*executor)
    try:
        channel.send_frame(encode_frame(["resume", PROTOCOL_VERSION, resume]))
        header, _ = decode_frame(channel.recv_frame())
        assert header[0] == "welcome" and header[2]["resumed"] is True
        assert header[2]["batches"] == 2 and header[2]["token"] == token
        channel.send_frame(wire.request(wire.RESEND, [], b"", reply=True))
        assert wire.parse_reply(channel.recv_frame()) == []  # the empty batch's reply
    finally:
        channel.close()


def test_resend_before_any_batch_asked_for_a_reply_ends_the_session(executor):
    with _hello(executor, {"native": wire.VERSION}) as (_, channel):
        channel.send_frame(wire.request(wire.RESEND, [], b"", reply=True))
        header, _ = decode_frame(channel.recv_frame())
        assert header[0] == "fatal" and "RESEND" in header[1]


async def test_a_native_sessions_ops_and_memory_show_in_its_stats():
    import trio
    import trio.testing

    from cumulus_p2p.channel.transport import TrioFrameChannel
    from cumulus_p2p.host.executor import Executor, ExecutorConfig

    executor = Executor(ExecutorConfig(device="cpu"))
    client_stream, server_stream = trio.testing.memory_stream_pair()
    client = TrioFrameChannel(client_stream)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(executor.run_session, TrioFrameChannel(server_stream))
        await client.send_frame(encode_frame(["hello", PROTOCOL_VERSION, {"native": wire.VERSION}]))
        assert decode_frame(await client.receive_frame())[0][0] == "welcome"
        await client.send_frame(wire.request(wire.BATCH, [], _alloc(1, 4096), reply=True))
        assert wire.parse_reply(await client.receive_frame()) == []
        stats = executor.session_stats(None)
        assert (stats.bytes_in_use, stats.tier) == (4096, "device")
        await client.send_frame(wire.request(wire.BYE, [], b"", reply=False))
