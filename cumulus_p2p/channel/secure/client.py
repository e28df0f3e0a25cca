"""Blocking shell of the secure channel on the consumer (the user's PyTorch thread).

Theory of operation
-------------------
``SecureClientChannel`` drives a ``SessionCore`` over a *link*: anything with
``sendmsg_all``, ``recv_into``, ``shutdown`` and ``close`` (a TCP socket here, a bridged
libp2p stream in ``libp2p_path``). A ``dial`` callable opens a fresh link; it is how a
dropped connection is resumed.

When a send or receive finds the link broken, the channel resumes: it dials again, proves
the resume secret, learns how many records the provider holds and resends the rest from
its retransmit buffer, retrying with backoff until ``resume_timeout``. The caller's
``send_frame``/``recv_frame`` simply takes longer; only a refused or timed-out resume
raises ``SessionClosedError``.

Threads: one thread may send while another receives. ``_send_lock`` orders sealing and
writing, ``_recv_lock`` reading (and the core's receive-only state: the header being
parsed, the frame being filled), ``_core_lock`` the core's state both sides touch; the
order is send → recv → core, and a receiver only ever *tries* the send lock (to send an
``ACK``), so the two never wait on each other in a cycle.

A frame that fits in one record (the round-trip case) takes a short path: sealed in one
step (``SessionCore.seal_single``) and written with one ``sendmsg``; a reply usually
arrives whole in one ``recv_into``.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

from ..._errors import (
    HandshakeError,
    PeerAuthenticationError,
    SessionClosedError,
    SessionRefusedError,
)
from ..transport import Buffer, ReadySpinner, nbytes, sendmsg_all, silent_host
from . import handshake as hs
from ._io import make_room
from .record import HEADER_SIZE, RECORD_LIMIT, TAG_SIZE
from .resume import Closed, Record, SessionCore
from .settings import DEFAULT_CLIENT_SETTINGS, ClientSettings

log = logging.getLogger("cumulus_p2p.channel.secure")


class Link(Protocol):
    """A blocking byte pipe the secure channel runs over."""

    def sendmsg_all(self, chunks: Sequence[Buffer]) -> None:
        """Send every byte of ``chunks`` in order. Raises ``OSError`` if the link broke."""

    def recv_into(self, view: memoryview) -> int:
        """Read some bytes into ``view``; 0 means end of stream. ``OSError`` if broken."""

    def shutdown(self) -> None:
        """Wake any thread blocked on the link and stop it (never raises)."""

    def close(self) -> None:
        """Release the link (never raises)."""


class _ConnectionLost(Exception):
    pass


class _Silent(Exception):
    pass


class SocketLink:
    """A ``Link`` over a connected TCP socket."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # A provider that vanishes without a FIN/RST is noticed in about 25 s.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
        self.sock = sock

    @classmethod
    def dial(cls, host: str, port: int, timeout: float) -> SocketLink:
        sock = socket.create_connection((host, port), timeout=timeout)
        return cls(sock)

    def settimeout(self, timeout: float | None) -> None:
        self.sock.settimeout(timeout)

    def sendmsg_all(self, chunks: Sequence[Buffer]) -> None:
        # One system call nearly always takes a whole record; only then is it worth
        # building views to send the rest.
        sent = self.sock.sendmsg(chunks)
        if sent < nbytes(chunks):
            views = [memoryview(c).cast("B") for c in chunks]
            while sent >= views[0].nbytes:
                sent -= views.pop(0).nbytes
            views[0] = views[0][sent:]
            sendmsg_all(self.sock, views)

    def recv_into(self, view: memoryview) -> int:
        return self.sock.recv_into(view)

    def shutdown(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()


class _Reader:
    """Exact reads from a link through one reusable buffer (see ``_io.StreamReader``)."""

    def __init__(self, link: Link, max_record: int) -> None:
        self.link = link
        self._buf = bytearray(2 * (RECORD_LIMIT + HEADER_SIZE + TAG_SIZE) + 65536)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0
        #: While set, a read that hears nothing this long raises ``_Silent``.
        self.silence_s: float | None = None
        # A TCP link is read straight from its socket (one call less per read), after a
        # short poll that keeps the thread awake for a quick reply.
        self._recv_into: Callable[[memoryview], int]
        self._spinner: ReadySpinner | None
        if type(link) is SocketLink:
            self._recv_into = link.sock.recv_into
            self._spinner = ReadySpinner(link.sock)
        else:
            self._recv_into = link.recv_into
            self._spinner = None

    def peek(self, n: int) -> memoryview:
        """The next ``n`` bytes, not consumed (a view, valid until the next read)."""
        if self._end - self._start < n:
            self._fill(n)
        return self._view[self._start : self._start + n]

    def consume(self, n: int) -> None:
        """Drop the first ``n`` buffered bytes (after ``peek(n)`` or more)."""
        self._start += n

    def take(self, n: int) -> memoryview:
        """Return and consume the next ``n`` bytes (see ``peek``)."""
        view = self.peek(n)
        self._start += n
        return view

    def _fill(self, n: int) -> None:
        self._start, self._end = make_room(self._view, self._start, self._end, n)
        while self._end - self._start < n:
            if self._spinner is not None:
                self._spinner.spin()
            self._await_bytes()
            try:
                got = self._recv_into(self._view[self._end :])
            except OSError as exc:
                raise _ConnectionLost(f"connection lost: {exc}") from exc
            if got == 0:
                raise _ConnectionLost("provider closed the connection")
            self._end += got

    def _await_bytes(self) -> None:
        if self.silence_s is None:
            return
        if self._spinner is not None:
            heard = self._spinner.wait(self.silence_s)
        else:
            wait = getattr(self.link, "wait_readable", None)
            heard = wait is None or wait(self.silence_s)  # a link that cannot tell waits
        if not heard:
            raise _Silent

    def read_handshake(self) -> bytes:
        try:
            n = hs.parse_length(bytes(self.take(hs.LENGTH.size)))
            return bytes(self.take(n))
        except _ConnectionLost as exc:
            raise HandshakeError(f"handshake interrupted: {exc}") from exc


def _send_handshake(link: Link, message: bytes) -> None:
    try:
        link.sendmsg_all([message])
    except OSError as exc:
        raise HandshakeError(f"handshake interrupted: {exc}") from exc


class SecureClientChannel:
    """A blocking ``FrameChannel``: authenticated, encrypted, resumable.

    Build it with ``connect_secure`` (TCP) or ``libp2p_path.connect_secure_libp2p``.
    """

    def __init__(
        self,
        dial: Callable[[], Link],
        link: Link,
        reader: _Reader,
        keys: hs.SessionKeys,
        *,
        settings: ClientSettings,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self.max_frame = settings.max_frame
        self.peer_public_key = keys.peer_public_key
        self.session_id = keys.session_id
        self._dial = dial
        self._link = link
        self._reader = reader
        self._resume_secret = keys.resume_secret
        self._max_record = settings.max_record
        self._resume_timeout = settings.resume_timeout
        self._silence_s = settings.silence_s
        self._on_close = on_close
        self._core = SessionCore(keys.send_key, keys.recv_key, **settings.core_limits)
        self._send_lock = threading.RLock()
        self._recv_lock = threading.Lock()
        self._core_lock = threading.Lock()
        self._generation = 0
        self._inbox: deque[bytearray] = deque()
        self._closed: str | None = None
        #: How many times this channel resumed (for monitoring and tests).
        self.resumes = 0

    # --- FrameChannel -----------------------------------------------------------------

    def send_frame(self, parts: Sequence[Buffer]) -> None:
        """Send one frame made of ``parts`` concatenated (scatter-gather, no join).

        Raises:
            SessionClosedError: the session ended or could not be resumed.
            FrameTooLargeError: the frame exceeds ``max_frame`` (nothing was sent).
        """
        with self._send_lock:
            self._check_open()
            with self._core_lock:
                record = self._core.seal_single(parts)
            if record is not None:
                self._write(record)
                if self._core.must_wait:
                    self._pump_until_acked()
                return
            with self._core_lock:
                records = self._core.seal_frame(parts)
                record = next(records)
            while record is not None:
                self._write(record)
                if self._core.must_wait:
                    self._pump_until_acked()
                with self._core_lock:
                    record = next(records, None)

    def recv_frame(self) -> bytearray:
        """Block until one whole frame arrives.

        Raises:
            SessionClosedError: the provider closed the session, or it could not be
                resumed.
            RemoteProtocolError: the provider sent an invalid record (subclasses say
                which), or the resume was refused by an authentication failure.
        """
        while True:
            with self._recv_lock:
                if self._inbox:
                    return self._inbox.popleft()
                self._check_open()
                generation = self._generation
                frame, lost = self._read_listening()
                if lost is None:
                    self._maybe_ack()
                    if frame:  # an empty one is a keepalive: the answer is still to come
                        return frame
            if lost is not None:
                self._recover(generation, lost)

    def close(self) -> None:
        """End the session (the provider's handler sees ``SessionClosedError``). Idempotent."""
        if self._closed is not None:
            return
        if self._send_lock.acquire(timeout=5.0):
            try:
                if self._closed is None:
                    with self._core_lock:
                        record = self._core.seal_close("consumer closed the session")
                    try:
                        self._link.sendmsg_all(record)
                    except OSError:
                        pass
            finally:
                self._send_lock.release()
        self._mark_closed("channel closed by this consumer")

    def __enter__(self) -> SecureClientChannel:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- internals --------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed is not None:
            raise SessionClosedError(self._closed)

    def _mark_closed(self, reason: str) -> None:
        if self._closed is None:
            self._closed = reason
        self._link.shutdown()
        self._link.close()
        if self._on_close is not None:
            on_close, self._on_close = self._on_close, None
            on_close()

    def _read_listening(self) -> tuple[bytearray | None, _ConnectionLost | None]:
        """``_read_event``, giving the host up when it stays silent past ``silence_s``."""
        self._reader.silence_s = self._silence_s
        try:
            return self._read_event()
        except _Silent:
            error = silent_host(cast(float, self._silence_s))
            self._mark_closed(str(error))
            raise error from None
        finally:
            self._reader.silence_s = None

    def _read_event(self) -> tuple[bytearray | None, _ConnectionLost | None]:
        """Read one record (caller holds ``_recv_lock``): the frame it completed, if any,
        or the link's failure (the caller resumes once it lets go of the lock).

        Raises:
            SessionClosedError: the provider closed the session.
        """
        try:
            event = self._read_record()
        except _ConnectionLost as exc:
            return None, exc
        if type(event) is Closed:
            self._mark_closed(f"provider closed the session: {event.reason}")
            raise SessionClosedError(self._closed)
        return cast("bytearray | None", event), None

    def _read_record(self) -> bytearray | Closed | None:
        """Read and absorb one record (caller holds ``_recv_lock``)."""
        reader = self._reader
        core = self._core
        # receive_header touches only the receiving state, which _recv_lock guards.
        size = HEADER_SIZE + core.receive_header(reader.peek(HEADER_SIZE))
        try:
            record = reader.peek(size)
        except _ConnectionLost:
            core.abort_partial_read()
            raise
        reader.consume(size)
        with self._core_lock:
            return core.receive_body(record[:HEADER_SIZE], record[HEADER_SIZE:])

    def _maybe_ack(self) -> None:
        # Only *try* the send lock: a sender blocked on a full socket must not stall us.
        if self._core.ack_due and self._send_lock.acquire(blocking=False):
            try:
                with self._core_lock:
                    record = self._core.seal_ack()
                self._write(record)
            finally:
                self._send_lock.release()

    def _write(self, record: Record) -> None:
        """Send one sealed record (caller holds ``_send_lock``); resume if the link broke."""
        generation = self._generation
        try:
            self._link.sendmsg_all(record)
        except OSError as exc:
            # The record is in the retransmit buffer: the resume resends it.
            self._recover(generation, exc)

    def _pump_until_acked(self) -> None:
        """Read incoming records until the retransmit buffer has room again."""
        while self._core.must_wait:
            with self._recv_lock:
                self._check_open()
                generation = self._generation
                frame, lost = self._read_event()
                if lost is None:
                    if frame is not None:
                        self._inbox.append(frame)
                    if self._core.ack_due:
                        with self._core_lock:
                            record = self._core.seal_ack()
                        self._write(record)
            if lost is not None:
                self._recover(generation, lost)

    def _recover(self, generation: int, cause: BaseException) -> None:
        """Resume the session on a new link, unless another thread already did."""
        self._link.shutdown()  # wake a thread blocked on the dead link
        with self._send_lock:
            if self._generation != generation:
                return
            self._check_open()
            log.info("secure channel lost its connection (%s); resuming", cause)
            deadline = time.monotonic() + self._resume_timeout
            delay = 0.02
            while True:
                with self._recv_lock:
                    self._link.close()
                    try:
                        link, reader, peer_received = self._resume_once()
                    except (SessionRefusedError, PeerAuthenticationError) as exc:
                        self._mark_closed(f"session could not be resumed: {exc}")
                        raise SessionClosedError(self._closed) from exc
                    except (OSError, HandshakeError) as exc:
                        if time.monotonic() + delay > deadline:
                            self._mark_closed(
                                f"session could not be resumed within "
                                f"{self._resume_timeout:g} s: {exc}"
                            )
                            raise SessionClosedError(self._closed) from exc
                        log.info("resume attempt failed (%s); retrying", exc)
                        link = None
                    if link is not None:
                        with self._core_lock:
                            try:
                                resend = self._core.resend_from(peer_received)
                            except Exception as exc:
                                self._mark_closed(f"provider resumed at an impossible point: {exc}")
                                raise SessionClosedError(self._closed) from exc
                            self._core.resumed()
                        self._link, self._reader = link, reader
                        self._generation += 1
                        self.resumes += 1
                        try:
                            for record in resend:
                                link.sendmsg_all(record)
                        except OSError as exc:
                            log.info("link broke while resending (%s); resuming again", exc)
                            generation = self._generation
                            link.shutdown()
                        else:
                            return
                time.sleep(delay)
                delay = min(delay * 2, 1.0)

    def _resume_once(self) -> tuple[Link, _Reader, int]:
        link = self._dial()
        try:
            reader = _Reader(link, self._max_record)
            resume = hs.ClientResume(self.session_id, self._resume_secret, self._core.received)
            _send_handshake(link, resume.hello())
            _send_handshake(link, resume.on_challenge(reader.read_handshake()))
            peer_received = resume.on_resumed(reader.read_handshake())
        except BaseException:
            link.shutdown()
            link.close()
            raise
        _set_timeout(link, None)
        return link, reader, peer_received


def _set_timeout(link: Link, timeout: float | None) -> None:
    settimeout = getattr(link, "settimeout", None)
    if settimeout is not None:
        settimeout(timeout)


_Handshaken = tuple[_Reader, hs.SessionKeys]


def handshake_new(
    link: Link,
    *,
    identity,
    expected_peer_public_key: bytes,
    lease: bytes | None,
    max_record: int,
) -> _Handshaken:
    """Run the new-session handshake on a fresh link (blocking)."""
    reader = _Reader(link, max_record)
    shake = hs.ClientHandshake(identity.public_key, identity.sign, expected_peer_public_key, lease)
    _send_handshake(link, shake.hello())
    _send_handshake(link, shake.on_server_auth(reader.read_handshake()))
    keys = shake.on_result(reader.read_handshake())
    return reader, keys


def connect_secure(
    host: str,
    port: int,
    *,
    identity,
    expected_peer_public_key: bytes,
    lease: bytes | None = None,
    settings: ClientSettings = DEFAULT_CLIENT_SETTINGS,
    **tuning: Any,
) -> SecureClientChannel:
    """Open a secure session to a provider over direct TCP (blocking).

    Args:
        host: The provider's address.
        port: The provider's secure-channel port.
        identity: This consumer's ``NodeIdentity``.
        expected_peer_public_key: The provider's ed25519 public key (32 bytes), from its
            offer or lease. Any other key is treated as an impostor.
        lease: An opaque lease token for the provider's ``authorize`` (for example the
            countersigned lease's bytes), or ``None``.
        settings: Timeouts and the session's limits (``ClientSettings`` says what each
            one is for).
        tuning: Fields of ``ClientSettings`` (``timeout=5``, ``max_record=...``) that
            replace those of ``settings``, for a caller that changes only one or two.

    Returns:
        The channel, a ``FrameChannel``.

    Raises:
        SessionRefusedError: the provider refused this consumer (``.reason`` says why).
        PeerAuthenticationError: the peer is not the expected provider.
        HandshakeError: the handshake failed (malformed, truncated or timed out).
        OSError: the provider could not be reached.
        TypeError: ``tuning`` names something that is not a field of ``ClientSettings``.
    """
    settings = dataclasses.replace(settings, **tuning)

    def dial() -> SocketLink:
        return SocketLink.dial(host, port, settings.timeout)

    return open_channel(
        dial,
        dial(),
        identity=identity,
        expected_peer_public_key=expected_peer_public_key,
        lease=lease,
        settings=settings,
    )


def open_channel(
    dial: Callable[[], Link],
    link: Link,
    *,
    identity,
    expected_peer_public_key: bytes,
    lease: bytes | None,
    settings: ClientSettings,
    guard: Callable[[Callable[[], _Handshaken]], _Handshaken] | None = None,
    on_close: Callable[[], None] | None = None,
) -> SecureClientChannel:
    """Run the new-session handshake on ``link`` (fresh from ``dial``) and wrap it in a
    channel; the arguments are ``connect_secure``'s and ``SecureClientChannel``'s.

    ``guard``, if given, runs the handshake (for example under a watchdog). A failed
    handshake shuts the link down and closes it.
    """

    def shake() -> _Handshaken:
        return handshake_new(
            link,
            identity=identity,
            expected_peer_public_key=expected_peer_public_key,
            lease=lease,
            max_record=settings.max_record,
        )

    try:
        reader, keys = shake() if guard is None else guard(shake)
    except BaseException:
        link.shutdown()
        link.close()
        raise
    _set_timeout(link, None)
    return SecureClientChannel(dial, link, reader, keys, settings=settings, on_close=on_close)
