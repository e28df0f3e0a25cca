"""Trio shell of the secure channel on the provider: handshakes, sessions, resumption.

Theory of operation
-------------------
``SecureServer.handle_stream`` takes one incoming byte stream (TCP, or a libp2p stream
adapted by ``libp2p_path``) and runs the handshake under the settings'
``handshake_timeout``. A new session gets a ``ServerSession`` whose task lives in the
server's nursery, not the connection's: it runs the handler once, with one
``SecureServerChannel``, for the whole logical session (``session`` explains how a
session reads, writes and waits for its consumer). A resumed connection is authenticated,
then handed to the existing session, which swaps its connection under the handler's feet.

The server remembers why its latest sessions ended (``ENDED_REMEMBERED`` of them): a
consumer whose connection broke as the provider closed its session (the ``CLOSE`` record
lost with the connection) learns why when it tries to resume.

A session can move to another process (``SecureServerChannel.hand_over``): the server
keeps it as a placeholder and passes the resumes and closes that reach it on to its
``Successor``. The other process continues it in a server of its own
(``SecureServer.for_adopted``, ``adopt``, ``take_resume``).

One ``SessionSettings`` tunes the server and every session it runs.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio

from ..._errors import HandshakeError, LocalProtocolError
from ..transport import Handover
from . import handshake as hs
from ._io import CONNECTION_LOST, StreamReader, StreamWriter
from .session import Connection, Handler, ServerSession
from .session import SecureServerChannel as SecureServerChannel
from .session import Successor as Successor
from .settings import DEFAULT_SETTINGS, SessionSettings

log = logging.getLogger("cumulus_p2p.channel.secure")

#: ``authorize(consumer_public_key, lease_token)``: None accepts, a reason refuses.
Authorize = Callable[[bytes, bytes | None], str | None]
#: Told when a session ends, and why (``SecureServer``'s ``on_end``).
OnEnd = Callable[[bytes, str], None]
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
        settings: SessionSettings = DEFAULT_SETTINGS,
        on_end: OnEnd | None = None,
    ) -> None:
        self.identity = identity
        self.authorize = authorize
        self.handler = handler
        self.on_end = on_end
        self.settings = settings
        self.port: int | None = None
        self._nursery = nursery
        self._sessions: dict[bytes, ServerSession] = {}
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
        cls, nursery: trio.Nursery, settings: dict[str, Any], on_end: OnEnd | None = None
    ) -> SecureServer:
        """A server that only continues sessions handed over to this process (``adopt``,
        ``take_resume``), with the handing server's ``settings`` (a handed-over state's
        ``"settings"``, see ``SessionSettings.as_state``). It holds no identity, so it runs
        no new-session handshake."""
        return cls(
            None,
            authorize=_no_new_sessions,
            handler=_no_handler,
            nursery=nursery,
            settings=SessionSettings.from_state(settings),
            on_end=on_end,
        )

    def adopt(self, handover: Handover, handler: Handler) -> SecureServerChannel:
        """Continue a session another process handed over, running ``handler`` on it.

        Raises:
            ValueError: the handover is not a secure session's.
        """
        if handover.secure is None:
            raise ValueError("a plain channel's handover has no session to adopt")
        session = ServerSession.continued(self, handover.secure, handler)
        reader = StreamReader(handover.stream, self.settings.max_record, buffered=handover.buffered)
        self._sessions[session.session_id] = session
        self._started += 1
        self._nursery.start_soon(session.run, Connection(reader, StreamWriter(handover.stream)))
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
        # (The ignore: see serve_secure.)
        task_status: trio.TaskStatus[SecureServer] = trio.TASK_STATUS_IGNORED,  # type: ignore[name-defined]
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
        reader = StreamReader(stream, self.settings.max_record, buffered=buffered)
        writer = StreamWriter(stream)
        handed_over = False
        timeout = self.settings.handshake_timeout
        try:
            with trio.fail_after(timeout):
                handed_over = await step(reader, writer)
        except trio.TooSlowError:
            self._handshake_failures += 1
            log.warning("handshake timed out after %.1f s", timeout)
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
        session = ServerSession.new(self, keys, self.handler, lease)
        self._sessions[keys.session_id] = session
        self._started += 1
        self._nursery.start_soon(session.run, Connection(reader, writer))
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
        resent = await session.resume(resume, request.received, reader, writer)
        if resent is None:
            return False
        self._resumes += 1
        log.info("session %s resumed (%d records resent)", session.session_id.hex(), resent)
        return True

    async def _refuse_ended(
        self,
        request: hs.ResumeHello,
        reason: str,
        secret: bytes,
        reader: StreamReader,
        writer: StreamWriter,
    ) -> bool:
        """Tell a consumer that proves the session was its own why the session ended."""
        resume = hs.ServerResume(request, secret)
        await writer.send(resume.challenge())
        resume.on_proof(await reader.read_handshake())
        await writer.send(hs.error_message(f"session ended: {reason}"))
        return False

    # --- what its sessions tell it (``SessionOwner``) --------------------------------

    def session_expired(self, session: ServerSession) -> None:
        """Count a session whose consumer did not resume within the grace period."""
        self._expired += 1

    def session_ended(self, session: ServerSession) -> None:
        """Forget an ended session, keeping why it ended for a late resume."""
        reason = session.ended or "ended"
        self._sessions.pop(session.session_id, None)
        self._ended[session.session_id] = (reason, session.resume_secret)
        while len(self._ended) > ENDED_REMEMBERED:
            self._ended.popitem(last=False)
        if self.on_end is not None:
            self.on_end(session.session_id, reason)


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
    settings: SessionSettings = DEFAULT_SETTINGS,
) -> AsyncIterator[SecureServer]:
    """A ``SecureServer`` whose sessions live in a nursery owned by this context.

    Leaving the context cancels every session and connection. The arguments are those of
    ``serve_secure``.
    """
    async with trio.open_nursery() as nursery:
        server = SecureServer(
            identity, authorize=authorize, handler=handler, nursery=nursery, settings=settings
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
    settings: SessionSettings = DEFAULT_SETTINGS,
    # trio-stubs (from trio-typing, which libp2p and multiaddr require) shadow trio's own
    # annotations for mypy and predate trio.TaskStatus.
    task_status: trio.TaskStatus[SecureServer] = trio.TASK_STATUS_IGNORED,  # type: ignore[name-defined]
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
        settings: Grace period, handshake timeout and the sessions' limits.
        task_status: ``started`` receives the ``SecureServer`` once listening.
    """
    async with open_secure_server(
        identity, authorize=authorize, handler=handler, settings=settings
    ) as server:
        await server.serve_tcp(host, port, task_status=task_status)
