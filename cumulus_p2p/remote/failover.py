"""Failover's sans-IO parts: the replay log, the checkpoint policy and the transfer plans.

Theory of operation
-------------------
The client names every storage itself and the executor runs the op stream
deterministically (a CPU executor even draws CPU's own random stream). So the executor's
state after batch ``n`` is a function of the batches up to ``n``, and a session can be
rebuilt anywhere from

- a *checkpoint* taken after some batch ``c`` (``checkpoint.py``: every live storage's
  bytes under its handle, plus the RNG state), and
- the *replay log*: every frame sent after ``c``, kept verbatim.

When the host vanishes, the client (``client.py``) dials a new one through the consumer's
``reconnect`` callable, uploads the checkpoint with ``@restore`` and ``@rng`` records,
sends the logged frames again (reading and discarding the replies to those that asked
something, except the one it was waiting for) and carries on. If it dials the *same* host
and that host kept the session in its cache (``hostcache.py``), it presents the session
token instead and resends only what the host never ran: nothing is uploaded.

A checkpoint resets the log, so the log's size is bounded by what the stream sends
between two checkpoints; ``CheckpointPolicy`` forces one when the log grows past
``max_log_bytes``. Checkpoints are taken at sync points only (the client is waiting for a
reply anyway), once ``interval`` seconds have passed since the previous one.

Nothing here does I/O or reads the clock.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .._errors import RemoteProtocolError
from .checkpoint import Checkpoint, StorageImage
from .protocol import CpuTensorRef

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


class ReplayLog:
    """Every frame sent since the latest checkpoint, in order, byte for byte."""

    def __init__(self) -> None:
        self.after_seq = 0  # the checkpoint's batch; 0 is the empty session
        self.nbytes = 0
        self._frames: list[LoggedFrame] = []

    def record(self, seq: int, parts: list, has_query: bool) -> bytes:
        """Log a frame about to be sent; returns it as one buffer to send.

        The parts are joined (copied) because inline tensors may point at the caller's
        memory, which it is free to reuse once the op returns.
        """
        frame = b"".join(parts)
        self._frames.append(LoggedFrame(seq, frame, has_query))
        self.nbytes += len(frame)
        return frame

    def since(self, seq: int) -> list[LoggedFrame]:
        """The logged frames after batch ``seq``, oldest first."""
        return [f for f in self._frames if f.seq > seq]

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
    log_frames: int
    log_bytes: int


# --- taking a checkpoint -----------------------------------------------------------------


@dataclass(frozen=True)
class Manifest:
    """The executor's answer to a ``checkpoint`` query: what to read, and the RNG state."""

    device: str
    rng_state: memoryview
    storages: tuple[tuple[int, torch.dtype, int], ...]  # handle, dtype, nbytes


def parse_manifest(result: Any, blobs: list[memoryview]) -> Manifest:
    """Validate a ``checkpoint`` reply. The host is not trusted to send a sane one.

    Raises:
        RemoteProtocolError: the reply is not a manifest.
    """
    if not (isinstance(result, dict) and isinstance(result.get("storages"), list)):
        raise RemoteProtocolError("checkpoint reply must be a map with a storage list")
    device = result.get("device")
    if not isinstance(device, str) or len(blobs) != 1:
        raise RemoteProtocolError("checkpoint reply needs a device name and one RNG blob")
    storages = []
    for entry in result["storages"]:
        ok = isinstance(entry, list) and len(entry) == 3
        if not ok or type(entry[0]) is not int or not isinstance(entry[1], torch.dtype):
            raise RemoteProtocolError(f"bad storage entry in a checkpoint reply: {entry!r}")
        if type(entry[2]) is not int or entry[2] < 0:
            raise RemoteProtocolError(f"bad storage size in a checkpoint reply: {entry!r}")
        storages.append((entry[0], entry[1], entry[2]))
    return Manifest(device, blobs[0], tuple(storages))


def plan_reads(manifest: Manifest, *, budget: int = TRANSFER_CHUNK) -> list[list[list[int]]]:
    """Split the storages' bytes into ``read`` queries of at most ``budget`` bytes each.

    Each query is a list of ``[handle, start, length]``; a storage larger than ``budget``
    spans several queries.
    """
    queries: list[list[list[int]]] = []
    current: list[list[int]] = []
    size = 0
    for handle, _dtype, nbytes in manifest.storages:
        for start in range(0, nbytes, budget):
            length = min(budget, nbytes - start)
            if current and size + length > budget:
                queries.append(current)
                current, size = [], 0
            current.append([handle, start, length])
            size += length
    if current:
        queries.append(current)
    return queries


class ImageAssembler:
    """Collects ``read`` replies into the storages' images.

    A storage read in one piece keeps that piece (a view of its reply frame); one read in
    several is copied, piece by piece, into a buffer of its size made at its first piece,
    so taking a checkpoint holds the checkpoint plus one reply, never a storage twice.
    """

    def __init__(self, manifest: Manifest) -> None:
        self._manifest = manifest
        self._sizes = {h: n for h, _, n in manifest.storages}
        self._images: dict[int, memoryview] = {}
        self._filled: dict[int, int] = dict.fromkeys(self._sizes, 0)

    def add(self, query: list[list[int]], blobs: list[memoryview]) -> None:
        """Take one ``read`` reply. Raises ``RemoteProtocolError`` if it does not match."""
        if len(blobs) != len(query):
            raise RemoteProtocolError("read reply has the wrong number of blobs")
        for (handle, start, length), blob in zip(query, blobs, strict=True):
            if len(blob) != length or start != self._filled[handle]:
                raise RemoteProtocolError(f"read of storage {handle} returned the wrong size")
            if start == 0 and length == self._sizes[handle]:
                self._images[handle] = blob
            else:
                if start == 0:
                    self._images[handle] = memoryview(bytearray(self._sizes[handle]))
                self._images[handle][start : start + length] = blob
            self._filled[handle] = start + length

    def checkpoint(self, seq: int) -> Checkpoint:
        images = []
        for handle, dtype, nbytes in self._manifest.storages:
            if self._filled[handle] != nbytes:
                raise RemoteProtocolError(f"storage {handle} was not read in full")
            data = self._images.get(handle, memoryview(b""))
            images.append(StorageImage(handle, dtype, data))
        return Checkpoint(seq, self._manifest.device, self._manifest.rng_state, tuple(images))


# --- restoring a checkpoint --------------------------------------------------------------


def restore_batches(
    checkpoint: Checkpoint, *, with_rng: bool, budget: int = TRANSFER_CHUNK
) -> Iterator[tuple[list, list[memoryview]]]:
    """The op records and blobs that rebuild ``checkpoint`` in a fresh session, per frame.

    Each storage becomes one ``@restore`` record per piece of at most ``budget`` bytes (an
    empty storage still gets one, so its handle exists); ``@rng`` comes last.
    """
    ops: list = []
    blobs: list[memoryview] = []
    size = 0
    for image in checkpoint.storages:
        for start in range(0, max(image.nbytes, 1), budget):
            piece = image.data[start : start + budget]
            if ops and size + len(piece) > budget:
                yield ops, blobs
                ops, blobs, size = [], [], 0
            ops.append(_restore_record(image, start, piece, len(blobs)))
            blobs.append(piece)
            size += len(piece)
    if with_rng:
        rng = checkpoint.rng_state
        ops.append(["@rng", [CpuTensorRef(torch.uint8, (len(rng),), len(blobs))], {}, None])
        blobs.append(rng)
    yield ops, blobs


def _restore_record(image: StorageImage, start: int, piece: memoryview, blob: int) -> list:
    data = CpuTensorRef(torch.uint8, (len(piece),), blob)
    return ["@restore", [image.handle, image.dtype, image.nbytes, start, data], {}, None]
