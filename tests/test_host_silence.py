"""A host that hangs is told from a slow one by its silence (``host/keepalive.py``).

A stopped process or a frozen machine keeps its connections open, its kernel answering
for it: while it holds a request, a live executor sends keepalives (empty frames), and a
consumer that hears nothing for its ``silence_s`` gives the host up (``HostSilentError``).
"""

from __future__ import annotations

import signal
import socket
import threading
import time

import pytest
import torch
import trio

import cumulus_p2p.remote as remote
from cumulus_p2p._errors import HostSilentError, RemoteExecutionError, SessionClosedError
from cumulus_p2p.channel.secure import connect_secure
from cumulus_p2p.channel.transport import (
    SocketFrameChannel,
    TrioFrameChannel,
    fell_silent_within,
    silence_limit,
)
from cumulus_p2p.host.keepalive import KeptAlive, keeping_alive
from cumulus_p2p.identity import NodeIdentity
from cumulus_p2p.testing.executor import executor_process

CONSUMER = NodeIdentity.generate()


def frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(4, "big") + payload


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        ours = socket.create_connection(listener.getsockname())
        theirs, _ = listener.accept()
    return ours, theirs


# --- the consumer's channel ------------------------------------------------------------


def test_a_silent_peer_is_given_up_once_the_silence_limit_passes():
    ours, theirs = tcp_pair()
    channel = SocketFrameChannel(ours, silence_s=0.3)
    started = time.monotonic()
    with pytest.raises(HostSilentError, match="sent nothing for 0.3 s"):
        channel.recv_frame()
    assert time.monotonic() - started >= 0.3
    theirs.close()


def test_keepalives_hold_a_long_wait_and_are_never_returned_as_frames():
    ours, theirs = tcp_pair()
    channel = SocketFrameChannel(ours, silence_s=0.3)

    def slow_answer():
        for _ in range(10):  # a second in all: three times the limit
            time.sleep(0.1)
            theirs.sendall(frame(b""))
        theirs.sendall(frame(b"the answer"))

    answering = threading.Thread(target=slow_answer)
    answering.start()
    assert channel.recv_frame() == b"the answer"
    answering.join()


def test_a_silent_host_is_remembered_so_failover_tries_it_last():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    channel = SocketFrameChannel.connect("127.0.0.1", port, silence_s=0.2)
    assert not fell_silent_within("127.0.0.1", port, 60)
    with pytest.raises(HostSilentError):
        channel.recv_frame()
    assert fell_silent_within("127.0.0.1", port, 60)
    channel.close()
    listener.close()


def test_the_silence_limit_comes_from_the_environment():
    assert silence_limit({}) == 30.0
    assert silence_limit({"CUMULUS_SILENCE_S": "12.5"}) == 12.5


@pytest.mark.parametrize("raw", ["soon", "", "3", "-10", "nan", "inf"])
def test_a_silence_limit_that_is_not_seconds_above_two_keepalives_is_refused(raw):
    with pytest.raises(ValueError, match="CUMULUS_SILENCE_S=.*at least 4"):
        silence_limit({"CUMULUS_SILENCE_S": raw})


# --- the executor's keepalives ---------------------------------------------------------


async def kept_pair(every_s: float):
    """A ``KeptAlive`` executor end and a plain socket at the consumer's end."""
    ours, theirs = trio.socket.socketpair()
    inner = TrioFrameChannel(trio.SocketStream(ours))
    return KeptAlive(inner, every_s), theirs


async def frames_within(sock, seconds: float) -> list[bytes]:
    """Every frame that arrives on ``sock`` within ``seconds``."""
    data = b""
    with trio.move_on_after(seconds):
        while chunk := await sock.recv(65536):
            data += chunk
    frames = []
    while data:
        size = int.from_bytes(data[:4], "big")
        frames.append(data[4 : 4 + size])
        data = data[4 + size :]
    return frames


async def test_an_executor_holding_a_request_sends_keepalives_until_it_answers():
    kept, consumer = await kept_pair(every_s=0.1)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(kept.pulse)
        await consumer.send(frame(b"a long request"))
        assert await kept.receive_frame() == b"a long request"
        await trio.sleep(0.55)  # the op runs
        await kept.send_frame([b"done"])
        got = await frames_within(consumer, 0.3)
        nursery.cancel_scope.cancel()
    assert got[-1] == b"done"
    assert got[:-1] == [b""] * len(got[:-1])
    assert 3 <= len(got) - 1 <= 6


async def test_an_executor_that_owes_nothing_stays_quiet():
    kept, consumer = await kept_pair(every_s=0.05)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(kept.pulse)
        await consumer.send(frame(b"request"))
        await kept.receive_frame()
        await kept.send_frame([b"answer"])
        nursery.start_soon(kept.receive_frame)  # waits for the next request
        got = await frames_within(consumer, 0.5)
        nursery.cancel_scope.cancel()
    assert got == [b"answer"]


async def test_a_keepalive_that_finds_the_connection_gone_stops_and_leaves_the_session_be():
    # The session's own next write finds the connection gone, and parks the session.
    kept, consumer = await kept_pair(every_s=0.05)
    await consumer.send(frame(b"request"))
    await kept.receive_frame()
    consumer.close()
    with trio.fail_after(5):
        await kept.pulse()  # returns, raising nothing


async def test_keeping_alive_lets_the_blocks_own_error_through_as_it_is():
    ours, _theirs = trio.socket.socketpair()
    with pytest.raises(SessionClosedError, match="gone"):
        async with keeping_alive(TrioFrameChannel(trio.SocketStream(ours))):
            raise SessionClosedError("gone")


# --- real executors --------------------------------------------------------------------


@pytest.mark.slow
def test_a_request_longer_than_the_silence_limit_is_answered_not_given_up():
    # A rank alone in a group of two waits out the group's 9 s timeout in its executor:
    # the consumer, which gives up after 4 s of silence, hears keepalives all along.
    with executor_process() as (address, _):
        host, port = address.split(":")
        channel = SocketFrameChannel.connect(host, int(port), silence_s=4.0)
        with remote.attach(channel=channel) as session:
            secret = "0123456789abcdef"
            store = session.call(["@pg_store", ["127.0.0.1", 2, secret], {}, None])
            join = ["job", "127.0.0.1", store, secret, 0, 2, "127.0.0.1", 9.0]
            session.submit(["@pg_join", join, {}, None])
            started = time.monotonic()
            with pytest.raises(RemoteExecutionError, match="could not join group"):
                session.synchronize()
            assert time.monotonic() - started > 4.0
            assert (torch.arange(3.0, device="cumulus") * 2).sum().item() == 6.0


@pytest.mark.slow
def test_a_stopped_host_behind_the_secure_channel_is_given_up(tmp_path):
    extra = ["--secure", "--data-dir", str(tmp_path), "--allow-key", CONSUMER.public_key.hex()]
    with executor_process(extra=extra) as (address, proc):
        host, port = address.split(":")
        channel = connect_secure(
            host,
            int(port),
            identity=CONSUMER,
            expected_peer_public_key=proc.provider_key,
            silence_s=4.0,
        )
        with remote.attach(channel=channel):
            x = torch.ones(4, device="cumulus")
            assert x.sum().item() == 4.0
            proc.send_signal(signal.SIGSTOP)
            started = time.monotonic()
            try:
                with pytest.raises(HostSilentError, match="sent nothing for 4 s"):
                    (x * 2).sum().item()
            finally:
                proc.kill()
                proc.wait()
            assert time.monotonic() - started < 30  # not a resume's retries after it
