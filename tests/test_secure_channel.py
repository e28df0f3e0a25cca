"""The secure channel end to end: real sockets on 127.0.0.1, a trio provider and a
blocking consumer in a worker thread, as in production."""

from __future__ import annotations

import itertools
import logging
import os
import socket
import struct
import threading
import time
from contextlib import asynccontextmanager

import pytest
import trio

from cumulus_p2p._errors import (
    PeerAuthenticationError,
    SessionClosedError,
    SessionRefusedError,
)
from cumulus_p2p.channel.secure import SessionSettings, connect_secure, serve_secure
from cumulus_p2p.channel.secure import handshake as hs
from cumulus_p2p.identity import NodeIdentity

PROVIDER = NodeIdentity.generate()
CONSUMER = NodeIdentity.generate()
STRANGER = NodeIdentity.generate()


def allow_all(key: bytes, lease: bytes | None) -> str | None:
    return None


class Recorder:
    """An echo handler that remembers what it saw and how its session ended."""

    def __init__(self) -> None:
        self.frames: list[bytes] = []
        self.ended: BaseException | None = None
        self.done = trio.Event()
        self.sessions = 0

    async def __call__(self, channel) -> None:
        self.sessions += 1
        try:
            while True:
                frame = await channel.receive_frame()
                self.frames.append(bytes(frame))
                await channel.send_frame([frame])
        except SessionClosedError as exc:
            self.ended = exc
        finally:
            self.done.set()


@asynccontextmanager
async def provider(handler, *, authorize=allow_all, identity=PROVIDER, **settings):
    """A provider on 127.0.0.1; ``settings`` are ``SessionSettings`` fields."""
    async with trio.open_nursery() as nursery:
        server = await nursery.start(
            lambda task_status: serve_secure(
                identity,
                authorize=authorize,
                handler=handler,
                settings=SessionSettings(**settings),
                task_status=task_status,
            )
        )
        yield server
        nursery.cancel_scope.cancel()


def connect(server, identity=CONSUMER, **kw):
    kw.setdefault("expected_peer_public_key", PROVIDER.public_key)
    return connect_secure("127.0.0.1", server.port, identity=identity, timeout=5, **kw)


async def in_thread(fn, *args):
    with trio.fail_after(20):
        return await trio.to_thread.run_sync(fn, *args)


# --- authentication -------------------------------------------------------------------


async def test_authorized_consumer_exchanges_frames():
    handler = Recorder()
    async with provider(handler) as server:

        def consumer():
            with connect(server) as ch:
                assert ch.peer_public_key == PROVIDER.public_key
                for parts in ([b"hello"], [b"", b"!"], [b"a" * 10, os.urandom(2_000_000)]):
                    ch.send_frame(parts)
                    assert ch.recv_frame() == b"".join(parts)

        await in_thread(consumer)
    assert len(handler.frames) == 3


async def test_an_empty_frame_is_a_keepalive_the_consumer_never_sees():
    async def keeps_alive_then_answers(channel) -> None:
        await channel.receive_frame()
        await channel.send_frame([])
        await channel.send_frame([b"", b""])
        await channel.send_frame([b"answer"])
        await channel.receive_frame()

    async with provider(keeps_alive_then_answers) as server:

        def consumer():
            with connect(server) as ch:
                ch.send_frame([b"request"])
                return bytes(ch.recv_frame())

        assert await in_thread(consumer) == b"answer"


async def test_consumer_with_wrong_identity_is_rejected():
    seen = []

    def only_consumer(key, lease):
        seen.append(key)
        return None if key == CONSUMER.public_key else "not on this pool's allow list"

    async with provider(Recorder(), authorize=only_consumer) as server:
        with pytest.raises(SessionRefusedError) as info:
            await in_thread(lambda: connect(server, identity=STRANGER))
        assert info.value.reason == "not on this pool's allow list"
        assert seen == [STRANGER.public_key]


class Claiming:
    """Claims one node's public key but can only sign with another's."""

    def __init__(self, claimed: NodeIdentity, actual: NodeIdentity) -> None:
        self.public_key = claimed.public_key
        self.sign = actual.sign


async def test_consumer_claiming_someone_elses_key_is_rejected():
    authorize_calls = []

    def record(key, lease):
        authorize_calls.append(key)

    async with provider(Recorder(), authorize=record) as server:
        with pytest.raises(SessionRefusedError, match="signature does not match"):
            await in_thread(lambda: connect(server, identity=Claiming(CONSUMER, STRANGER)))
        assert server.statistics().handshake_failures == 1
    assert authorize_calls == []


async def test_provider_impostor_is_detected_by_the_consumer():
    async with provider(Recorder(), identity=STRANGER) as server:
        with pytest.raises(PeerAuthenticationError, match="identity mismatch"):
            await in_thread(lambda: connect(server))


async def test_provider_claiming_the_expected_key_without_it_is_detected():
    async with provider(Recorder(), identity=Claiming(PROVIDER, STRANGER)) as server:
        with pytest.raises(PeerAuthenticationError, match="signature is invalid"):
            await in_thread(lambda: connect(server))


async def test_consumer_without_lease_is_refused_with_the_reason():
    def needs_lease(key, lease):
        return None if lease == b"lease-42" else "no active lease for this consumer"

    handler = Recorder()
    async with provider(handler, authorize=needs_lease) as server:
        with pytest.raises(SessionRefusedError) as info:
            await in_thread(lambda: connect(server))
        assert info.value.reason == "no active lease for this consumer"

        def with_lease():
            with connect(server, lease=b"lease-42") as ch:
                ch.send_frame([b"ok"])
                return ch.recv_frame()

        assert await in_thread(with_lease) == b"ok"
        assert server.statistics().refusals == 1


# --- resumption -----------------------------------------------------------------------


async def test_forced_disconnect_mid_stream_resumes_with_every_frame_once_in_order():
    handler = Recorder()
    sent = [os.urandom(n) for n in (10, 300_000, 5, 1_500_000, 1, 70_000) * 5]

    async with provider(handler, grace_period=10) as server:

        def consumer():
            with connect(server, max_record=64 * 1024) as ch:
                real_send = ch._link.sendmsg_all
                calls = 0

                def send_then_die(chunks):
                    nonlocal calls
                    calls += 1
                    # Kill the TCP socket under the channel in the middle of a frame
                    # (record 30 of 80), with echoes still in flight.
                    if calls == 30:
                        ch._link.sock.shutdown(socket.SHUT_RDWR)
                    real_send(chunks)

                ch._link.sendmsg_all = send_then_die
                received = []
                for i, frame in enumerate(sent):
                    ch.send_frame([frame])
                    if i % 3 == 2:  # keep a few frames in flight, unacknowledged
                        received += [ch.recv_frame() for _ in range(3)]
                assert ch.resumes == 1
                return received

        received = await in_thread(consumer)
    assert received == sent
    assert handler.frames == sent
    assert handler.sessions == 1
    assert server.statistics().resumes == 1


async def test_repeated_disconnects_on_both_directions_lose_nothing():
    handler = Recorder()
    async with provider(handler, grace_period=10) as server:

        def consumer():
            with connect(server, max_record=16 * 1024) as ch:
                out = []
                for i in range(20):
                    frame = struct.pack(">I", i) * 20_000
                    ch.send_frame([frame])
                    if i % 4 == 1:
                        ch._link.sock.shutdown(socket.SHUT_RDWR)
                    out.append(ch.recv_frame() == frame)
                return out, ch.resumes

        out, resumes = await in_thread(consumer)
    assert all(out) and len(out) == 20
    assert resumes == 5
    assert handler.sessions == 1


@pytest.mark.parametrize("attack", ["tamper", "replay"])
async def test_tampered_or_replayed_record_is_dropped_and_the_consumer_resumes(attack, caplog):
    """The provider opens records in the handler's task: a record changed or replayed on
    the wire fails authentication there, the connection is dropped, and the consumer's
    resume delivers the genuine record, so the handler sees every frame exactly once."""
    handler = Recorder()
    sent = [os.urandom(n) for n in (100, 20_000, 7)]
    async with provider(handler, grace_period=10) as server:

        def consumer():
            with connect(server) as ch:
                real_send = ch._link.sendmsg_all
                calls = itertools.count()

                def attacker(chunks):
                    header, ct = chunks
                    if next(calls) == 1:  # the second frame's record
                        if attack == "tamper":
                            forged = bytearray(ct)
                            forged[5] ^= 0x40
                            real_send([header, forged])
                            return
                        real_send(chunks)  # the genuine record, then a replay
                    real_send(chunks)

                ch._link.sendmsg_all = attacker
                out = []
                for frame in sent:
                    ch.send_frame([frame])
                    out.append(bytes(ch.recv_frame()))
                return out, ch.resumes

        out, resumes = await in_thread(consumer)
    assert out == sent
    assert handler.frames == sent
    assert resumes == 1
    assert "failed authentication" in caplog.text


async def test_session_idle_past_grace_period_is_cleaned_up():
    handler = Recorder()
    async with provider(handler, grace_period=0.2) as server:

        def consumer():
            ch = connect(server)
            ch.send_frame([b"work"])
            ch.recv_frame()
            ch._link.sock.shutdown(socket.SHUT_RDWR)  # the consumer vanishes
            return ch

        ch = await in_thread(consumer)
        with trio.fail_after(5):
            await handler.done.wait()
        assert isinstance(handler.ended, SessionClosedError)
        assert "did not resume" in str(handler.ended)
        await trio.sleep(0)
        stats = server.statistics()
        assert (stats.sessions_active, stats.sessions_expired) == (0, 1)

        # A late resume is refused: the consumer learns its session is gone, and why.
        with pytest.raises(SessionClosedError, match="session ended: .* did not resume within"):
            await in_thread(ch.recv_frame)


def closing_after_one_frame(reason: str):
    """A session handler that reads one frame, then ends the session with ``reason``."""

    async def handler(channel):
        await channel.receive_frame()
        await channel.aclose(reason)

    return handler


async def test_a_consumer_that_lost_the_close_learns_why_when_it_resumes():
    handler = closing_after_one_frame("leaving: the host is shutting down")
    async with provider(handler, grace_period=60) as server:

        def consumer():
            ch = connect(server)
            ch.send_frame([b"work"])
            ch._link.sock.shutdown(socket.SHUT_RDWR)  # the CLOSE record is lost with it
            ch.recv_frame()

        with pytest.raises(SessionClosedError, match="leaving: the host is shutting down"):
            await in_thread(consumer)


async def test_why_a_session_ended_is_told_only_to_a_resume_that_proves_it_is_its_own():
    async with provider(closing_after_one_frame("a private reason"), grace_period=60) as server:

        def consumer():
            ch = connect(server)
            ch.send_frame([b"work"])
            with pytest.raises(SessionClosedError, match="a private reason"):
                ch.recv_frame()
            return ch.session_id

        session_id = await in_thread(consumer)
        forged = hs.ClientResume(session_id, os.urandom(32), 0)
        stream = await trio.open_tcp_stream("127.0.0.1", server.port)
        async with stream:
            await stream.send_all(forged.hello())
            reply = await stream.receive_some()
        assert b"private" not in reply
        with pytest.raises(PeerAuthenticationError):
            forged.on_challenge(reply[2:])


async def test_consumer_close_ends_the_handler_session_at_once():
    handler = Recorder()
    async with provider(handler, grace_period=60) as server:
        await in_thread(lambda: connect(server).close())
        with trio.fail_after(5):
            await handler.done.wait()
        assert "consumer closed" in str(handler.ended)


async def test_provider_ending_the_session_reaches_the_consumer():
    async def one_reply(channel):
        await channel.send_frame([await channel.receive_frame()])

    async with provider(one_reply) as server:

        def consumer():
            with connect(server) as ch:
                ch.send_frame([b"q"])
                assert ch.recv_frame() == b"q"
                with pytest.raises(SessionClosedError, match="provider closed"):
                    ch.recv_frame()

        await in_thread(consumer)


async def test_a_provider_closing_mid_frame_closes_after_the_frame():
    """A close (a lease paused) waits for the frame being sent: a ``CLOSE`` record
    between a frame's records would break the consumer's stream (RemoteProtocolError)."""
    big = os.urandom(600_000)

    async def pause_mid_frame(channel):
        await channel.receive_frame()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(channel.send_frame, [big])
            await trio.sleep(0.2)  # the frame waits for acknowledgements halfway
            await channel.aclose("lease paused")

    async with provider(pause_mid_frame, max_record=16 * 1024, max_unacked=64 * 1024) as server:

        def consumer():
            with connect(server) as ch:
                ch.send_frame([b"go"])
                time.sleep(0.5)  # reads nothing, so acknowledges nothing, for a while
                # The frame, then the close; or, when the frame cannot finish within the
                # close's second, the close's reason on resuming. Never a protocol error.
                with pytest.raises(SessionClosedError, match="lease paused"):
                    while True:
                        assert bytes(ch.recv_frame()) == big

        await in_thread(consumer)


# --- the provider's reader: handler cancellation, concurrent tasks, acknowledgements ---


async def test_handler_timing_out_on_receive_loses_no_frame():
    """The handler's own task reads the socket: a cancelled ``receive_frame`` (here a
    timeout that often fires mid-frame, between records) must lose and tear nothing."""
    seen: list[bytes] = []

    async def impatient(channel) -> None:
        patience = itertools.cycle([0, 0.0001, 0.001, 0.01])
        try:
            while True:
                frame = None
                with trio.move_on_after(next(patience)):
                    frame = await channel.receive_frame()
                if frame is not None:
                    seen.append(bytes(frame))
                    await channel.send_frame([frame])
        except SessionClosedError:
            pass

    sent = [os.urandom(n) for n in (10, 90_000, 5, 40_000, 1, 200_000, 3) * 6]
    async with provider(impatient) as server:

        def consumer():
            with connect(server, max_record=8 * 1024) as ch:
                real_send = ch._link.sendmsg_all
                calls = itertools.count()

                def dawdle_between_records(chunks):
                    if next(calls) % 4 == 3:  # the provider waits mid-frame, and times out
                        time.sleep(0.0005)
                    real_send(chunks)

                ch._link.sendmsg_all = dawdle_between_records
                out = []
                for i in range(0, len(sent), 3):
                    batch = sent[i : i + 3]
                    for frame in batch:  # pipelined, so records queue up on the provider
                        ch.send_frame([frame])
                    out += [bytes(ch.recv_frame()) for _ in batch]
                return out, ch.resumes

        out, resumes = await in_thread(consumer)
    assert out == sent
    assert seen == sent
    assert resumes == 0


async def test_sender_short_of_acks_reads_frames_for_a_concurrent_receiver():
    """One handler task sends while another receives. When the sender's retransmit
    buffer is full it reads records itself (for the acks) and queues the frames it
    meets for the receiver; nothing is lost, duplicated or reordered."""
    received: list[bytes] = []

    async def two_tasks(channel) -> None:
        async def receive() -> None:
            await trio.sleep(0.2)  # meanwhile the sender, short of acks, reads for us
            for _ in range(60):
                received.append(bytes(await channel.receive_frame()))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(receive)
            for i in range(120):
                await channel.send_frame([struct.pack(">I", i) * 4_000])

    inbound = [os.urandom(12_000) for _ in range(60)]
    # Room for the 64 records after which the consumer acknowledges, and not much more.
    async with provider(two_tasks, max_unacked=1_100_000) as server:

        def consumer():
            with connect(server) as ch:
                out: list[bytes] = []

                def receive_late() -> None:
                    time.sleep(0.3)  # let the provider's sender run out of room first
                    out.extend(bytes(ch.recv_frame()) for _ in range(120))

                reader = threading.Thread(target=receive_late)
                reader.start()
                for frame in inbound:
                    ch.send_frame([frame])
                reader.join(15)
                return out

        out = await in_thread(consumer)
    assert out == [struct.pack(">I", i) * 4_000 for i in range(120)]
    assert received == inbound


async def test_provider_acknowledges_a_consumer_that_only_sends():
    """A consumer that never receives still gets ``ACK`` records, so its retransmit
    buffer drains and it does not block."""
    count = 0

    async def sink(channel) -> None:
        nonlocal count
        while True:
            frame = await channel.receive_frame()
            if frame == b"done":
                await channel.send_frame([b"%d" % count])
                return
            count += 1

    async with provider(sink) as server:

        def consumer():
            with connect(server, max_unacked=256 * 1024) as ch:
                for _ in range(2_000):
                    ch.send_frame([b"z" * 1_000])
                ch.send_frame([b"done"])
                return ch.recv_frame(), ch._core.buffer.nbytes

        reply, unacked = await in_thread(consumer)
    assert reply == b"2000"
    assert unacked < 256 * 1024


# --- hostile handshakes ---------------------------------------------------------------


async def raw_exchange(port: int, data: bytes, *, half_close: bool = True) -> bytes:
    """Send raw bytes to the provider and return everything it answers."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(data)
        if half_close:
            await stream.send_eof()
        reply = b""
        with trio.fail_after(5):
            while chunk := await stream.receive_some():
                reply += chunk
        return reply


def error_text(reply: bytes) -> str:
    (n,) = struct.unpack(">H", reply[:2])
    assert reply[2] == hs.ERROR
    return reply[3 : 2 + n].decode()


async def works(server) -> None:
    def consumer():
        with connect(server) as ch:
            ch.send_frame([b"still serving"])
            return ch.recv_frame()

    assert await in_thread(consumer) == b"still serving"


async def test_garbage_handshake_gets_a_clear_error_and_server_keeps_serving(caplog):
    async with provider(Recorder()) as server:
        reply = await raw_exchange(server.port, hs.encode_message(b"GET / HTTP/1.1\r\n\r\n"))
        assert "not a cumulus secure-channel client" in error_text(reply)
        await works(server)
    assert "rejected handshake" in caplog.text


async def test_oversized_handshake_is_refused_before_it_is_read_and_server_keeps_serving():
    async with provider(Recorder()) as server:
        reply = await raw_exchange(server.port, b"\xff\xff" + b"A" * 100, half_close=False)
        assert "65535 bytes announced" in error_text(reply)
        await works(server)


async def test_truncated_handshake_is_reported_and_server_keeps_serving(caplog):
    hello = hs.ClientHandshake(CONSUMER.public_key, CONSUMER.sign, PROVIDER.public_key).hello()
    async with provider(Recorder()) as server:
        await raw_exchange(server.port, hello[:20])
        await works(server)
        assert server.statistics().handshake_failures == 1
    assert "connection closed in the middle of the handshake" in caplog.text


async def test_silent_connection_times_out_and_server_keeps_serving():
    async with provider(Recorder(), handshake_timeout=0.3) as server:
        silent = await trio.open_tcp_stream("127.0.0.1", server.port)
        async with silent:
            await works(server)
            reply = b""
            with trio.fail_after(5):
                while chunk := await silent.receive_some():
                    reply += chunk
        assert error_text(reply) == "handshake timed out"


async def test_forged_resume_for_a_live_session_is_refused_and_session_continues():
    handler = Recorder()
    async with provider(handler) as server:
        ch = await in_thread(connect, server)
        try:
            forged = hs.ClientResume(ch.session_id, os.urandom(32), 0)
            stream = await trio.open_tcp_stream("127.0.0.1", server.port)
            async with stream:
                await stream.send_all(forged.hello())
                reply = await stream.receive_some()
                with pytest.raises(PeerAuthenticationError):
                    forged.on_challenge(reply[2:])

            def still_works():
                ch.send_frame([b"mine"])
                return ch.recv_frame()

            assert await in_thread(still_works) == b"mine"
            assert server.statistics().resumes == 0
        finally:
            await in_thread(ch.close)


@pytest.fixture(autouse=True)
def _log_level(caplog):
    caplog.set_level(logging.INFO, logger="cumulus_p2p.channel.secure")
