"""Failover's sans-IO parts: the replay log, the checkpoint policy and the transfer plans.

Theory of operation
-------------------
The client names every storage itself and the executor runs the op stream
deterministically (a CPU executor even draws CPU's own random stream). So the executor's
state after batch ``n`` is a function of the batches up to ``n``, and a session can be
rebuilt anywhere from

- a *checkpoint* taken after some batch ``c`` (``checkpoint.py``: every live storage's
  bytes under its handle, plus the RNG state), named piece by piece: the executor's
  manifest gives each storage's ``blobs.PIECE`` digests, and the client reads only the
  pieces its store does not hold (from the last checkpoint, or an upload that filled a
  storage), checking each against its digest; and
- the *replay log*: every frame sent after ``c``, kept verbatim.

When the host vanishes, the client (``client.py``) dials a new one through the consumer's
``reconnect`` callable, uploads the checkpoint with ``@restore`` and ``@rng`` records (or,
when a standby holds it, sends the manifest and the new host pulls the pieces from the
standby: ``blobs/standby.py``), sends the logged frames again (reading and discarding the
replies to those that asked something, except the one it was waiting for) and carries
on. If it dials the *same* host and that host kept the session in its cache
(``hostcache.py``), it presents the session token instead and resends only what the host
never ran: nothing is uploaded.

A checkpoint resets the log (a standby's, once the standby holds it), so the log's size
is bounded by what the stream sends between two checkpoints; ``CheckpointPolicy`` forces
one when the log grows past ``max_log_bytes``. Checkpoints are taken at sync points only
(the client is waiting for a reply anyway), once ``interval`` seconds have passed since
the previous one.

Nothing here does I/O or reads the clock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from .._errors import RemoteProtocolError
from ..blobs.names import PIECE, digest
from ..wire.manifest import Manifest
from ..wire.protocol import CpuTensorRef
from .checkpoint import Checkpoint, StorageImage

#: Replay log size past which a checkpoint is taken at the next batch, sync point or not.
DEFAULT_MAX_LOG_BYTES = 256 * 1024 * 1024
#: Bytes of tensor data moved per frame while taking or restoring a checkpoint.
TRANSFER_CHUNK = 32 * 1024 * 1024


@dataclass(frozen=True)
class LoggedFrame:
    """One frame sent after the latest checkpoint. ``has_query`` frames get a reply."""

    seq: int
    frame: bytes
    has_query: bool
    #: Bytes its collectives have the host carry to other hosts (counted again on replay).
    peer_bytes: int = 0


class ReplayLog:
    """Every frame sent since the latest checkpoint, in order, byte for byte."""

    def __init__(self) -> None:
        self.after_seq = 0  # the checkpoint's batch; 0 is the empty session
        self.nbytes = 0
        self._frames: list[LoggedFrame] = []

    def record(self, seq: int, parts: list, has_query: bool, peer_bytes: int = 0) -> bytes:
        """Log a frame about to be sent; returns it as one buffer to send. ``peer_bytes``:
        what its collectives have the host carry to other hosts.

        The parts are joined (copied) because inline tensors may point at the caller's
        memory, which it is free to reuse once the op returns.
        """
        frame = b"".join(parts)
        self._frames.append(LoggedFrame(seq, frame, has_query, peer_bytes))
        self.nbytes += len(frame)
        return frame

    def since(self, seq: int) -> list[LoggedFrame]:
        """The logged frames after batch ``seq``, oldest first."""
        return [f for f in self._frames if f.seq > seq]

    def peer_bytes_since(self, seq: int) -> int:
        """The peer bytes of the logged frames after batch ``seq``."""
        return sum(f.peer_bytes for f in self._frames if f.seq > seq)

    def reset(self, seq: int) -> None:
        """A checkpoint was taken after batch ``seq``: forget the frames it covers."""
        self._frames = self.since(seq)
        self.nbytes = sum(len(f.frame) for f in self._frames)
        self.after_seq = seq

    def __len__(self) -> int:
        return len(self._frames)


@dataclass
class CheckpointPolicy:
    """When to take the next checkpoint.

    Args:
        interval: seconds between checkpoints, taken at the first sync point after that;
            0 means at every sync point, None means only when the log is full (or on demand).
        max_log_bytes: a replay log this large forces a checkpoint at the next batch.
        last: when the previous checkpoint was taken (the session start, at first).
    """

    interval: float | None
    max_log_bytes: int = DEFAULT_MAX_LOG_BYTES
    last: float = 0.0

    def __post_init__(self) -> None:
        if self.interval is not None and not self.interval >= 0:
            raise ValueError(f"checkpoint_interval must be >= 0 seconds, got {self.interval!r}")
        if self.max_log_bytes <= 0:
            raise ValueError("max_log_bytes must be positive")

    def due(self, *, now: float, log_bytes: int, at_sync_point: bool) -> bool:
        if log_bytes >= self.max_log_bytes:
            return True
        if self.interval is None or not at_sync_point or log_bytes == 0:
            return False
        return now - self.last >= self.interval

    def taken(self, *, now: float) -> None:
        self.last = now


@dataclass(frozen=True)
class FailoverStatistics:
    """What failover has done for a session so far."""

    failovers: int
    cache_resumes: int
    cold_restores: int
    last_failover_s: float | None
    checkpoints: int
    last_checkpoint_s: float | None
    checkpoint_bytes: int
    #: Of ``checkpoint_bytes``, what the last checkpoint read from the host: the pieces
    #: its store did not hold already.
    checkpoint_read_bytes: int
    log_frames: int
    log_bytes: int
    #: Checkpoints the standby finished copying, and what the last copy fetched (only the
    #: pieces it lacked) and took (seconds; the session trained on meanwhile).
    replicated_checkpoints: int = 0
    last_replication_bytes: int = 0
    last_replication_s: float | None = None
    #: Bytes the new host pulled from other hosts for the last failover's restore, and
    #: the seconds that took (of ``last_failover_s``).
    restore_pulled_bytes: int = 0
    restore_pull_s: float | None = None
    #: Of the last failover: seconds to reach a new host (a lease, a dial), and seconds
    #: to replay the log since the checkpoint (a cold restore's recomputed steps).
    reconnect_s: float | None = None
    replay_s: float | None = None


# --- taking a checkpoint -----------------------------------------------------------------


def plan_reads(
    manifest: Manifest, held: Callable[[str], bool], *, budget: int = TRANSFER_CHUNK
) -> list[list[list[int]]]:
    """Split the bytes of the pieces not ``held`` into ``read`` queries of at most
    ``budget`` bytes each.

    Each query is a list of ``[handle, start, length]``; a piece larger than ``budget``
    spans several queries, and no range crosses a piece's end.
    """
    queries: list[list[list[int]]] = []
    current: list[list[int]] = []
    size = 0
    for entry in manifest.storages:
        for index, name in enumerate(entry.digests):
            if held(name):
                continue
            piece_start = index * PIECE
            piece_end = min(piece_start + PIECE, entry.nbytes)
            for start in range(piece_start, piece_end, budget):
                length = min(budget, piece_end - start)
                if current and size + length > budget:
                    queries.append(current)
                    current, size = [], 0
                current.append([entry.handle, start, length])
                size += length
    if current:
        queries.append(current)
    return queries


class ImageAssembler:
    """Builds a checkpoint's images from the pieces a store holds and ``read`` replies.

    A held piece is the store's own bytes, never copied. A piece read in one range keeps
    that range (a view of its reply frame); one read in several is copied into a buffer
    of its size made at its first range. Every piece read is checked against its digest.
    """

    def __init__(self, manifest: Manifest, known: Callable[[str], memoryview | None]) -> None:
        self._manifest = manifest
        self._pieces: dict[tuple[int, int], memoryview] = {}
        self._filled: dict[tuple[int, int], int] = {}
        self._names = {e.handle: e.digests for e in manifest.storages}
        self._sizes = {e.handle: e.nbytes for e in manifest.storages}
        self._held: set[str] = set()
        for entry in manifest.storages:
            for index, name in enumerate(entry.digests):
                held = known(name)
                if held is not None and len(held) == min(PIECE, entry.nbytes - index * PIECE):
                    self._pieces[entry.handle, index] = held
                    self._held.add(name)

    def holds(self, name: str) -> bool:
        """Whether the piece ``name`` came from the store (and needs no read)."""
        return name in self._held

    def add(self, query: list[list[int]], blobs: list[memoryview]) -> None:
        """Take one ``read`` reply.

        Raises:
            RemoteProtocolError: it does not match the query, or a piece's bytes do not
                match its digest.
        """
        if len(blobs) != len(query):
            raise RemoteProtocolError("read reply has the wrong number of blobs")
        for (handle, start, length), blob in zip(query, blobs, strict=True):
            index, offset = divmod(start, PIECE)
            key = (handle, index)
            size = min(PIECE, self._sizes[handle] - index * PIECE)
            if len(blob) != length or offset != self._filled.get(key, 0):
                raise RemoteProtocolError(f"read of storage {handle} returned the wrong size")
            if offset == 0 and length == size:
                self._pieces[key] = blob
            else:
                if offset == 0:
                    self._pieces[key] = memoryview(bytearray(size))
                self._pieces[key][offset : offset + length] = blob
            self._filled[key] = offset + length
            if (
                self._filled[key] == size
                and digest(self._pieces[key]) != self._names[handle][index]
            ):
                raise RemoteProtocolError(f"storage {handle}'s bytes do not match their digest")

    def checkpoint(self, seq: int) -> Checkpoint:
        images = []
        for entry in self._manifest.storages:
            try:
                pieces = tuple(self._pieces[entry.handle, i] for i in range(len(entry.digests)))
            except KeyError:
                raise RemoteProtocolError(f"storage {entry.handle} was not read in full") from None
            if any(
                self._filled.get((entry.handle, i), len(p)) != len(p) for i, p in enumerate(pieces)
            ):
                raise RemoteProtocolError(f"storage {entry.handle} was not read in full")
            images.append(StorageImage(entry.handle, entry.dtype, pieces, entry.digests))
        return Checkpoint(seq, self._manifest.device, self._manifest.rng_state, tuple(images))


# --- restoring a checkpoint --------------------------------------------------------------


def restore_batches(
    checkpoint: Checkpoint,
    *,
    with_rng: bool,
    budget: int = TRANSFER_CHUNK,
    held: frozenset[str] = frozenset(),
) -> Iterator[tuple[list, list[memoryview]]]:
    """The op records and blobs that rebuild ``checkpoint`` in a fresh session, per frame.

    Each storage becomes one ``@restore`` record per piece of at most ``budget`` bytes (an
    empty storage still gets one, so its handle exists); ``@rng`` comes last. A whole
    piece whose digest is in ``held`` (the host's store has it: ``have``) is named
    instead of sent.
    """
    ops: list = []
    blobs: list[memoryview] = []
    size = 0
    for image in checkpoint.storages:
        for start, piece, name in _ranges(image, budget, held):
            if ops and size + len(piece) > budget:
                yield ops, blobs
                ops, blobs, size = [], [], 0
            if name is not None:
                ops.append(_restore_record(image, start, name))
                continue
            data = CpuTensorRef(torch.uint8, (len(piece),), len(blobs))
            ops.append(_restore_record(image, start, data))
            blobs.append(piece)
            size += len(piece)
    if with_rng:
        ops.append(rng_record(checkpoint.rng_state, len(blobs)))
        blobs.append(checkpoint.rng_state)
    yield ops, blobs


def rng_record(rng_state: memoryview, blob: int) -> list:
    """The ``@rng`` record that sets a restored session's generator to ``rng_state``, the
    frame's blob number ``blob``."""
    return ["@rng", [CpuTensorRef(torch.uint8, (len(rng_state),), blob)], {}, None]


def _ranges(
    image: StorageImage, budget: int, held: frozenset[str]
) -> Iterator[tuple[int, memoryview, str | None]]:
    """``(start, bytes, name)`` of an image in ranges of at most ``budget`` bytes, ``name``
    set (and the bytes to send empty) for a whole piece in ``held``; an empty storage
    still has one (empty) range, so its handle exists."""
    if not image.pieces:
        yield 0, memoryview(b""), None
    for index, (piece, name) in enumerate(zip(image.pieces, image.digests, strict=True)):
        if name in held:
            yield index * PIECE, memoryview(b""), name
            continue
        for offset in range(0, len(piece), budget):
            yield index * PIECE + offset, piece[offset : offset + budget], None


def _restore_record(image: StorageImage, start: int, data: CpuTensorRef | str) -> list:
    return ["@restore", [image.handle, image.dtype, image.nbytes, start, data], {}, None]
