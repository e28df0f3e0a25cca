"""The link between the supervisor and one worker process: small messages, passed sockets.

A ``SOCK_SEQPACKET`` socket pair keeps message boundaries, so one message is one packet
and needs no framing of its own; ``SCM_RIGHTS`` carries a session's connected socket
across with the message that introduces it. Messages are msgpack arrays whose first
element names them (``worker.py`` and ``supervisor.py`` list theirs).

Both ends run trio. ``send_nowait`` exists because the executor hands its device turn
back from synchronous code; the messages are a few bytes and the other end reads without
pause, so a full socket buffer means that end is hung, and is reported as a lost link.
"""

from __future__ import annotations

import mmap
import os
import socket

import msgpack
import trio

__all__ = ["LinkClosedError", "TurnFlag", "WorkerLink", "MAX_MESSAGE"]

#: The largest message either end sends (a session's options, a device report).
MAX_MESSAGE = 64 * 1024


class LinkClosedError(Exception):
    """The other end of the link is gone (its process exited) or sent garbage."""


class WorkerLink:
    """One end of a supervisor–worker link, over a non-blocking ``SOCK_SEQPACKET`` socket."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self._sock = sock

    @classmethod
    def pair(cls) -> tuple[WorkerLink, socket.socket]:
        """This end, and the other end's raw socket to hand to a child process."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        theirs.set_inheritable(True)
        return cls(ours), theirs

    @classmethod
    def from_fd(cls, fd: int) -> WorkerLink:
        """The end a child process inherited as file descriptor ``fd``."""
        return cls(socket.socket(fileno=fd))

    def send_nowait(self, message: list, fd: int | None = None) -> None:
        """Send ``message`` (and ``fd``, duplicated into the receiver) without waiting.

        Raises:
            LinkClosedError: the other end is gone, or has stopped reading.
            ValueError: the message is larger than ``MAX_MESSAGE``.
        """
        data = msgpack.packb(message, use_bin_type=True)
        if len(data) > MAX_MESSAGE:
            raise ValueError(f"a {len(data)}-byte message; the link carries {MAX_MESSAGE} at most")
        try:
            if fd is None:
                self._sock.send(data)
            else:
                socket.send_fds(self._sock, [data], [fd])
        except BlockingIOError as exc:
            raise LinkClosedError("the other end of the worker link stopped reading") from exc
        except OSError as exc:
            raise LinkClosedError(f"the worker link is closed: {exc}") from exc

    async def send(self, message: list, fd: int | None = None) -> None:
        """Send ``message``, waiting for room if the socket buffer is full."""
        while True:
            try:
                self.send_nowait(message, fd)
                return
            except LinkClosedError as exc:
                if not isinstance(exc.__cause__, BlockingIOError):
                    raise
            await trio.lowlevel.wait_writable(self._sock)

    async def receive(self) -> tuple[list, int | None]:
        """The next message and the file descriptor that came with it (now ours to close).

        Raises:
            LinkClosedError: the other end closed the link, or sent something that is not
                a message.
        """
        while True:
            try:
                data, fds, _flags, _addr = socket.recv_fds(self._sock, MAX_MESSAGE, 1)
                break
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self._sock)
            except OSError as exc:
                raise LinkClosedError(f"the worker link is closed: {exc}") from exc
        fd = fds[0] if fds else None
        if not data:
            _close_fd(fd)
            raise LinkClosedError("the other end closed the worker link")
        try:
            message = msgpack.unpackb(data, raw=False)
        except ValueError as exc:
            _close_fd(fd)
            raise LinkClosedError(f"a malformed message on the worker link: {exc}") from exc
        if not (isinstance(message, list) and message and isinstance(message[0], str)):
            _close_fd(fd)
            raise LinkClosedError(f"a malformed message on the worker link: {message!r:.80}")
        return message, fd

    def close(self) -> None:
        """Close this end; the other end's next ``receive`` raises ``LinkClosedError``."""
        self._sock.close()


class TurnFlag:
    """A word of memory the supervisor and one worker share: set, it tells the worker to
    hand its device turn back before its next op.

    The worker reads it between every two ops, so it must cost next to nothing: a read of
    shared memory (under a microsecond from Python), where a message would wait for the worker's
    event loop, which an inline batch blocks. Each worker has a flag of its own (a
    ``memfd``), so a worker can only ever raise or clear its own.
    """

    def __init__(self, fd: int) -> None:
        self._map = mmap.mmap(fd, mmap.PAGESIZE)
        os.close(fd)
        self._word = memoryview(self._map).cast("Q")

    @classmethod
    def create(cls) -> tuple[TurnFlag, int]:
        """A new flag, and a descriptor on it for the worker to inherit (ours to close)."""
        fd = os.memfd_create("cumulus-turn", 0)
        os.ftruncate(fd, mmap.PAGESIZE)
        return cls(os.dup(fd)), fd

    def set(self) -> None:
        self._word[0] = 1

    def clear(self) -> None:
        self._word[0] = 0

    def is_set(self) -> bool:
        return self._word[0] != 0


def _close_fd(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)
