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

- there is no reader task: ``receive_frame`` reads and opens records itself, in the
  handler's task. A frame therefore costs one wake-up (the socket's), not two (socket,
  then a hand-over between tasks), which is most of the round trip on loopback. Only one
  task reads at a time (the *reader*); another task that needs records waits for the
  reader's progress instead;
- ``send_frame`` seals and writes records under ``_wire`` (one record at a time, so an
  ``ACK`` can slip in between) and ``_frames`` (one frame at a time). A sender whose
  retransmit buffer is full becomes the reader until acknowledgements arrive, queueing
  any frame it reads for ``receive_frame``;
- acknowledgements ride on every outgoing record; when one is due and nobody is
  sending, the reader writes an ``ACK`` record at once (the consumer then frees its
  retransmit buffer before it allocates the next large frame). Cancelling the reader
  loses nothing: a record is consumed only once it is whole, a finished frame is queued
  before the ``ACK`` is written, and an ``ACK`` cut short drops the connection, so the
  consumer resumes and gets it whole;
- while no connection is attached, sealed records only go to the retransmit buffer; the
  resume sends them.

The session task runs the handler and owns the connections: it closes detached ones and,
when none is attached, waits ``grace_period`` for a resume. If none comes, the session
ends: ``receive_frame``/``send_frame`` raise ``SessionClosedError`` and the executor
releases the session's memory. A dropped connection is noticed by the next read or write
(a handler waiting in ``receive_frame`` notices at once).
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Protocol

import trio

from ..._errors import (
    HandshakeError,
    LocalProtocolError,
    RemoteProtocolError,
    SessionClosedError,
)
from ..transport import DEFAULT_MAX_FRAME, Buffer, Handover, HandoverError
from . import handshake as hs
from ._io import CONNECTION_LOST, StreamReader, StreamWriter
from .record import DEFAULT_MAX_RECORD, DEFAULT_REKEY_BYTES, HEADER_SIZE
from .resume import DEFAULT_MAX_UNACKED, Closed, Record, SessionCore

log = logging.getLogger("cumulus_p2p.channel.secure")

Authorize = Callable[[bytes, bytes | None], str | None]
Handler = Callable[["SecureServerChannel"], Awaitable[None]]
#: Told when a session ends, and why (``SecureServer``'s ``on_end``).
OnEnd = Callable[[bytes, str], None]


class Successor(Protocol):
    """Whoever continues a session this server handed over (``SecureServerChannel.hand_over``).

    The server still answers for the session: consumers resume it here, and the provider
    closes it here. It passes both on.
    """

    #: Why the session ended where it went, once it has.
    ended: str | None

    async def resume(self, stream: trio.abc.Stream, hello: bytes, buffered: bytes) -> str | None:
        """Take a connection that asks to resume the session (its ``RESUME_HELLO`` read,
        ``buffered`` the bytes read after it). None: the stream is the successor's now.
        A reason: the session is gone there, and the stream is still the caller's."""

    async def close(self, reason: str) -> None:
        """End the session where it went; its consumer sees ``reason``."""

#: Frames read but not taken by the handler, in bytes, above which a sender waiting for
#: acknowledgements stops reading (TCP backpressure then reaches the consumer).
_MAX_INBOUND_BYTES = 64 * 1024 * 1024
#: Ended sessions whose reason a late resume can still learn (oldest forgotten first).
ENDED_REMEMBERED = 256


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
        """Wait for the next frame (reading the connection in the caller's task).

        Cancelling it (a timeout, say) loses nothing: the frame comes with the next call.

        Raises:
            SessionClosedError: the consumer closed the session, or did not resume within
                the grace period.
        """
        return await self._session.receive_frame()

    def hand_over(self, successor: Successor) -> Handover:
        """Stop serving the session in this process: the returned ``Handover`` carries its
        connection, the bytes read from it and the session's keys and counters, for
        another process to continue it (``SecureServer.adopt``). Resumes and closes that
        reach this server afterwards go to ``successor``.

        Raises:
            HandoverError: the session is mid-frame, busy or not connected.
        """
        return self._session.hand_over(successor)

    async def aclose(self, reason: str = "session closed by the provider") -> None:
        """End the session; the consumer sees ``SessionClosedError`` with ``reason`` at
        once, not after a resume timeout. Idempotent."""
        await self._session.finish(reason)


class _Signal:
    """Wakes every task waiting for "something changed"; costs nothing when none waits.

    A ``trio.Event`` per change would be allocated and set for every record even though
    someone waits only now and then (a sender short of acknowledgements, a second reader).
    """

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event: trio.Event | None = None

    async def wait(self) -> None:
        if self._event is None:
            self._event = trio.Event()
        await self._event.wait()

    def fire(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = None


class _Mutex:
    """A lock between the tasks of one session, cheap enough for every record.

    Like ``trio.Lock`` (first come, first served: ``release`` hands the lock to the
    longest waiter) but without owner bookkeeping, and taking a free lock does not pass
    through the scheduler; the write that follows is the checkpoint. On the round-trip
    path ``trio.Lock`` cost about 2 µs per frame.
    """

    __slots__ = ("locked", "_lot")

    def __init__(self) -> None:
        self.locked = False
        self._lot = trio.lowlevel.ParkingLot()

    async def acquire(self) -> None:
        if self.locked:
            await self._lot.park()  # woken by release, which hands the lock over
        else:
            self.locked = True

    def release(self) -> None:
        if len(self._lot):
            self._lot.unpark()
        else:
            self.locked = False

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc_info: object) -> None:
        self.release()


class _Connection:
    """One byte stream attached to a session."""

    __slots__ = ("reader", "writer", "retired")

    def __init__(self, reader: StreamReader, writer: StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        #: Detached from its session (lost, replaced or the session ended).
        self.retired = False


class _Session:
    def __init__(
        self,
        server: SecureServer,
        *,
        session_id: bytes,
        peer_public_key: bytes,
        resume_secret: bytes,
        core: SessionCore,
        handler: Handler,
    ) -> None:
        self.server = server
        self.handler = handler
        self.max_frame = core.max_frame
        self.session_id = session_id
        self.peer_public_key = peer_public_key
        self.resume_secret = resume_secret
        self.core = core
        #: Where the session went, once handed over (then this is its placeholder).
        self.successor: Successor | None = None
        self.channel = SecureServerChannel(self)
        self.ended: str | None = None
        self.resume_lock = trio.Lock()
        self._wire = _Mutex()
        self._frames = _Mutex()
        self._conn: _Connection | None = None
        self._retired: list[_Connection] = []
        # Connection attached, detached, or session ended: the session task watches this.
        self._conn_changed = _Signal()
        # A record was read, a frame taken, or the connection changed: tasks waiting for
        # the reader (or for a connection to read from) watch this.
        self._progress = _Signal()
        self._reading = False
        self._inbox: deque[bytearray] = deque()
        self._inbox_bytes = 0

    @classmethod
    def new(cls, server: SecureServer, keys: hs.SessionKeys) -> _Session:
        """A session a handshake here just opened."""
        core = SessionCore(
            keys.send_key, keys.recv_key, max_frame=server.max_frame,
            max_record=server.max_record, rekey_bytes=server.rekey_bytes,
            max_unacked=server.max_unacked,
        )  # fmt: skip
        return cls(
            server, session_id=keys.session_id, peer_public_key=keys.peer_public_key,
            resume_secret=keys.resume_secret, core=core, handler=server.handler,
        )  # fmt: skip

    @classmethod
    def continued(cls, server: SecureServer, state: dict, handler: Handler) -> _Session:
        """A session another process handed over (``hand_over``'s ``state``).

        Raises:
            ValueError: ``state`` is not a handed-over session's.
        """
        settings = state["settings"]
        limits = {k: settings[k] for k in ("max_frame", "max_record", "rekey_bytes", "max_unacked")}
        core = SessionCore.continued(state["core"], **limits)
        session = cls(
            server, session_id=state["session_id"], peer_public_key=state["peer"],
            resume_secret=state["resume_secret"], core=core, handler=handler,
        )  # fmt: skip
        for frame in state["inbox"]:
            session._queue(bytearray(frame))
        return session

    def hand_over(self, successor: Successor) -> Handover:
        """See ``SecureServerChannel.hand_over``."""
        conn = self._conn
        if conn is None or self.ended is not None or self.successor is not None:
            raise HandoverError("the session has no connection to hand over")
        if self._reading or self._wire.locked or self._frames.locked:
            raise HandoverError("the session is reading or sending")
        try:
            core = self.core.export()
        except LocalProtocolError as exc:
            raise HandoverError(str(exc)) from exc
        server = self.server
        state = {
            "session_id": self.session_id, "peer": self.peer_public_key,
            "resume_secret": self.resume_secret, "core": core,
            "inbox": [bytes(frame) for frame in self._inbox],
            "settings": {
                "max_frame": server.max_frame, "max_record": server.max_record,
                "rekey_bytes": server.rekey_bytes, "max_unacked": server.max_unacked,
                "grace_period": server.grace_period,
                "handshake_timeout": server.handshake_timeout,
            },
        }  # fmt: skip
        self._inbox.clear()
        self._inbox_bytes = 0
        self.successor = successor
        conn.retired = True  # not ours to close any more
        self._conn = None
        self._conn_changed.fire()
        self._progress.fire()
        return Handover(conn.reader.stream, conn.reader.buffered(), secure=state)

    # --- lifecycle --------------------------------------------------------------------

    async def run(self, conn: _Connection) -> None:
        """The session task: the handler, plus the connections' upkeep."""
        self._conn = conn
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._run_handler)
                await self._watch_connections()
        finally:
            self.server._sessions.pop(self.session_id, None)
            self.server._remember_end(self.session_id, self.ended or "ended", self.resume_secret)
            if self.server.on_end is not None:
                self.server.on_end(self.session_id, self.ended or "ended")
            # Also when cancelled (the server is closing): no stream is left open.
            if self._conn is not None:
                self._detach(self._conn)
            with trio.CancelScope(shield=True):
                await self._close_retired()

    async def _run_handler(self) -> None:
        try:
            await self.handler(self.channel)
        except SessionClosedError:
            pass
        except Exception:
            # One session's failure must not take the server (and everyone else) down.
            log.exception("session handler for %s failed", self.session_id.hex())
        finally:
            with trio.CancelScope(shield=True):
                await self.finish("session ended by the provider")

    async def _watch_connections(self) -> None:
        """Close detached connections; end the session when a resume does not come."""
        grace = self.server.grace_period
        while True:
            await self._close_retired()
            if self.ended is not None:
                return
            if self._conn is not None or self.successor is not None:
                await self._conn_changed.wait()  # (a handed-over session waits for its end)
                continue
            with trio.move_on_after(grace) as timer:
                await self._conn_changed.wait()  # only an attach or the end fires it now
            if timer.cancelled_caught and self._conn is None and self.ended is None:
                self.server._expired += 1
                log.info(
                    "session %s expired: no resume within %.1f s", self.session_id.hex(), grace
                )
                self._end(f"session expired: the consumer did not resume within {grace:g} s")

    async def _close_retired(self) -> None:
        while self._retired:
            conn = self._retired.pop()
            await trio.aclose_forcefully(conn.reader.stream)

    async def finish(self, reason: str) -> None:
        """End the session in order: a ``CLOSE`` record (best effort), then teardown."""
        if self.ended is not None:
            return
        if self.successor is not None:
            if self.successor.ended is None:
                await self.successor.close(reason)
            self._end(self.successor.ended or reason)
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
        if self._conn is not None:
            self._detach(self._conn)
        self._conn_changed.fire()
        self._progress.fire()

    # --- connections ------------------------------------------------------------------

    def _detach(self, conn: _Connection) -> None:
        """Stop using ``conn`` now (lost, replaced, or the session ended).

        Its reads and writes in progress fail at once; the session task closes it.
        """
        if conn.retired:
            return
        conn.retired = True
        conn.reader.interrupt()
        self._retired.append(conn)
        if self._conn is conn:
            self._conn = None
        self._conn_changed.fire()
        self._progress.fire()

    def take_over(self) -> None:
        """Detach the current connection: a resume is replacing it."""
        if self._conn is not None:
            self._detach(self._conn)

    def attach(self, conn: _Connection) -> None:
        self._conn = conn
        self._conn_changed.fire()
        self._progress.fire()

    async def _transmit(self, record: Record) -> None:
        """Write one sealed record if connected; a failure just detaches (it is buffered)."""
        conn = self._conn
        if conn is None:
            return
        try:
            await conn.writer.send(*record)
        except CONNECTION_LOST as exc:
            if not conn.retired:
                log.info("session %s: send failed, awaiting resume: %r", self.session_id.hex(), exc)
            self._detach(conn)

    # --- reading ----------------------------------------------------------------------

    async def _read_record(self, conn: _Connection) -> bytearray | None:
        """Read and open one record as the session's reader; return a finished frame.

        A lost or corrupt connection is detached (the consumer resumes on a new one).
        Cancellation loses nothing: bytes are only consumed once the whole record is
        buffered, nothing awaits between that and opening it, and a frame is queued
        before an acknowledgement is written.
        """
        core = self.core
        reader = conn.reader
        self._reading = True
        try:
            n = core.receive_header(await reader.peek(HEADER_SIZE))
            record = await reader.peek(HEADER_SIZE + n)
            reader.consume(HEADER_SIZE + n)
            event = core.receive_body(record[:HEADER_SIZE], record[HEADER_SIZE:])
        except CONNECTION_LOST as exc:
            core.abort_partial_read()
            if not conn.retired:
                log.info("session %s lost its connection: %r", self.session_id.hex(), exc)
            self._detach(conn)
            return None
        except RemoteProtocolError as exc:
            core.abort_partial_read()
            # Dropping the connection (not the session) lets an honest consumer whose
            # bytes were damaged in transit resume and resend.
            log.warning("session %s: dropping connection: %s", self.session_id.hex(), exc)
            self._detach(conn)
            return None
        except BaseException:
            core.abort_partial_read()
            raise
        finally:
            self._reading = False
            self._progress.fire()
        frame = None
        if type(event) is bytearray:
            frame = event
        elif type(event) is Closed:
            self._end(f"consumer closed the session: {event.reason}")
        if core.ack_due and not self._wire.locked:
            # (A sender holding the wire carries the ack on its next record instead.)
            if frame is not None:
                self._queue(frame)  # kept safe across the write below
                frame = None
            await self._acknowledge()
        return frame

    async def _acknowledge(self) -> None:
        """Send an ``ACK`` record now, so the consumer can free its retransmit buffer.

        Sent at once rather than left for the next reply: a consumer streaming large
        frames then reuses that memory instead of allocating more.
        """
        conn = self._conn
        if conn is None or self.ended is not None:
            return  # a resume tells the consumer what we hold
        await self._wire.acquire()  # free (the caller checked): returns at once
        try:
            await self._transmit(self.core.seal_ack())
        except BaseException:
            # Cancelled mid-write: the stream may hold part of the record. Dropping the
            # connection makes the consumer resume and get the record whole.
            self._detach(conn)
            raise
        finally:
            self._wire.release()

    # --- the channel ------------------------------------------------------------------

    async def receive_frame(self) -> bytearray:
        checkpointed = False
        while not self._inbox:
            if self.ended is not None:
                raise SessionClosedError(self.ended)
            conn = self._conn
            if self._reading or conn is None:
                if self.successor is not None:
                    raise SessionClosedError("the session continues in another process")
                await self._progress.wait()  # another task reads, or no connection yet
                checkpointed = True
                continue
            reads = conn.reader.reads
            frame = await self._read_record(conn)
            # Every read from the stream is a checkpoint; a frame that was already
            # buffered must pass one below, so it waits in the inbox meanwhile.
            checkpointed = checkpointed or conn.reader.reads != reads
            if frame is not None:
                if checkpointed:
                    return frame
                self._queue(frame)
        if not checkpointed:
            await trio.lowlevel.checkpoint()
        frame = self._inbox.popleft()
        self._inbox_bytes -= len(frame)
        self._progress.fire()  # a sender may be waiting for room in the inbox
        return frame

    def _queue(self, frame: bytearray) -> None:
        self._inbox.append(frame)
        self._inbox_bytes += len(frame)

    async def send_frame(self, parts: Sequence[Buffer]) -> None:
        if self.ended is not None or self.successor is not None:
            raise SessionClosedError(self.ended or "the session continues in another process")
        if not (self._frames.locked or self._wire.locked or self.core.must_wait):
            # Nobody else is sending: a frame that fits in one record is sealed and
            # written in one go. Sealing and taking the wire happen without an await in
            # between, so records still leave in the order they were sealed.
            record = self.core.seal_single(parts)
            if record is not None:
                await self._send_single(record)
                return
        await self._frames.acquire()
        try:
            records = self.core.seal_frame(parts)
            started = False
            try:
                while True:
                    if self.core.must_wait:
                        await self._wait_for_acks()
                    if self.ended is not None:
                        raise SessionClosedError(self.ended)
                    await self._wire.acquire()
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

    async def _send_single(self, record: Record) -> None:
        await self._wire.acquire()  # free (the caller checked): returns at once
        try:
            await self._transmit(record)
        except BaseException:
            # Maybe part of the record left: the stream cannot continue.
            self._end("a frame was abandoned halfway (sender cancelled)")
            raise
        finally:
            self._wire.release()

    async def _wait_for_acks(self) -> None:
        """Read records until the peer has acknowledged enough of the retransmit buffer.

        Frames read meanwhile wait in the inbox for ``receive_frame``.
        """
        while self.core.must_wait:
            if self.ended is not None:
                raise SessionClosedError(self.ended)
            conn = self._conn
            if self._reading or conn is None or self._inbox_bytes > _MAX_INBOUND_BYTES:
                # Another task reads, no connection yet, or the handler must take
                # frames first (TCP backpressure then reaches the consumer).
                await self._progress.wait()
                continue
            frame = await self._read_record(conn)
            if frame is not None:
                self._queue(frame)


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
        on_end: OnEnd | None = None,
    ) -> None:
        self.identity = identity
        self.authorize = authorize
        self.handler = handler
        self.on_end = on_end
        self.grace_period = grace_period
        self.handshake_timeout = handshake_timeout
        self.max_frame = max_frame
        self.max_record = max_record
        self.rekey_bytes = rekey_bytes
        self.max_unacked = max_unacked
        self.port: int | None = None
        self._nursery = nursery
        self._sessions: dict[bytes, _Session] = {}
        #: Sessions that ended lately: why, and the secret a resume must prove. A consumer
        #: whose connection broke as the provider closed its session (the ``CLOSE`` record
        #: lost with the connection) learns why when it tries to resume.
        self._ended: OrderedDict[bytes, tuple[str, bytes]] = OrderedDict()
        self._started = 0
        self._expired = 0
        self._resumes = 0
        self._handshake_failures = 0
        self._refusals = 0

    @classmethod
    def for_adopted(
        cls, nursery: trio.Nursery, settings: dict, on_end: OnEnd | None = None
    ) -> SecureServer:
        """A server that only continues sessions handed over to this process (``adopt``,
        ``take_resume``), with the handing server's ``settings``. It holds no identity,
        so it runs no new-session handshake."""
        return cls(
            None, authorize=_no_new_sessions, handler=_no_handler, nursery=nursery,
            on_end=on_end, **settings,
        )  # fmt: skip

    def adopt(self, handover: Handover, handler: Handler) -> SecureServerChannel:
        """Continue a session another process handed over, running ``handler`` on it.

        Raises:
            ValueError: the handover is not a secure session's.
        """
        if handover.secure is None:
            raise ValueError("a plain channel's handover has no session to adopt")
        session = _Session.continued(self, handover.secure, handler)
        reader = StreamReader(handover.stream, self.max_record, buffered=handover.buffered)
        self._sessions[session.session_id] = session
        self._started += 1
        self._nursery.start_soon(session.run, _Connection(reader, StreamWriter(handover.stream)))
        return session.channel

    async def take_resume(self, stream: trio.abc.Stream, hello: bytes, buffered: bytes) -> None:
        """Finish a resume that another process began on ``stream``: it read the
        ``RESUME_HELLO`` ``hello`` (and ``buffered`` after it) for a session it handed
        here. Never raises for peer misbehaviour (see ``handle_stream``)."""

        async def finish(reader: StreamReader, writer: StreamWriter) -> bool:
            return await self._resume(hs.ResumeHello.parse(hello), reader, writer)

        await self._guarded(stream, buffered, finish)

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
        await self._guarded(stream, b"", self._handshake)

    async def _guarded(self, stream: trio.abc.Stream, buffered: bytes, step) -> None:
        """Run ``await step(reader, writer)`` on ``stream`` under the handshake timeout;
        close the stream unless it returned True (the stream went to a session)."""
        reader = StreamReader(stream, self.max_record, buffered=buffered)
        writer = StreamWriter(stream)
        handed_over = False
        try:
            with trio.fail_after(self.handshake_timeout):
                handed_over = await step(reader, writer)
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
        if self.identity is None:
            raise HandshakeError("this process only continues sessions handed over to it")
        shake = hs.ServerHandshake(self.identity.public_key, self.identity.sign)
        reply = shake.on_hello(await reader.read_handshake())
        if reply is None:
            if shake.resume_request is None:  # pragma: no cover - None means a resume
                raise HandshakeError("resume without a request")
            return await self._resume(shake.resume_request, reader, writer)
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
        session = _Session.new(self, keys)
        self._sessions[keys.session_id] = session
        self._started += 1
        self._nursery.start_soon(session.run, _Connection(reader, writer))
        return True

    async def _resume(
        self, request: hs.ResumeHello, reader: StreamReader, writer: StreamWriter
    ) -> bool:
        session = self._sessions.get(request.session_id)
        ended = self._ended.get(request.session_id)
        if session is not None and session.ended is None and session.successor is not None:
            why = await session.successor.resume(reader.stream, request.raw, reader.buffered())
            if why is None:
                return True  # the connection went where the session is
            ended = (why, session.resume_secret)
        elif session is not None and session.ended is not None:
            ended = (session.ended, session.resume_secret)
        if ended is not None:
            return await self._refuse_ended(request, *ended, reader, writer)
        if session is None:
            await writer.send(hs.error_message("unknown or expired session"))
            return False
        resume = hs.ServerResume(request, session.resume_secret)
        await writer.send(resume.challenge())
        resume.on_proof(await reader.read_handshake())
        async with session.resume_lock:
            session.take_over()
            async with session._wire:
                if session.ended is not None:
                    await writer.send(hs.error_message(f"session ended: {session.ended}"))
                    return False
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


    async def _refuse_ended(
        self, request, reason: str, secret: bytes, reader: StreamReader, writer: StreamWriter
    ) -> bool:
        """Tell a consumer that proves the session was its own why the session ended."""
        resume = hs.ServerResume(request, secret)
        await writer.send(resume.challenge())
        resume.on_proof(await reader.read_handshake())
        await writer.send(hs.error_message(f"session ended: {reason}"))
        return False

    def _remember_end(self, session_id: bytes, reason: str, secret: bytes) -> None:
        self._ended[session_id] = (reason, secret)
        while len(self._ended) > ENDED_REMEMBERED:
            self._ended.popitem(last=False)


def _no_new_sessions(consumer: bytes, lease: bytes | None) -> str:
    return "this process only continues sessions handed over to it"


async def _no_handler(channel: SecureServerChannel) -> None:
    raise LocalProtocolError("a handed-over session runs the handler it was adopted with")


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
