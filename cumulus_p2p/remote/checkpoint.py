"""Checkpoints of a remote session, and where the consumer keeps them.

A checkpoint is an executor's state at one point of the op stream (right after batch
``seq``): the bytes of every live storage under the handle the client gave it, and the
state of the session's random number generator. Handles are client-assigned and the op
stream is deterministic, so that is all a fresh executor needs to carry on exactly where
the old one stopped; ``failover.py`` replays the frames sent since.

Storages are kept as pieces of ``blobs.PIECE`` bytes, each named by its digest, and a store
answers for any piece it holds (``CheckpointStore.piece``). The executor names the pieces
of every storage when a checkpoint is taken, and the client reads only those its store
lacks: a frozen base model, or any storage unchanged since the last checkpoint, crosses
the consumer's link once.

Where it is kept is the consumer's choice, behind ``CheckpointStore``: its own memory
(``MemoryCheckpointStore``, the default) or a directory on its disk
(``DirectoryCheckpointStore``), which keeps the consumer's memory free, is read back
through ``mmap`` so a restore uploads straight from the page cache, and keeps its pieces
for the next session that uses the directory.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import msgpack
import torch

from .._errors import CheckpointCorruptError
from ..blobs.names import PIECE, digest, is_digest, piece_count
from ..wire.protocol import DTYPE_CODE, DTYPES

_MAGIC = b"CUMCKPT2"


@dataclass(frozen=True)
class StorageImage:
    """The bytes of one remote storage, as its pieces and their digests. ``dtype`` is the
    element type it was created with."""

    handle: int
    dtype: torch.dtype
    pieces: tuple[memoryview, ...]
    digests: tuple[str, ...]

    @classmethod
    def of(cls, handle: int, dtype: torch.dtype, data) -> StorageImage:
        """An image of ``data`` (any buffer), cut into pieces and named here."""
        view = memoryview(data).cast("B")
        pieces = tuple(view[start : start + PIECE] for start in range(0, len(view), PIECE))
        return cls(handle, dtype, pieces, tuple(digest(p) for p in pieces))

    @property
    def nbytes(self) -> int:
        return sum(len(p) for p in self.pieces)

    def tobytes(self) -> bytes:
        """The storage's bytes in one piece (a copy)."""
        return b"".join(self.pieces)


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

    def piece(self, name: str) -> memoryview | None:
        """The bytes of the piece named ``name``, if this store holds them."""

    def offer(self, name: str, data: memoryview) -> None:
        """Bytes the consumer has anyway (an upload's), named: kept until the next save,
        so that checkpoint need not read them back."""


class MemoryCheckpointStore:
    """Keeps the latest checkpoint in the consumer's memory (the default)."""

    def __init__(self) -> None:
        self._latest: Checkpoint | None = None
        self._pieces: dict[str, memoryview] = {}
        self._offered: dict[str, memoryview] = {}

    def save(self, checkpoint: Checkpoint) -> None:
        self._latest = checkpoint
        self._offered = {}
        self._pieces = {
            name: data
            for image in checkpoint.storages
            for name, data in zip(image.digests, image.pieces, strict=True)
        }

    def load(self) -> Checkpoint | None:
        return self._latest

    def piece(self, name: str) -> memoryview | None:
        return self._pieces.get(name) or self._offered.get(name)

    def offer(self, name: str, data: memoryview) -> None:
        # A copy: the caller's buffer may change after its upload returns.
        self._offered[name] = memoryview(bytes(data))


class DirectoryCheckpointStore:
    """Keeps the latest checkpoint in ``directory`` on the consumer's disk: each piece a
    file named by its digest under ``pieces/``, and a small manifest per session.

    Saving writes only the pieces the directory lacks, then replaces the manifest, then
    removes the pieces no manifest in the directory names: a write that fails (a full
    disk) leaves the previous checkpoint whole. Saves hold the directory's lock, since a
    session sharing the directory could otherwise collect a piece another one is about to
    name. Pieces are checked against their names when a checkpoint is loaded.

    Args:
        directory: created if missing. One session per ``name`` in a directory; sessions
            sharing a directory share its pieces.
        name: the manifest's name, so several sessions can share a directory.
        keep_others: when set, each save also removes all but the newest ``keep_others``
            manifests of other sessions (their pieces go with them), so a directory that
            every run of a script uses stays bounded: the previous run's pieces stay for
            the next, older ones go. A manifest saved within ``ACTIVE_S`` stays whatever
            its rank: a session still running rewrites its own at every checkpoint.
    """

    ACTIVE_S = 3600.0

    def __init__(
        self, directory: str | os.PathLike, *, name: str = "session", keep_others: int | None = None
    ) -> None:
        self.keep_others = keep_others
        self.directory = Path(directory)
        self.pieces_dir = self.directory / "pieces"
        self.pieces_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / f"{name}.cumulus-checkpoint"

    def save(self, checkpoint: Checkpoint) -> None:
        with open(self.directory / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            self._save(checkpoint)

    def _save(self, checkpoint: Checkpoint) -> None:
        for image in checkpoint.storages:
            for name, data in zip(image.digests, image.pieces, strict=True):
                self._write_piece(name, data)
        header = {
            "seq": checkpoint.seq,
            "device": checkpoint.device,
            "rng": bytes(checkpoint.rng_state),
            "storages": [
                [s.handle, DTYPE_CODE[s.dtype], s.nbytes, list(s.digests)]
                for s in checkpoint.storages
            ],
        }
        # No fsync: the replay log lives in this process's memory, so a checkpoint only has
        # to outlive the executor, not the consumer. The renames keep each file whole.
        _replace(self.path, _MAGIC + msgpack.packb(header))
        if self.keep_others is not None:
            self._prune_manifests(self.keep_others)
        self._collect_garbage()

    def load(self) -> Checkpoint | None:
        if not self.path.exists():
            return None
        seq, device, rng, table = _parse(self.path.read_bytes(), self.path)
        images = []
        for handle, dtype, nbytes, digests in table:
            pieces = tuple(self._checked_piece(name) for name in digests)
            if sum(len(p) for p in pieces) != nbytes:
                raise CheckpointCorruptError(f"{self.path}: storage {handle} has the wrong size")
            images.append(StorageImage(handle, dtype, pieces, tuple(digests)))
        return Checkpoint(seq, device, memoryview(rng), tuple(images))

    def piece(self, name: str) -> memoryview | None:
        path = self.pieces_dir / name
        if not is_digest(name) or not path.exists():
            return None
        return _mapped(path)

    def offer(self, name: str, data: memoryview) -> None:
        self._write_piece(name, data)

    def _write_piece(self, name: str, data: memoryview) -> None:
        path = self.pieces_dir / name
        if not path.exists():
            _replace(path, data)

    def _checked_piece(self, name: str) -> memoryview:
        path = self.pieces_dir / name
        if not path.exists():
            raise CheckpointCorruptError(f"{self.path}: piece {name} is missing")
        data = _mapped(path)
        if digest(data) != name:
            raise CheckpointCorruptError(f"{path} does not hold the bytes its name says")
        return data

    def _prune_manifests(self, keep: int) -> None:
        others = [m for m in self.directory.glob("*.cumulus-checkpoint") if m != self.path]
        saved = {m: m.stat().st_mtime for m in others}
        others.sort(key=saved.__getitem__, reverse=True)
        active_since = time.time() - self.ACTIVE_S
        for manifest in others[keep:]:
            if saved[manifest] < active_since:
                manifest.unlink(missing_ok=True)

    def _collect_garbage(self) -> None:
        named: set[str] = set()
        for manifest in self.directory.glob("*.cumulus-checkpoint"):
            try:
                _, _, _, table = _parse(manifest.read_bytes(), manifest)
            except (OSError, CheckpointCorruptError):
                return  # a manifest we cannot read may name anything: remove nothing
            named.update(name for *_, digests in table for name in digests)
        for path in self.pieces_dir.iterdir():
            if path.name not in named and is_digest(path.name):
                path.unlink(missing_ok=True)


def _replace(path: Path, data) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as out:
        out.write(data)
    os.replace(tmp, path)


def _mapped(path: Path) -> memoryview:
    with open(path, "rb") as src:
        if os.fstat(src.fileno()).st_size == 0:
            return memoryview(b"")
        return memoryview(mmap.mmap(src.fileno(), 0, access=mmap.ACCESS_READ))


def _parse(content: bytes, path: Path) -> tuple[int, str, bytes, list]:
    """A manifest's seq, device, RNG state and storage table."""
    if content[: len(_MAGIC)] != _MAGIC:
        raise CheckpointCorruptError(f"{path} is not a cumulus checkpoint")
    try:
        header = msgpack.unpackb(content[len(_MAGIC) :])
        seq, device, rng = header["seq"], header["device"], header["rng"]
        if not (type(seq) is int and isinstance(device, str) and isinstance(rng, bytes)):
            raise ValueError("bad seq, device or rng")
        table = [_entry(*entry) for entry in header["storages"]]
    except Exception as exc:  # any malformed manifest is the same diagnosis
        raise CheckpointCorruptError(f"{path} has a damaged manifest: {exc}") from exc
    return seq, device, rng, table


def _entry(handle, code, nbytes, digests) -> tuple[int, torch.dtype, int, list[str]]:
    if not all(type(v) is int for v in (handle, code, nbytes)) or nbytes < 0:
        raise ValueError("bad storage entry")
    if not 0 <= code < len(DTYPES):
        raise ValueError(f"unknown dtype code {code}")
    if not isinstance(digests, list) or len(digests) != piece_count(nbytes):
        raise ValueError(f"storage {handle} needs one digest per piece")
    if not all(is_digest(d) for d in digests):
        raise ValueError(f"storage {handle} has a malformed piece name")
    return handle, DTYPES[code], nbytes, digests
