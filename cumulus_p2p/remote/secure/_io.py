"""Trio byte-level helpers shared by the secure server and the libp2p path."""

from __future__ import annotations

import trio

from ..._errors import HandshakeError
from . import handshake as hs
from .record import DEFAULT_MAX_RECORD, HEADER_SIZE, RECORD_LIMIT, TAG_SIZE

#: Errors that mean "this connection is gone" (as opposed to "the peer misbehaved").
CONNECTION_LOST = (OSError, trio.BrokenResourceError, trio.ClosedResourceError, EOFError)


class StreamReader:
    """Reads exact byte counts from a trio stream through one reusable buffer.

    Reading greedily into a buffer larger than a record lets one system call bring a
    header, a body and the next header; ``take`` returns views into that buffer, valid
    until the next ``take``. A ``trio.SocketStream`` is read with ``recv_into`` (no
    allocation per read).
    """

    def __init__(self, stream: trio.abc.Stream, max_record: int = DEFAULT_MAX_RECORD) -> None:
        self.stream = stream
        size = 2 * (RECORD_LIMIT + HEADER_SIZE + TAG_SIZE) + 65536
        self._buf = bytearray(size)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0
        sock = getattr(stream, "socket", None) if isinstance(stream, trio.SocketStream) else None
        self._recv_into = sock.recv_into if sock is not None else None

    async def take(self, n: int) -> memoryview:
        """Return the next ``n`` bytes (a view, valid until the next call).

        Raises:
            EOFError: the peer closed the stream first.
            OSError, trio.BrokenResourceError: the connection broke.
        """
        if self._end - self._start < n:
            await self._fill(n)
        view = self._view[self._start : self._start + n]
        self._start += n
        return view

    async def _fill(self, n: int) -> None:
        have = self._end - self._start
        if self._start + n > len(self._buf):
            # Slide the partial record to the front (memoryview assignment is a memmove).
            self._view[:have] = self._view[self._start : self._end]
            self._start, self._end = 0, have
        while self._end - self._start < n:
            if self._recv_into is not None:
                got = await self._recv_into(self._view[self._end :])
            else:
                data = await self.stream.receive_some(len(self._buf) - self._end)
                got = len(data)
                self._view[self._end : self._end + got] = data
            if got == 0:
                raise EOFError("peer closed the connection")
            self._end += got

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
        """Send ``chunks`` back to back."""
        if self._sock is None:
            if len(chunks) == 1 or sum(len(c) for c in chunks) < 65536:
                await self.stream.send_all(b"".join(chunks))
            else:
                for c in chunks:
                    await self.stream.send_all(c)
            return
        views = [memoryview(c) for c in chunks]
        while views:
            sent = await self._sock.sendmsg(views)
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
