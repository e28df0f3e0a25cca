"""What a native session keeps to rebuild itself on another host: every batch it sent.

Every batch since the last checkpoint (``checkpoint``), or since its hello before the
first, in order, uploads included: a failover replays them on a fresh executor. The
replay is deterministic (the executor's ops are, given the same inputs, and the
session's generator starts from the same seed), so the new host ends up holding the
storages the lost one held, and the session goes on from the batch that was in flight.

The log costs the client memory: it is bounded (``limit_bytes``). A session whose
batches outgrow it drops the log and can no longer move; ``lost_because`` says so.
Sans-IO: bytes in, bytes out.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..wire import native as wire

#: Bytes of batches kept for a failover, by default: a small model's upload and some
#: thousands of steps of a tiny one.
DEFAULT_LIMIT_BYTES = 256 * 1024**2


class ReplayLog:
    """The batches a session sent, in order, while they fit in ``limit_bytes``."""

    def __init__(self, limit_bytes: int = DEFAULT_LIMIT_BYTES) -> None:
        self.limit_bytes = limit_bytes
        self._frames: list[list[bytes]] | None = []
        #: Where the executor counted each batch among the BATCH requests it received.
        self._counted: list[int] = []
        self.nbytes = 0
        self._cut = 0  # batches dropped from the front: the marks count from the start

    @property
    def lost_because(self) -> str | None:
        """Why the session cannot be replayed elsewhere, or None while it can."""
        if self._frames is not None:
            return None
        return f"its batches outgrew the {self.limit_bytes} bytes kept to replay it on another host"

    def keep(
        self, names: Sequence[str], batch: bytes, counted: int = 0, kind: int = wire.BATCH
    ) -> None:
        """Add a batch sent as the executor's ``counted``-th batch request (and the op
        names it introduced), to be sent again as a request of ``kind`` (BATCH, or NAMED
        with its uploads inline); past the limit, drop all."""
        if self._frames is None:
            return
        frame = wire.request(kind, names, batch, reply=False)
        self.nbytes += sum(len(part) for part in frame)
        if self.nbytes > self.limit_bytes:
            self._frames = None
            return
        self._frames.append(frame)
        self._counted.append(counted)

    def mark(self) -> int:
        """Where the log stands now, for ``cut``: a checkpoint whose copy to a standby is
        under way stands only once the copy is done."""
        return 0 if self._frames is None else self._cut + len(self._frames)

    def cut(self, mark: int) -> None:
        """Drop the batches sent before ``mark`` (a checkpoint now holds them)."""
        if self._frames is None:
            return
        dropped, self._frames = self._frames[: mark - self._cut], self._frames[mark - self._cut :]
        self._counted = self._counted[mark - self._cut :]
        self._cut = mark
        self.nbytes -= sum(len(part) for frame in dropped for part in frame)

    def frames(self, first: int = 0) -> list[list[bytes]]:
        """The kept batches as requests that ask for no reply, oldest first (a copy), to
        send a fresh executor, which counts them from ``first`` on.

        Raises:
            ValueError: the log was dropped (``lost_because``).
        """
        if self._frames is None:
            raise ValueError(self.lost_because)
        self._counted = list(range(first, first + len(self._frames)))
        return list(self._frames)

    def unreceived(self, received: int) -> list[list[bytes]]:
        """The kept batches an executor that received ``received`` BATCH requests lacks,
        oldest first: what a resumed session sends again (it counts them on from there).

        Raises:
            ValueError: the log was dropped (``lost_because``).
        """
        if self._frames is None:
            raise ValueError(self.lost_because)
        return [f for f, n in zip(self._frames, self._counted, strict=True) if n >= received]

    @property
    def last_counted(self) -> int | None:
        """Where the executor counts the last kept batch (None: none kept)."""
        return self._counted[-1] if self._frames and self._counted else None
