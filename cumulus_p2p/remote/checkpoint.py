"""Checkpoints of a remote session, and where the consumer keeps them.

A checkpoint is an executor's state at one point of the op stream (right after batch
``seq``): the bytes of every live storage under the handle the client gave it, and the
state of the session's random number generator. Handles are client-assigned and the op
stream is deterministic, so that is all a fresh executor needs to carry on exactly where
the old one stopped; ``failover.py`` replays the frames sent since.

Where it is kept is the consumer's choice, behind ``CheckpointStore``: its own memory
(``MemoryCheckpointStore``, the default) or a directory on its disk
(``DirectoryCheckpointStore``), which keeps the consumer's memory free and is read back
through ``mmap`` so a restore uploads straight from the page cache.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import msgpack
import torch

from .._errors import CheckpointCorruptError
from .protocol import DTYPE_CODE, DTYPES

_MAGIC = b"CUMCKPT1"
_U32 = struct.Struct("<I")


@dataclass(frozen=True)
class StorageImage:
    """The bytes of one remote storage. ``dtype`` is the element type it was created with."""

    handle: int
    dtype: torch.dtype
    data: memoryview

    @property
    def nbytes(self) -> int:
        return len(self.data)


@dataclass(frozen=True)
class Checkpoint:
    """A session's executor state after batch ``seq``.

    ``device`` names the executor device the RNG state belongs to (``"cpu"``,
    ``"cuda:0"``): a generator state only fits a generator of the same kind.
    """

    seq: int
    device: str
    rng_state: memoryview
    storages: tuple[StorageImage, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data in the checkpoint."""
        return sum(image.nbytes for image in self.storages)


class CheckpointStore(Protocol):
    """Where a session keeps its latest checkpoint. Only the latest one is ever needed."""

    def save(self, checkpoint: Checkpoint) -> None:
        """Keep ``checkpoint``, replacing the previous one."""

    def load(self) -> Checkpoint | None:
        """The checkpoint last saved, or None if there is none.

        Raises:
            CheckpointCorruptError: the stored checkpoint cannot be read back.
        """


class MemoryCheckpointStore:
    """Keeps the latest checkpoint in the consumer's memory (the default)."""

    def __init__(self) -> None:
        self._latest: Checkpoint | None = None

    def save(self, checkpoint: Checkpoint) -> None:
        self._latest = checkpoint

    def load(self) -> Checkpoint | None:
        return self._latest


class DirectoryCheckpointStore:
    """Keeps the latest checkpoint as one file in ``directory`` on the consumer's disk.

    Args:
        directory: created if missing. One session per ``name`` in a directory.
        name: the file's name, so several sessions can share a directory.
    """

    def __init__(self, directory: str | os.PathLike, *, name: str = "session") -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / f"{name}.cumulus-checkpoint"

    def save(self, checkpoint: Checkpoint) -> None:
        header = msgpack.packb(
            {
                "seq": checkpoint.seq,
                "device": checkpoint.device,
                "rng": len(checkpoint.rng_state),
                "storages": [
                    [s.handle, DTYPE_CODE[s.dtype], s.nbytes] for s in checkpoint.storages
                ],
            }
        )
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "wb") as out:
            out.write(_MAGIC + _U32.pack(len(header)) + header)
            out.write(checkpoint.rng_state)
            for image in checkpoint.storages:
                out.write(image.data)
        # No fsync: the replay log lives in this process's memory, so a checkpoint only has
        # to outlive the executor, not the consumer. The rename keeps the file whole.
        os.replace(tmp, self.path)

    def load(self) -> Checkpoint | None:
        if not self.path.exists():
            return None
        with open(self.path, "rb") as src:
            size = os.fstat(src.fileno()).st_size
            if size < len(_MAGIC) + _U32.size:
                raise CheckpointCorruptError(f"{self.path} is too short to be a checkpoint")
            view = memoryview(mmap.mmap(src.fileno(), 0, access=mmap.ACCESS_READ))
        return _parse(view, self.path)


def _parse(view: memoryview, path: Path) -> Checkpoint:
    if bytes(view[: len(_MAGIC)]) != _MAGIC:
        raise CheckpointCorruptError(f"{path} is not a cumulus checkpoint")
    (hlen,) = _U32.unpack_from(view, len(_MAGIC))
    start = len(_MAGIC) + _U32.size
    try:
        header = msgpack.unpackb(view[start : start + hlen])
        seq, device, rng_len = header["seq"], header["device"], header["rng"]
        if not (type(seq) is int and type(rng_len) is int and rng_len >= 0):
            raise ValueError("bad seq or rng length")
        table = [_entry(*entry) for entry in header["storages"]]
    except Exception as exc:  # any malformed header is the same diagnosis
        raise CheckpointCorruptError(f"{path} has a damaged header: {exc}") from exc
    pos = start + hlen
    if pos + rng_len + sum(n for _, _, n in table) != len(view):
        raise CheckpointCorruptError(f"{path} is truncated or has trailing bytes")
    rng, pos = view[pos : pos + rng_len], pos + rng_len
    images = []
    for handle, dtype, nbytes in table:
        images.append(StorageImage(handle, dtype, view[pos : pos + nbytes]))
        pos += nbytes
    return Checkpoint(seq, device, rng, tuple(images))


def _entry(handle: int, code: int, nbytes: int) -> tuple[int, torch.dtype, int]:
    if not all(type(v) is int for v in (handle, code, nbytes)) or nbytes < 0:
        raise ValueError("bad storage entry")
    if not 0 <= code < len(DTYPES):
        raise ValueError(f"unknown dtype code {code}")
    return handle, DTYPES[code], nbytes
