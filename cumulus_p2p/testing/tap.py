"""A TCP forwarder on loopback that counts the bytes it carries: the consumer's link, metered
from outside the code under test."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass
class Tap:
    """Bytes carried so far through one forwarder, both ways together."""

    address: str
    _count: list[int] = field(default_factory=lambda: [0])
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def bytes(self) -> int:
        with self._lock:
            return self._count[0]

    def _add(self, n: int) -> None:
        with self._lock:
            self._count[0] += n


@contextlib.contextmanager
def tap(upstream: str) -> Iterator[Tap]:
    """Forward connections made to the yielded ``Tap.address`` to ``upstream`` (host:port).

    Its threads end when the block does: the listening socket and every connection are
    closed then.
    """
    host, _, port = upstream.rpartition(":")
    listener = socket.create_server(("127.0.0.1", 0))
    meter = Tap(f"127.0.0.1:{listener.getsockname()[1]}")
    sockets: list[socket.socket] = [listener]
    threads: list[threading.Thread] = []

    def pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(1 << 20):
                sink.sendall(data)
                meter._add(len(data))
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                inside, _ = listener.accept()
                outside = socket.create_connection((host, int(port)))
                sockets.extend((inside, outside))
                for a, b in ((inside, outside), (outside, inside)):
                    thread = threading.Thread(target=pump, args=(a, b), daemon=True)
                    threads.append(thread)
                    thread.start()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        yield meter
    finally:
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for thread in [acceptor, *threads]:
            thread.join(timeout=5)
