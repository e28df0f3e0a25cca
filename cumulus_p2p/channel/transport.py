"""Frame transports for the op stream: one small interface, several channels.

A *frame* is one length-prefixed message: a 4-byte big-endian length, then that many
bytes. The op-stream codec (``cumulus_p2p.wire.protocol``) decides what the bytes mean;
a transport only moves whole frames and enforces the size limit before allocating. An
empty frame is a keepalive (an executor's, while it holds a request: ``KEEPALIVE_S``):
the consumer's channels skip it, so a frame they deliver is never empty.

Two sides, two styles:

- The consumer side runs inside the user's PyTorch thread, which is synchronous, so
  ``FrameChannel`` is blocking (``socket``).
- The executor side is a trio program, so ``AsyncFrameChannel`` is async.

The plain TCP channels here are the loopback/trusted-LAN path. The secure channel
(authenticated, encrypted, resumable) implements the same two interfaces, so the
client session and the executor never know which one they hold.
"""

from __future__ import annotations

import math
import os
import select
import socket
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import trio

from .._errors import FrameTooLargeError, HostSilentError, SessionClosedError

Buffer = bytes | bytearray | memoryview

_LENGTH = struct.Struct(">I")
#: Default upper bound on one frame. Large uploads are split by the client.
DEFAULT_MAX_FRAME = 256 * 1024 * 1024
#: How long a blocking reader polls before it sleeps in the kernel (see ``ReadySpinner``).
DEFAULT_SPIN_S = 100e-6
#: An executor holding a request this long without answering sends an empty frame, a
#: keepalive (``host/keepalive.py``); a consumer's channel skips them. A live host is
#: thus never silent for long while an answer is due, however long its op runs.
KEEPALIVE_S = 2.0
#: How long a consumer waiting for an answer hears nothing before it takes the host as
#: hung (``HostSilentError``): a stopped process or a frozen machine, whose kernel still
#: acknowledges every byte, so that no connection breaks. ``CUMULUS_SILENCE_S`` sets it.
SILENCE_S = 30.0


def silence_limit(environ: Mapping[str, str] = os.environ) -> float:
    """``SILENCE_S``, or ``CUMULUS_SILENCE_S`` when set (seconds, above the keepalive's
    period); raises ``ValueError`` saying what it takes."""
    raw = environ.get("CUMULUS_SILENCE_S")
    if raw is None:
        return SILENCE_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 2 * KEEPALIVE_S <= value < math.inf:
        raise ValueError(
            f"CUMULUS_SILENCE_S={raw!r}: give the seconds a host may stay silent while an "
            f"answer is due, at least {2 * KEEPALIVE_S:g} (twice its keepalive period)"
        )
    return value


#: When each executor this process dialled last fell silent (``time.monotonic``), by the
#: ``(host, port)`` it was dialled at: failover tries a hung host last, for its kernel
#: still accepts connections and would hold each attempt for the whole ``silence_s``.
_fell_silent: dict[tuple[str, int], float] = {}


def fell_silent_within(host: str, port: int, seconds: float) -> bool:
    """Whether the executor dialled at ``host:port`` fell silent in the last ``seconds``."""
    at = _fell_silent.get((host, port))
    return at is not None and time.monotonic() - at < seconds


def silent_host(silence_s: float) -> HostSilentError:
    """The error of a host that sent nothing for ``silence_s`` while an answer was due."""
    return HostSilentError(
        f"the host sent nothing for {silence_s:g} s while an answer was due, not even a "
        "keepalive: it hangs (a stopped process or a frozen machine); giving it up as lost"
    )


class FrameChannel(Protocol):
    """Blocking, ordered, reliable frames (the consumer side)."""

    max_frame: int

    def send_frame(self, parts: Sequence[Buffer]) -> None:
        """Send one frame made of ``parts`` concatenated (scatter-gather, no join)."""

    def recv_frame(self) -> bytearray:
        """Block until one whole frame arrives. Raises ``SessionClosedError`` on EOF."""

    def close(self) -> None:
        """Close the channel. Idempotent."""


class AsyncFrameChannel(Protocol):
    """Async, ordered, reliable frames (the executor side, under trio)."""

    max_frame: int

    async def send_frame(self, parts: Sequence[Buffer]) -> None:
        """Send one frame made of ``parts`` concatenated."""

    async def receive_frame(self) -> bytearray:
        """Wait for one whole frame. Raises ``SessionClosedError`` on EOF."""

    async def aclose(self) -> None:
        """Close the channel. Idempotent."""


def nbytes(parts: Sequence[Buffer]) -> int:
    """The bytes in ``parts`` together (a memoryview's ``len`` counts items, not bytes)."""
    total = 0
    for part in parts:
        total += part.nbytes if type(part) is memoryview else len(part)
    return total


def frame_header(parts: Sequence[Buffer], max_frame: int) -> bytes:
    """Return the length prefix for a frame made of ``parts``, checking the limit."""
    total = nbytes(parts)
    if total > max_frame:
        raise FrameTooLargeError(f"frame of {total} bytes exceeds the limit of {max_frame}")
    return _LENGTH.pack(total)


def parse_length(prefix: Buffer, max_frame: int) -> int:
    """Decode a length prefix, refusing lengths above ``max_frame`` before any allocation."""
    (length,) = _LENGTH.unpack(prefix)
    if length > max_frame:
        raise FrameTooLargeError(f"peer announced a {length}-byte frame; limit is {max_frame}")
    return length


class HandoverError(Exception):
    """A channel cannot be handed over now (it is mid-frame, or already gone)."""


@dataclass
class Handover:
    """A channel this process stops using, for another process to continue.

    The provider's supervisor hands each session to its worker process this way
    (``supervisor.py``), so the worker reads and writes the consumer's connection itself.
    """

    #: The connection. Nothing in this process reads or writes it any more.
    stream: trio.abc.Stream
    #: Bytes read from ``stream`` and not taken yet, in stream order.
    buffered: bytes
    #: A secure session's keys, counters and settings (``SecureServerChannel.hand_over``);
    #: None for a plain channel, whose frames are ``buffered`` as they came.
    secure: dict | None = None
    #: Called with the frame bytes the successor reports it carried (metering).
    on_bytes: Callable[[int], None] | None = None
    #: Called with the bytes the successor reports its collectives carried between hosts.
    on_peer_bytes: Callable[[int], None] | None = None


class ReadySpinner:
    """Polls a socket, without sleeping, for a short while before a blocking read.

    A thread that sleeps in ``recv`` is woken by the kernel when the reply lands, and on
    a virtual machine an idle vCPU then has to be woken too: that alone measured 20-50 µs
    per round trip here, as much as the whole loopback round trip. Polling for
    ``spin_s`` first keeps the waiting thread awake for the answer to a sync point, which
    usually comes within tens of microseconds; a longer wait (the executor is running a
    training step) costs at most ``spin_s`` of CPU before falling back to sleeping.
    ``poll`` releases the GIL, so other Python threads keep running meanwhile.
    """

    def __init__(self, sock: socket.socket, spin_s: float = DEFAULT_SPIN_S) -> None:
        self._poller = select.poll()
        self._poller.register(sock, select.POLLIN)
        self.spin_s = spin_s

    def wait(self, timeout_s: float) -> bool:
        """Whether the socket turned readable within ``timeout_s``."""
        return bool(self._poller.poll(timeout_s * 1000))

    def spin(self) -> None:
        """Return once the socket is readable or ``spin_s`` has passed."""
        if self.spin_s <= 0:
            return
        poll = self._poller.poll
        deadline = time.perf_counter() + self.spin_s
        while not poll(0) and time.perf_counter() < deadline:
            pass


class SocketFrameChannel:
    """A ``FrameChannel`` over a connected blocking TCP socket. Empty frames
    (keepalives) are skipped; with ``silence_s``, a read that hears nothing, not even a
    keepalive, for that long raises ``HostSilentError``."""

    def __init__(
        self,
        sock: socket.socket,
        *,
        max_frame: int = DEFAULT_MAX_FRAME,
        spin_s: float = DEFAULT_SPIN_S,
        silence_s: float | None = None,
    ) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        self._pending = bytearray()
        self._spinner = ReadySpinner(sock, spin_s)
        self.max_frame = max_frame
        self.silence_s = silence_s
        #: ``(host, port)`` as ``connect`` dialled it; None for a socket given.
        self.dialled: tuple[str, int] | None = None

    @classmethod
    def connect(
        cls,
        host: str,
        port: int,
        *,
        timeout: float = 10.0,
        max_frame: int = DEFAULT_MAX_FRAME,
        silence_s: float | None = None,
    ) -> SocketFrameChannel:
        """Open a TCP connection to an executor at ``host:port``."""
        sock = socket.create_connection((host, port), timeout=timeout)
        sock.settimeout(None)
        channel = cls(sock, max_frame=max_frame, silence_s=silence_s)
        channel.dialled = (host, port)
        return channel

    def fileno(self) -> int:
        """The socket's descriptor (for ``select``)."""
        return self._sock.fileno()

    @property
    def peer_address(self) -> str:
        """``host:port`` of the other end, as this side dialled it (a standby dials the
        same address: ``blobs/standby.py``)."""
        host, port = self._sock.getpeername()[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def send_frame(self, parts: Sequence[Buffer]) -> None:
        views = [memoryview(frame_header(parts, self.max_frame))]
        views.extend(memoryview(p).cast("B") for p in parts)
        try:
            sendmsg_all(self._sock, views)
        except OSError as exc:
            raise SessionClosedError(f"connection to executor lost while sending: {exc}") from exc

    def recv_frame(self) -> bytearray:
        while not (frame := self._recv_one()):
            pass  # a keepalive: the host lives, and the answer is still to come
        return frame

    def _recv_one(self) -> bytearray:
        # One recv usually brings the prefix and a small reply together.
        while len(self._pending) < _LENGTH.size:
            self._pending += self._recv_some(65536)
        length = parse_length(self._pending[: _LENGTH.size], self.max_frame)
        have = len(self._pending) - _LENGTH.size
        if have >= length:
            frame = self._pending[_LENGTH.size : _LENGTH.size + length]
            del self._pending[: _LENGTH.size + length]
            return frame
        frame = bytearray(length)
        view = memoryview(frame)
        view[:have] = self._pending[_LENGTH.size :]
        self._pending.clear()
        while have < length:
            self._await_bytes()
            try:
                k = self._sock.recv_into(view[have:])
            except OSError as exc:
                raise SessionClosedError(f"connection to executor lost: {exc}") from exc
            if k == 0:
                raise SessionClosedError("executor closed the connection")
            have += k
        return frame

    def _recv_some(self, n: int) -> bytes:
        self._spinner.spin()
        self._await_bytes()
        try:
            chunk = self._sock.recv(n)
        except OSError as exc:
            raise SessionClosedError(f"connection to executor lost: {exc}") from exc
        if not chunk:
            raise SessionClosedError("executor closed the connection")
        return chunk

    def _await_bytes(self) -> None:
        if self.silence_s is not None and not self._spinner.wait(self.silence_s):
            if self.dialled is not None:
                _fell_silent[self.dialled] = time.monotonic()
            raise silent_host(self.silence_s)

    def close(self) -> None:
        self._sock.close()


def sendmsg_all(sock: socket.socket, views: list[memoryview]) -> None:
    """``sendmsg`` until every byte of every view is gone (it may send only part)."""
    while views:
        drop_sent(views, sock.sendmsg(views[:512]))  # IOV_MAX is 1024 on Linux


def drop_sent(views: list[memoryview], sent: int) -> None:
    """Remove the first ``sent`` bytes (and any empty views) from ``views``, in place."""
    while sent:
        head = views[0]
        if sent >= head.nbytes:
            sent -= head.nbytes
            views.pop(0)
        else:
            views[0] = head[sent:]
            sent = 0
    while views and views[0].nbytes == 0:
        views.pop(0)


class TrioFrameChannel:
    """An ``AsyncFrameChannel`` over any ``trio.abc.Stream`` (a TCP stream here)."""

    def __init__(
        self, stream: trio.abc.Stream, *, max_frame: int = DEFAULT_MAX_FRAME, buffered: bytes = b""
    ) -> None:
        self._stream = stream
        self._buffer = bytearray(buffered)  # read from the stream, not yet taken
        self.max_frame = max_frame

    async def send_frame(self, parts: Sequence[Buffer]) -> None:
        header = frame_header(parts, self.max_frame)
        try:
            # trio streams take one buffer; small frames are joined, large parts go as-is.
            if len(parts) == 1 or sum(len(p) for p in parts) < 65536:
                await self._stream.send_all(header + b"".join(parts))
            else:
                await self._stream.send_all(header)
                for part in parts:
                    await self._stream.send_all(part)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise SessionClosedError(f"client connection lost: {exc}") from exc

    async def receive_frame(self) -> bytearray:
        length = parse_length(await self._receive_exactly(_LENGTH.size), self.max_frame)
        return await self._receive_exactly(length)

    async def _receive_exactly(self, n: int) -> bytearray:
        # receive_some(n) would allocate n bytes per call; large frames are read straight
        # into one preallocated buffer instead.
        out = bytearray(n)
        view = memoryview(out)
        got = min(n, len(self._buffer))
        view[:got] = self._buffer[:got]
        del self._buffer[:got]
        sock = getattr(self._stream, "socket", None)
        while got < n:
            try:
                if sock is not None and n - got >= 65536:
                    k = await sock.recv_into(view[got:])
                    chunk = None
                else:
                    chunk = await self._stream.receive_some(65536)
                    k = len(chunk)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise SessionClosedError(f"client connection lost: {exc}") from exc
            if k == 0:
                raise SessionClosedError("client closed the connection")
            if chunk is not None:
                take = min(k, n - got)
                view[got : got + take] = chunk[:take]
                self._buffer += chunk[take:]
                k = take
            got += k
        return out

    async def aclose(self) -> None:
        await self._stream.aclose()

    def hand_over(self, successor: object = None) -> Handover:
        """Stop using this channel; the returned ``Handover`` continues it elsewhere.
        (``successor`` is for secure channels, which keep answering for the session.)"""
        buffered, self._buffer = bytes(self._buffer), bytearray()
        return Handover(self._stream, buffered)


class ThreadedFrameChannel:
    """An ``AsyncFrameChannel`` over a blocking ``FrameChannel``, each call in a thread:
    for a trio task that must speak through a blocking client (the secure channel's)."""

    def __init__(self, inner: FrameChannel) -> None:
        self._inner = inner
        self.max_frame = inner.max_frame

    async def send_frame(self, parts: Sequence[Buffer]) -> None:
        await trio.to_thread.run_sync(self._inner.send_frame, parts)

    async def receive_frame(self) -> bytearray:
        # A cancelled read is abandoned: closing the channel, as its owner then does,
        # ends the thread's wait.
        return await trio.to_thread.run_sync(self._inner.recv_frame, abandon_on_cancel=True)

    async def aclose(self) -> None:
        await trio.to_thread.run_sync(self._inner.close)


class CountingFrameChannel:
    """A blocking ``FrameChannel`` that counts its frames' bytes as ``CountingChannel``
    does on the provider, so the consumer can check the bytes its host receipts; and,
    told of them (``count_peer_bytes``), the bytes the session's collectives have its
    host carry to the job's other hosts, which its receipts name as well; and, told so
    (``collectives_through_consumer``), that they run through the consumer instead."""

    def __init__(
        self,
        inner: FrameChannel,
        on_bytes,
        *,
        peer_address: str | None = None,
        on_peer_bytes=None,
        on_through_consumer=None,
        on_peer_links=None,
    ) -> None:
        self._inner = inner
        self._on_bytes = on_bytes
        self._on_peer_bytes = on_peer_bytes
        self._on_through_consumer = on_through_consumer
        self._on_peer_links = on_peer_links
        self.max_frame = inner.max_frame
        #: Where another host reaches this channel's host (``blobservice.Source``).
        self.peer_address = peer_address

    def send_frame(self, parts: Sequence[Buffer]) -> None:
        self._inner.send_frame(parts)
        self._on_bytes(_LENGTH.size + nbytes(parts))

    def recv_frame(self) -> bytearray:
        frame = self._inner.recv_frame()
        self._on_bytes(_LENGTH.size + len(frame))
        return frame

    def count_peer_bytes(self, n: int) -> None:
        """The session's collectives asked its host to carry ``n`` bytes between hosts."""
        if self._on_peer_bytes is not None:
            self._on_peer_bytes(n)

    def collectives_through_consumer(self) -> None:
        """The session's job runs its collectives through the consumer, not its hosts."""
        if self._on_through_consumer is not None:
            self._on_through_consumer()

    def peer_links(self, links: str) -> None:
        """The session's job links its hosts as ``links`` says ("tls" or "plain")."""
        if self._on_peer_links is not None:
            self._on_peer_links(links)

    def close(self) -> None:
        self._inner.close()


class CountingChannel:
    """An ``AsyncFrameChannel`` that reports the bytes of every frame it carries.

    The provider meters a lease's traffic with it: ``on_bytes`` gets each frame's
    length (prefix included) in either direction, as the op stream sees it; the secure
    channel's record overhead is not counted. ``peer_public_key`` passes through, so
    the executor still knows who may resume the session. ``on_peer_bytes`` gets the
    bytes the session's collectives carried between the job's hosts, as the executor
    reports them (``count_peer_bytes``).
    """

    def __init__(self, inner: AsyncFrameChannel, on_bytes, on_peer_bytes=None) -> None:
        self._inner = inner
        self._on_bytes = on_bytes
        self._on_peer_bytes = on_peer_bytes
        self.max_frame = inner.max_frame
        self.peer_public_key = getattr(inner, "peer_public_key", None)

    async def send_frame(self, parts: Sequence[Buffer]) -> None:
        await self._inner.send_frame(parts)
        self._on_bytes(_LENGTH.size + nbytes(parts))

    async def receive_frame(self) -> bytearray:
        frame = await self._inner.receive_frame()
        self._on_bytes(_LENGTH.size + len(frame))
        return frame

    async def aclose(self) -> None:
        await self._inner.aclose()

    def count_peer_bytes(self, n: int) -> None:
        """The executor's report of ``n`` bytes the session's collectives carried
        between hosts (``on_peer_bytes`` gets them)."""
        if self._on_peer_bytes is not None:
            self._on_peer_bytes(n)

    def hand_over(self, successor: object = None) -> Handover:
        """The inner channel's ``Handover``, still metered: the successor reports bytes."""
        handover = self._inner.hand_over(successor)  # type: ignore[attr-defined]
        handover.on_bytes = self._on_bytes
        handover.on_peer_bytes = self._on_peer_bytes
        return handover
