"""How the host's executor opens a native session, and what it does with bad frames.

The executor's side needs only the replay library, which any process may load, so these
run in the test process against a real ``cumulus-executor`` (no native device here).
"""

from __future__ import annotations

import contextlib

import pytest

from cumulus_p2p import native
from cumulus_p2p.channel.transport import SocketFrameChannel
from cumulus_p2p.testing.executor import executor_process
from cumulus_p2p.wire import native as wire
from cumulus_p2p.wire.protocol import PROTOCOL_VERSION, decode_frame, encode_frame

_MISSING = native.missing_toolchain()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(_MISSING is not None, reason=f"cannot build the replay loop: {_MISSING}"),
]


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
