"""Moving tensors of any size: the plan that cuts one into pieces, and progress reports.

Theory of operation
-------------------
A frame is capped (``DEFAULT_MAX_FRAME``, 256 MiB) so that neither side ever allocates
more than that for one message it has not checked. A tensor larger than ``STREAM_CHUNK``
therefore crosses in pieces, each an ordinary op or query the executor already validates:

- an upload is one ``copy_`` per piece, from the piece's bytes (a blob) into a view of the
  destination (a ``TensorRef`` the executor bounds-checks like any other), one frame each;
- a read is one ``fetch`` query per piece, the executor answering with that view's bytes
  only; it refuses a fetch larger than its per-reply limit (``session.MAX_READ_BYTES``).

``pieces`` cuts along the leading dimensions: as many whole rows as fit the budget, or, when
one row is itself too large, each row on its own, recursively. Every piece is then a plain
strided view of the tensor (sizes, strides, offset), which is what both the wire and the
local ``tensor[index]`` speak, whatever the tensor's layout.

Memory in flight is one piece per side: the client sends a piece and the executor copies
it into place before reading the next frame (TCP holds the sender back meanwhile); a read
waits for each piece before asking for the next. Neither side ever holds a second copy of
the tensor.

``TransferProgress`` decides when a long transfer deserves a status line; the client
prints it. Nothing here does I/O or reads the clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

#: Bytes per piece of a streamed upload or read: a few round trips' worth on a fast link,
#: a second or two on a home uplink, and well inside any frame limit.
STREAM_CHUNK = 16 * 1024 * 1024
#: Seconds between two progress lines of one transfer; shorter transfers print none.
PROGRESS_INTERVAL = 2.0


class Piece(NamedTuple):
    """One piece of a tensor: ``index`` selects it locally (``tensor[index]``); ``sizes``,
    ``strides`` and ``offset`` (in elements, of the whole storage) name it on the wire."""

    index: tuple
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int


def pieces(sizes, strides, offset: int, itemsize: int, budget: int) -> Iterator[Piece]:
    """Cut a strided tensor into views of at most ``budget`` bytes each (one element at
    least), in order, covering every element once.

    Args:
        sizes, strides, offset: the tensor's layout, in elements.
        itemsize: bytes per element (the larger of both sides' when they differ).
        budget: most bytes per piece.
    """
    sizes, strides = tuple(sizes), tuple(strides)
    if math.prod(sizes) * itemsize <= budget or not sizes:
        yield Piece((), sizes, strides, offset)
        return
    yield from _split(sizes, strides, offset, itemsize, budget, ())


def _split(sizes, strides, offset, itemsize, budget, prefix) -> Iterator[Piece]:
    row = math.prod(sizes[1:]) * itemsize  # bytes of one index along the first dimension
    if row <= budget or len(sizes) == 1:
        rows = max(1, budget // max(row, 1))
        for start in range(0, sizes[0], rows):
            count = min(rows, sizes[0] - start)
            index = (*prefix, slice(start, start + count))
            yield Piece(index, (count, *sizes[1:]), strides, offset + start * strides[0])
        return
    for i in range(sizes[0]):
        yield from _split(
            sizes[1:], strides[1:], offset + i * strides[0], itemsize, budget, (*prefix, i)
        )


@dataclass
class TransferProgress:
    """How far one transfer has come, and whether it is time to say so.

    Args:
        what: what moves, for the status line ("upload", "read", "checkpoint"...).
        total: bytes to move.
        started: when it started (any monotonic clock; the caller passes ``now`` after).
        interval: seconds between two status lines.
    """

    what: str
    total: int
    started: float
    interval: float = PROGRESS_INTERVAL
    done: int = 0
    reported: bool = False
    _last: float | None = None

    def advance(self, nbytes: int, *, now: float) -> bool:
        """Count ``nbytes`` more moved; True when a status line is due.

        The first line comes ``interval`` seconds in, then one per interval, and a last one
        at the end of a transfer that printed any.
        """
        self.done += nbytes
        last = self.started if self._last is None else self._last
        finished = self.done >= self.total
        if now - last >= self.interval or (finished and self.reported):
            self._last = now
            self.reported = True
            return True
        return False

    def line(self, *, now: float) -> str:
        """The status line: bytes moved of the total, percent, rate, and time so far."""
        elapsed = max(now - self.started, 1e-9)
        percent = 100.0 * self.done / self.total if self.total else 100.0
        rate = self.done / elapsed / 1e6
        return (
            f"cumulus: {self.what}: {_mib(self.done)} of {_mib(self.total)} MiB "
            f"({percent:.0f}%), {rate:.1f} MB/s, {elapsed:.1f} s"
        )


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f}"
