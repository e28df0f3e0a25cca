"""One secure session on the provider: the channel its handler holds and the state behind it.

Theory of operation
-------------------
A ``ServerSession`` belongs to the server's nursery, not to a connection's: it runs the
handler once, with one ``SecureServerChannel``, for the whole logical session. The
handshake attaches its first connection; each resume detaches the current one and attaches
the new one under the handler's feet (``server`` runs the handshakes).

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
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import trio

from ..._errors import (
    HandshakeError,
    LocalProtocolError,
    RemoteProtocolError,
    SessionClosedError,
)
from ..transport import Buffer, Handover, HandoverError
from . import handshake as hs
from ._io import CONNECTION_LOST, StreamReader, StreamWriter
from ._sync import Mutex, Signal
from .record import HEADER_SIZE
from .resume import Closed, Record, SessionCore
from .settings import SessionSettings

log = logging.getLogger("cumulus_p2p.channel.secure")

#: Runs once per logical session, with the session's channel.
Handler = Callable[["SecureServerChannel"], Awaitable[None]]


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


class SessionOwner(Protocol):
    """The server a session runs in, as the session sees it (``SecureServer``)."""

    @property
    def settings(self) -> SessionSettings:
        """The grace period a session waits for a resume, and what a handover carries."""

    def session_expired(self, session: ServerSession) -> None:
        """``session`` waited its grace period for a resume in vain; it is ending."""

    def session_ended(self, session: ServerSession) -> None:
        """``session`` has ended (``session.ended`` says why, None if it was cancelled)."""


#: Frames read but not taken by the handler, in bytes, above which a sender waiting for
#: acknowledgements stops reading (TCP backpressure then reaches the consumer).
_MAX_INBOUND_BYTES = 64 * 1024 * 1024


class SecureServerChannel:
    """The ``AsyncFrameChannel`` a handler gets: one per logical session.

    It survives connection drops: frames sent while disconnected are delivered after the
    consumer resumes. ``peer_public_key`` is the consumer's authenticated ed25519 key;
    ``lease_token`` the token its handshake presented (None in a process the session was
    handed over to): one consumer may open sessions under several leases at once.
    """

    def __init__(self, session: ServerSession) -> None:
        self._session = session
        self.max_frame = session.max_frame
        self.peer_public_key: bytes = session.peer_public_key
        self.lease_token: bytes | None = session.lease_token
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


class Connection:
    """One byte stream attached to a session."""

    __slots__ = ("reader", "writer", "retired")

    def __init__(self, reader: StreamReader, writer: StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        #: Detached from its session (lost, replaced or the session ended).
        self.retired = False


class ServerSession:
    """One logical secure session on the provider, and the task that runs its handler.

    It holds what outlives any one connection: the ``SessionCore`` (keys, record counters,
    the retransmit buffer), the frames read but not yet taken, the handler's ``channel``,
    and the connection attached now, if any.

    Its life: a handshake opens it (``new``), or another process hands it over
    (``continued``). Its owner starts ``run`` in a nursery of its own, which runs the
    handler once and closes the connections the session lets go of. Connections come and
    go under the handler: a lost or corrupt one is detached, and a resume (``resume``)
    attaches the next. The session ends, ``ended`` saying why, when the handler returns or
    closes it (``finish``), the consumer sends ``CLOSE``, a frame is abandoned halfway, or
    no resume comes within the grace period (the owner hears ``session_expired``). From
    then on ``receive_frame`` and ``send_frame`` raise ``SessionClosedError``; ``run``
    returns once the handler has, and tells the owner (``session_ended``). A session
    handed to another process (``hand_over``) stays here as a placeholder until it ends
    there: resumes and closes that reach it go on to its ``successor``.
    """

    def __init__(
        self,
        owner: SessionOwner,
        *,
        session_id: bytes,
        peer_public_key: bytes,
        resume_secret: bytes,
        core: SessionCore,
        handler: Handler,
        lease_token: bytes | None = None,
    ) -> None:
        self.owner = owner
        self.handler = handler
        self.max_frame = core.max_frame
        self.session_id = session_id
        self.peer_public_key = peer_public_key
        self.lease_token = lease_token
        self.resume_secret = resume_secret
        self.core = core
        #: Where the session went, once handed over (then this is its placeholder).
        self.successor: Successor | None = None
        self.channel = SecureServerChannel(self)
        self.ended: str | None = None
        self._resume_lock = trio.Lock()
        self._wire = Mutex()
        self._frames = Mutex()
        self._conn: Connection | None = None
        self._retired: list[Connection] = []
        # Connection attached, detached, or session ended: the session task watches this.
        self._conn_changed = Signal()
        # A record was read, a frame taken, or the connection changed: tasks waiting for
        # the reader (or for a connection to read from) watch this.
        self._progress = Signal()
        self._reading = False
        self._inbox: deque[bytearray] = deque()
        self._inbox_bytes = 0

    @classmethod
    def new(
        cls,
        owner: SessionOwner,
        keys: hs.SessionKeys,
        handler: Handler,
        lease_token: bytes | None = None,
    ) -> ServerSession:
        """A session a handshake here just opened, under ``lease_token``, with its owner's
        settings."""
        core = SessionCore(keys.send_key, keys.recv_key, **owner.settings.core_limits)
        return cls(
            owner,
            session_id=keys.session_id,
            peer_public_key=keys.peer_public_key,
            resume_secret=keys.resume_secret,
            core=core,
            handler=handler,
            lease_token=lease_token,
        )

    @classmethod
    def continued(
        cls, owner: SessionOwner, state: dict[str, Any], handler: Handler
    ) -> ServerSession:
        """A session another process handed over (``hand_over``'s ``state``); its core
        keeps the limits it was handed over with.

        Raises:
            ValueError: ``state`` is not a handed-over session's.
        """
        limits = SessionSettings.from_state(state["settings"]).core_limits
        core = SessionCore.continued(state["core"], **limits)
        session = cls(
            owner,
            session_id=state["session_id"],
            peer_public_key=state["peer"],
            resume_secret=state["resume_secret"],
            core=core,
            handler=handler,
        )
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
        state = {
            "session_id": self.session_id,
            "peer": self.peer_public_key,
            "resume_secret": self.resume_secret,
            "core": core,
            "inbox": [bytes(frame) for frame in self._inbox],
            "settings": self.owner.settings.as_state(),
        }
        self._inbox.clear()
        self._inbox_bytes = 0
        self.successor = successor
        conn.retired = True  # not ours to close any more
        self._conn = None
        self._conn_changed.fire()
        self._progress.fire()
        return Handover(conn.reader.stream, conn.reader.buffered(), secure=state)

    # --- lifecycle --------------------------------------------------------------------

    async def run(self, conn: Connection) -> None:
        """The session task: the handler, plus the connections' upkeep."""
        self._conn = conn
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._run_handler)
                await self._watch_connections()
        finally:
            self.owner.session_ended(self)
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
        grace = self.owner.settings.grace_period
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
                self.owner.session_expired(self)
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
            # After any frame being sent: a CLOSE between a frame's records is a
            # protocol error to the consumer. A frame that cannot finish in time is cut
            # off with the connection instead, which the consumer takes for a lost link.
            async with self._frames, self._wire:
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

    def _detach(self, conn: Connection) -> None:
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

    async def resume(
        self, resume: hs.ServerResume, received: int, reader: StreamReader, writer: StreamWriter
    ) -> int | None:
        """Go on over a new connection, whose consumer has proved the resume secret
        (``resume``) and holds our records up to ``received``: drop the current connection,
        tell the consumer what we hold, attach the new one and resend on it what the
        consumer lacks (holding the wire, so no new record overtakes them).

        Returns:
            How many records were resent, or None: the session had ended (the consumer
            was told why).

        Raises:
            HandshakeError: the session cannot resend from ``received``.
        """
        async with self._resume_lock:
            if self._conn is not None:
                self._detach(self._conn)
            async with self._wire:
                if self.ended is not None:
                    await writer.send(hs.error_message(f"session ended: {self.ended}"))
                    return None
                try:
                    resend = self.core.resend_from(received)
                except RemoteProtocolError as exc:
                    raise HandshakeError(f"impossible resume point: {exc}") from exc
                await writer.send(resume.resumed(self.core.received))
                self.core.resumed()
                self._conn = Connection(reader, writer)
                self._conn_changed.fire()
                self._progress.fire()
                for record in resend:
                    await writer.send(*record)
        return len(resend)

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

    async def _read_record(self, conn: Connection) -> bytearray | None:
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
