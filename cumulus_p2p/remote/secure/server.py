"""Trio shell of the secure channel on the provider: handshakes, sessions, resumption.

Theory of operation
-------------------
``SecureServer.handle_stream`` takes one incoming byte stream (TCP, or a libp2p stream
adapted by ``libp2p_path``) and runs the handshake under a timeout. A new session gets a
``_Session`` whose task lives in the server's nursery, not the connection's: it runs the
handler once, with one ``SecureServerChannel``, for the whole logical session. A resumed
connection is authenticated, then handed to the existing session, which swaps its
connection under the handler's feet.

Per session:

- the *read loop* (inside the session task) opens records, queues whole frames for the
  handler and applies acknowledgements;
- ``send_frame`` seals and writes records under ``_wire`` (one record at a time, so the
  read loop can slip an ``ACK`` in between) and ``_frames`` (one frame at a time);
- while no connection is attached, sealed records only go to the retransmit buffer; the
  resume sends them.

When the connection drops, the session waits ``grace_period`` for a resume. If none comes,
the session ends: ``receive_frame``/``send_frame`` raise ``SessionClosedError`` and the
executor releases the session's memory.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio

from ..._errors import (
    HandshakeError,
    RemoteProtocolError,
    SessionClosedError,
)
from ..transport import DEFAULT_MAX_FRAME, Buffer
from . import handshake as hs
from ._io import CONNECTION_LOST, StreamReader, StreamWriter
from .record import DEFAULT_MAX_RECORD, DEFAULT_REKEY_BYTES, HEADER_SIZE
from .resume import DEFAULT_MAX_UNACKED, Closed, Record, SessionCore

log = logging.getLogger("cumulus_p2p.remote.secure")

Authorize = Callable[[bytes, bytes | None], str | None]
Handler = Callable[["SecureServerChannel"], Awaitable[None]]

#: Frames the handler has not taken yet, in bytes, before the read loop stops reading
#: (TCP backpressure then reaches the consumer).
_MAX_INBOUND_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class ServerStatistics:
    """Counters for monitoring and tests."""

    sessions_active: int
    sessions_started: int
    sessions_expired: int
    resumes: int
    handshake_failures: int
    refusals: int


class SecureServerChannel:
    """The ``AsyncFrameChannel`` a handler gets: one per logical session.

    It survives connection drops: frames sent while disconnected are delivered after the
    consumer resumes. ``peer_public_key`` is the consumer's authenticated ed25519 key.
    """

    def __init__(self, session: _Session) -> None:
        self._session = session
        self.max_frame = session.max_frame
        self.peer_public_key: bytes = session.peer_public_key
        self.session_id: bytes = session.session_id

    async def send_frame(self, parts: Sequence[Buffer]) -> None:
        """Send one frame made of ``parts`` concatenated.

        Raises:
            SessionClosedError: the session ended (closed, or not resumed in time).
            FrameTooLargeError: the frame exceeds ``max_frame``.
        """
        await self._session.send_frame(parts)

    async def receive_frame(self) -> bytearray:
        """Wait for the next frame.

        Raises:
            SessionClosedError: the consumer closed the session, or did not resume within
                the grace period.
        """
        return await self._session.receive_frame()

    async def aclose(self) -> None:
        """End the session (the consumer sees ``SessionClosedError``). Idempotent."""
        await self._session.finish("session closed by the provider")


class _Connection:
    __slots__ = ("reader", "writer")

    def __init__(self, reader: StreamReader, writer: StreamWriter) -> None:
        self.reader = reader
        self.writer = writer


class _Session:
    def __init__(self, server: SecureServer, keys: hs.SessionKeys) -> None:
        self.server = server
        self.max_frame = server.max_frame
        self.session_id = keys.session_id
        self.peer_public_key = keys.peer_public_key
        self.resume_secret = keys.resume_secret
        self.core = SessionCore(
            keys.send_key,
            keys.recv_key,
            max_frame=server.max_frame,
            max_record=server.max_record,
            rekey_bytes=server.rekey_bytes,
            max_unacked=server.max_unacked,
        )
        self.channel = SecureServerChannel(self)
        self.ended: str | None = None
        self.resume_lock = trio.Lock()
        self._wire = trio.Lock()
        self._frames = trio.Lock()
        self._conn: _Connection | None = None
        self._conn_scope: trio.CancelScope | None = None
        self._attached = trio.Event()
        self._idle = trio.Event()
        self._changed = trio.Event()
        self._inbound_send, self._inbound_recv = trio.open_memory_channel[bytearray](math.inf)
        self._inbound_bytes = 0

    # --- lifecycle --------------------------------------------------------------------

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def run(self, conn: _Connection) -> None:
        """The session task: handler plus read loops across connections."""
        self._conn = conn
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._run_handler)
                while self.ended is None:
                    await self._read_loop()
                    if self.ended is not None:
                        break
                    with trio.move_on_after(self.server.grace_period):
                        await self._attached.wait()
                    if self._conn is None and self.ended is None:
                        self.server._expired += 1
                        log.info(
                            "session %s expired: no resume within %.1f s",
                            self.session_id.hex(),
                            self.server.grace_period,
                        )
                        self._end(
                            f"session expired: the consumer did not resume within "
                            f"{self.server.grace_period:g} s"
                        )
        finally:
            self.server._sessions.pop(self.session_id, None)

    async def _run_handler(self) -> None:
        try:
            await self.server.handler(self.channel)
        except SessionClosedError:
            pass
        except Exception:
            # One session's failure must not take the server (and everyone else) down.
            log.exception("session handler for %s failed", self.session_id.hex())
        finally:
            with trio.CancelScope(shield=True):
                await self.finish("session ended by the provider")

    async def finish(self, reason: str) -> None:
        """End the session in order: a ``CLOSE`` record (best effort), then teardown."""
        if self.ended is not None:
            return
        with trio.move_on_after(1.0):
            async with self._wire:
                record = self.core.seal_close(reason)
                await self._transmit(record)
        self._end(reason)

    def _end(self, reason: str) -> None:
        if self.ended is not None:
            return
        self.ended = reason
        self._inbound_send.close()
        if self._conn_scope is not None:
            self._conn_scope.cancel()
        self._attached.set()
        self._notify()

    # --- connections ------------------------------------------------------------------

    async def _read_loop(self) -> None:
        conn = self._conn
        if conn is None:
            return
        self._idle = trio.Event()
        core = self.core
        reader = conn.reader
        try:
            with trio.CancelScope() as scope:
                self._conn_scope = scope
                if self.ended is not None:
                    scope.cancel()
                while True:
                    while self._inbound_bytes > _MAX_INBOUND_BYTES:
                        await self._changed.wait()
                    header = bytes(await reader.take(HEADER_SIZE))
                    n = core.receive_header(header)
                    event = core.receive_body(header, await reader.take(n))
                    if type(event) is bytearray:
                        self._inbound_bytes += len(event)
                        self._inbound_send.send_nowait(event)
                    elif type(event) is Closed:
                        self._end(f"consumer closed the session: {event.reason}")
                        return
                    self._notify()
                    if core.ack_due and not self._wire.locked():
                        async with self._wire:
                            await self._transmit(core.seal_ack())
        except CONNECTION_LOST as exc:
            log.info("session %s lost its connection: %r", self.session_id.hex(), exc)
        except RemoteProtocolError as exc:
            # Dropping the connection (not the session) lets an honest consumer whose
            # bytes were damaged in transit resume and resend.
            log.warning("session %s: dropping connection: %s", self.session_id.hex(), exc)
        finally:
            core.abort_partial_read()
            self._conn_scope = None
            if self._conn is conn:
                self._conn = None
                self._attached = trio.Event()
            self._idle.set()
            self._notify()
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(conn.reader.stream)

    async def _transmit(self, record: Record) -> None:
        """Write one sealed record if connected; a failure just detaches (it is buffered)."""
        conn = self._conn
        if conn is None:
            return
        try:
            await conn.writer.send(*record)
        except CONNECTION_LOST as exc:
            log.info("session %s: send failed, awaiting resume: %r", self.session_id.hex(), exc)
            if self._conn is conn and self._conn_scope is not None:
                self._conn_scope.cancel()

    async def take_over(self) -> None:
        """Stop the current read loop (a resume is replacing its connection)."""
        if self._conn_scope is not None:
            self._conn_scope.cancel()
        if self._conn is not None or not self._idle.is_set():
            await self._idle.wait()

    def attach(self, conn: _Connection) -> None:
        self._conn = conn
        self._attached.set()
        self._notify()

    # --- the channel ------------------------------------------------------------------

    async def send_frame(self, parts: Sequence[Buffer]) -> None:
        if self.ended is not None:
            raise SessionClosedError(self.ended)
        await _acquire(self._frames)
        try:
            records = self.core.seal_frame(parts)
            started = False
            try:
                while True:
                    while self.core.must_wait:
                        if self.ended is not None:
                            raise SessionClosedError(self.ended)
                        if self.core.ack_due:
                            await _acquire(self._wire)
                            try:
                                await self._transmit(self.core.seal_ack())
                            finally:
                                self._wire.release()
                        await self._changed.wait()
                    if self.ended is not None:
                        raise SessionClosedError(self.ended)
                    await _acquire(self._wire)
                    try:
                        record = next(records, None)
                        if record is None:
                            break
                        started = True
                        await self._transmit(record)
                    finally:
                        self._wire.release()
            except BaseException:
                if started:
                    # The peer has half a frame; the stream cannot continue.
                    self._end("a frame was abandoned halfway (sender cancelled)")
                raise
        finally:
            self._frames.release()

    async def receive_frame(self) -> bytearray:
        try:
            frame = await self._inbound_recv.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise SessionClosedError(self.ended or "session closed") from None
        self._inbound_bytes -= len(frame)
        if self._inbound_bytes <= _MAX_INBOUND_BYTES:
            self._notify()
        return frame


class SecureServer:
    """Accepts secure-channel connections and runs one handler per logical session.

    Build it with ``open_secure_server`` (or ``serve_secure``), which owns the nursery the
    sessions live in. Feed it connections with ``handle_stream``.
    """

    def __init__(
        self,
        identity,  # cumulus_p2p.identity.NodeIdentity (anything with public_key and sign)
        *,
        authorize: Authorize,
        handler: Handler,
        nursery: trio.Nursery,
        grace_period: float = 30.0,
        handshake_timeout: float = 10.0,
        max_frame: int = DEFAULT_MAX_FRAME,
        max_record: int = DEFAULT_MAX_RECORD,
        rekey_bytes: int = DEFAULT_REKEY_BYTES,
        max_unacked: int = DEFAULT_MAX_UNACKED,
    ) -> None:
        self.identity = identity
        self.authorize = authorize
        self.handler = handler
        self.grace_period = grace_period
        self.handshake_timeout = handshake_timeout
        self.max_frame = max_frame
        self.max_record = max_record
        self.rekey_bytes = rekey_bytes
        self.max_unacked = max_unacked
        self.port: int | None = None
        self._nursery = nursery
        self._sessions: dict[bytes, _Session] = {}
        self._started = 0
        self._expired = 0
        self._resumes = 0
        self._handshake_failures = 0
        self._refusals = 0

    def statistics(self) -> ServerStatistics:
        """Current counters."""
        return ServerStatistics(
            sessions_active=len(self._sessions),
            sessions_started=self._started,
            sessions_expired=self._expired,
            resumes=self._resumes,
            handshake_failures=self._handshake_failures,
            refusals=self._refusals,
        )

    async def serve_tcp(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        task_status: trio.TaskStatus[SecureServer] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen on ``host:port`` and serve until cancelled; ``started`` gives ``self``."""
        listeners = await trio.open_tcp_listeners(port, host=host)
        self.port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            for listener in listeners:
                nursery.start_soon(self._accept_loop, listener)
            task_status.started(self)

    async def _accept_loop(self, listener: trio.SocketListener) -> None:
        async with listener:
            while True:
                stream = await listener.accept()
                # Connection tasks live in the server nursery; a session they create is
                # started there too, so it outlives its first connection.
                self._nursery.start_soon(self.handle_stream, stream)

    async def handle_stream(self, stream: trio.abc.Stream) -> None:
        """Run the handshake on one incoming byte stream and hand it to its session.

        Never raises for peer misbehaviour: the error is logged, sent to the peer where
        possible, and the stream is closed.
        """
        reader = StreamReader(stream, self.max_record)
        writer = StreamWriter(stream)
        handed_over = False
        try:
            with trio.fail_after(self.handshake_timeout):
                handed_over = await self._handshake(reader, writer)
        except trio.TooSlowError:
            self._handshake_failures += 1
            log.warning("handshake timed out after %.1f s", self.handshake_timeout)
            await _send_error(writer, "handshake timed out")
        except HandshakeError as exc:
            self._handshake_failures += 1
            log.warning("rejected handshake: %s", exc)
            await _send_error(writer, str(exc))
        except CONNECTION_LOST as exc:
            self._handshake_failures += 1
            log.info("connection lost during handshake: %r", exc)
        finally:
            if not handed_over:
                await trio.aclose_forcefully(stream)

    async def _handshake(self, reader: StreamReader, writer: StreamWriter) -> bool:
        shake = hs.ServerHandshake(self.identity.public_key, self.identity.sign)
        reply = shake.on_hello(await reader.read_handshake())
        if reply is None:
            return await self._resume(shake, reader, writer)
        await writer.send(reply)
        consumer, lease = shake.on_client_auth(await reader.read_handshake())
        try:
            refusal = self.authorize(consumer, lease)
        except Exception:
            log.exception("authorize() failed")
            refusal = "authorization check failed on the provider"
        if refusal is not None:
            self._refusals += 1
            log.info("refused consumer %s: %s", consumer.hex()[:16], refusal)
            await writer.send(shake.refuse(refusal))
            return False
        message, keys = shake.accept(os.urandom(hs.SESSION_ID_SIZE))
        await writer.send(message)
        session = _Session(self, keys)
        self._sessions[keys.session_id] = session
        self._started += 1
        self._nursery.start_soon(session.run, _Connection(reader, writer))
        return True

    async def _resume(
        self, shake: hs.ServerHandshake, reader: StreamReader, writer: StreamWriter
    ) -> bool:
        request = shake.resume_request
        if request is None:  # pragma: no cover - on_hello returned None only for resumes
            raise HandshakeError("resume without a request")
        session = self._sessions.get(request.session_id)
        if session is None or session.ended is not None:
            await writer.send(hs.error_message("unknown or expired session"))
            return False
        resume = hs.ServerResume(request, session.resume_secret)
        await writer.send(resume.challenge())
        resume.on_proof(await reader.read_handshake())
        async with session.resume_lock:
            await session.take_over()
            if session.ended is not None:
                await writer.send(hs.error_message(f"session ended: {session.ended}"))
                return False
            async with session._wire:
                try:
                    resend = session.core.resend_from(request.received)
                except RemoteProtocolError as exc:
                    raise HandshakeError(f"impossible resume point: {exc}") from exc
                await writer.send(resume.resumed(session.core.received))
                session.core.resumed()
                conn = _Connection(reader, writer)
                session.attach(conn)
                for record in resend:
                    await writer.send(*record)
        self._resumes += 1
        log.info("session %s resumed (%d records resent)", session.session_id.hex(), len(resend))
        return True


async def _acquire(lock: trio.Lock) -> None:
    """Take ``lock`` without a scheduling checkpoint when it is free.

    ``async with lock`` always yields to the scheduler (about 5 µs here), twice per
    frame; on the round-trip path that is a noticeable share of the budget. The send
    itself still checkpoints, so cancellation and fairness are unaffected.
    """
    if lock.locked():
        await lock.acquire()
    else:
        lock.acquire_nowait()


async def _send_error(writer: StreamWriter, reason: str) -> None:
    with trio.move_on_after(1.0):
        try:
            await writer.send(hs.error_message(reason))
        except CONNECTION_LOST:
            pass


@asynccontextmanager
async def open_secure_server(
    identity,
    *,
    authorize: Authorize,
    handler: Handler,
    grace_period: float = 30.0,
    handshake_timeout: float = 10.0,
    max_frame: int = DEFAULT_MAX_FRAME,
    max_record: int = DEFAULT_MAX_RECORD,
    rekey_bytes: int = DEFAULT_REKEY_BYTES,
    max_unacked: int = DEFAULT_MAX_UNACKED,
) -> AsyncIterator[SecureServer]:
    """A ``SecureServer`` whose sessions live in a nursery owned by this context.

    Leaving the context cancels every session and connection.
    """
    async with trio.open_nursery() as nursery:
        server = SecureServer(
            identity,
            authorize=authorize,
            handler=handler,
            nursery=nursery,
            grace_period=grace_period,
            handshake_timeout=handshake_timeout,
            max_frame=max_frame,
            max_record=max_record,
            rekey_bytes=rekey_bytes,
            max_unacked=max_unacked,
        )
        try:
            yield server
        finally:
            nursery.cancel_scope.cancel()


async def serve_secure(
    identity,
    *,
    authorize: Authorize,
    handler: Handler,
    host: str = "127.0.0.1",
    port: int = 0,
    grace_period: float = 30.0,
    handshake_timeout: float = 10.0,
    max_frame: int = DEFAULT_MAX_FRAME,
    max_record: int = DEFAULT_MAX_RECORD,
    rekey_bytes: int = DEFAULT_REKEY_BYTES,
    max_unacked: int = DEFAULT_MAX_UNACKED,
    task_status: trio.TaskStatus[SecureServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the secure session channel on TCP until cancelled.

    Args:
        identity: This provider's ``NodeIdentity``.
        authorize: ``authorize(consumer_public_key, lease_token)`` returns ``None`` to
            accept or a refusal reason the consumer will see.
        handler: ``await handler(channel)`` runs once per logical session; resumed
            connections reattach to the same channel.
        host: Address to listen on.
        port: Port to listen on (0 picks a free one; see ``SecureServer.port``).
        grace_period: Seconds a dropped session waits for a resume before it ends.
        handshake_timeout: Seconds a connection may take to finish its handshake.
        max_frame: Largest frame accepted.
        max_record: Largest record plaintext (must match the consumer's).
        rekey_bytes: Ciphertext per key before the implicit rekey (must match).
        max_unacked: Retransmit buffer bound per session.
        task_status: ``started`` receives the ``SecureServer`` once listening.
    """
    async with open_secure_server(
        identity,
        authorize=authorize,
        handler=handler,
        grace_period=grace_period,
        handshake_timeout=handshake_timeout,
        max_frame=max_frame,
        max_record=max_record,
        rekey_bytes=rekey_bytes,
        max_unacked=max_unacked,
    ) as server:
        await server.serve_tcp(host, port, task_status=task_status)
