"""Trio byte-level helpers shared by the secure server and the libp2p path."""

from __future__ import annotations

import trio

from ..._errors import HandshakeError
from ..transport import drop_sent
from . import handshake as hs
from .record import DEFAULT_MAX_RECORD, HEADER_SIZE, RECORD_LIMIT, TAG_SIZE

#: Errors that mean "this connection is gone" (as opposed to "the peer misbehaved").
CONNECTION_LOST = (OSError, trio.BrokenResourceError, trio.ClosedResourceError, EOFError)


def make_room(view: memoryview, start: int, end: int, n: int) -> tuple[int, int]:
    """Make room in a read buffer for ``n`` bytes from ``start``; return the new bounds.

    ``view[start:end]`` holds the bytes read and not consumed yet.
    """
    have = end - start
    if have == 0:
        # Nothing buffered: start over at the front, so request/response traffic
        # keeps using the same few (cache-hot) bytes of the buffer.
        return 0, 0
    if start + n > len(view):
        # Slide the partial record to the front (memoryview assignment is a memmove).
        view[:have] = view[start:end]
        return 0, have
    return start, end


class StreamReader:
    """Reads exact byte counts from a trio stream through one reusable buffer.

    Reading greedily into a buffer larger than a record lets one system call bring a
    header, a body and the next header; ``peek`` and ``take`` return views into that
    buffer, valid until the next read. A ``trio.SocketStream`` is read with ``recv_into``
    (no allocation per read).

    ``peek`` consumes nothing, so a read cancelled half way loses no bytes: the session
    peeks a whole record, then consumes and opens it without awaiting in between.
    """

    def __init__(
        self, stream: trio.abc.Stream, max_record: int = DEFAULT_MAX_RECORD, buffered: bytes = b""
    ) -> None:
        self.stream = stream
        size = 2 * (RECORD_LIMIT + HEADER_SIZE + TAG_SIZE) + 65536
        if len(buffered) > size:
            raise ValueError(f"{len(buffered)} buffered bytes; a reader holds at most {size}")
        self._buf = bytearray(size)
        self._view = memoryview(self._buf)
        # ``buffered``: bytes another reader took from the stream (a handed-over session).
        self._view[: len(buffered)] = buffered
        self._start = 0
        self._end = len(buffered)
        #: Reads from the stream so far. Each one was a trio checkpoint, so a caller can
        #: tell whether it still owes one.
        self.reads = 0
        self._interrupted = False
        self._scope: trio.CancelScope | None = None
        sock = stream.socket if isinstance(stream, trio.SocketStream) else None
        self._socket = sock
        self._recv_into = sock.recv_into if sock is not None else None

    async def peek(self, n: int) -> memoryview:
        """The next ``n`` bytes, not consumed (a view, valid until the next read).

        Raises:
            EOFError: the peer closed the stream first.
            OSError, trio.BrokenResourceError: the connection broke.
            trio.ClosedResourceError: ``interrupt`` was called.
        """
        if self._end - self._start < n or self._interrupted:
            await self._fill(n)
        return self._view[self._start : self._start + n]

    def buffered(self) -> bytes:
        """The bytes read from the stream and not consumed yet."""
        return bytes(self._view[self._start : self._end])

    def consume(self, n: int) -> None:
        """Drop the first ``n`` buffered bytes (after ``peek(n)`` or more)."""
        self._start += n

    async def take(self, n: int) -> memoryview:
        """Return and consume the next ``n`` bytes (see ``peek``)."""
        view = await self.peek(n)
        self._start += n
        return view

    def interrupt(self) -> None:
        """Stop this connection now: a read in progress or to come raises ``ClosedResourceError``.

        Synchronous, so session bookkeeping can call it from anywhere. A TCP socket is
        closed (trio wakes every task waiting on it, writers included); other streams
        have their pending read cancelled and still need ``aclose``.
        """
        self._interrupted = True
        if self._socket is not None:
            self._socket.close()
        elif self._scope is not None:
            self._scope.cancel()

    async def _fill(self, n: int) -> None:
        if self._interrupted:
            raise trio.ClosedResourceError("connection was replaced or ended")
        self._start, self._end = make_room(self._view, self._start, self._end, n)
        while self._end - self._start < n:
            self.reads += 1
            if self._recv_into is not None:
                got = await self._recv_into(self._view[self._end :])
            else:
                got = await self._receive_some()
            if got == 0:
                raise EOFError("peer closed the connection")
            self._end += got

    async def _receive_some(self) -> int:
        # Streams other than TCP sockets cannot be woken by closing them: their read
        # runs in a scope that ``interrupt`` cancels.
        try:
            with trio.CancelScope() as scope:
                self._scope = scope
                data = await self.stream.receive_some(len(self._buf) - self._end)
        finally:
            self._scope = None
        if scope.cancelled_caught:
            raise trio.ClosedResourceError("connection was replaced or ended")
        self._view[self._end : self._end + len(data)] = data
        return len(data)

    async def read_handshake(self) -> bytes:
        """Read one length-prefixed handshake message.

        Raises:
            HandshakeError: oversized or truncated message.
        """
        try:
            n = hs.parse_length(bytes(await self.take(hs.LENGTH.size)))
            return bytes(await self.take(n))
        except EOFError as exc:
            raise HandshakeError("connection closed in the middle of the handshake") from exc


class StreamWriter:
    """Writes records to a trio stream; scatter-gather ``sendmsg`` on TCP sockets."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        sock = stream.socket if isinstance(stream, trio.SocketStream) else None
        self._sock = sock

    async def send(self, *chunks: bytes | memoryview) -> None:
        """Send ``chunks`` back to back (one system call when the socket takes them all)."""
        sock = self._sock
        if sock is None:
            if len(chunks) == 1 or sum(len(c) for c in chunks) < 65536:
                await self.stream.send_all(b"".join(chunks))
            else:
                for c in chunks:
                    await self.stream.send_all(c)
            return
        sent = await sock.sendmsg(chunks)
        total = 0
        for chunk in chunks:
            total += len(chunk)
        if sent < total:
            await _send_rest(sock, chunks, sent)


async def _send_rest(
    sock: trio.socket.SocketType, chunks: tuple[bytes | memoryview, ...], sent: int
) -> None:
    """Send what a partial ``sendmsg`` of ``chunks`` left, ``sent`` bytes in."""
    views = [memoryview(c).cast("B") for c in chunks]
    drop_sent(views, sent)
    while views:
        drop_sent(views, await sock.sendmsg(views))
