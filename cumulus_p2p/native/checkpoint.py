"""A native session's checkpoints: its storages' pieces, kept by the client. Sans-IO.

Theory of operation
-------------------
Without checkpoints a native session moves to another host by replaying every batch it
ever sent (``replaylog``), so a long session outgrows its log and cannot move. A
checkpoint bounds that: at a sync point the client asks the executor to name every live
storage's pieces (a DIGESTS request: a BLAKE3 digest per ``PIECE``), reads back only the
pieces it does not hold already (READBACK records of byte views), and the generator's
state (RNG_GET). The log then starts over: a move restores the checkpoint on the new
executor (ALLOC, then UPLOAD of each piece, then RNG_SET) and replays only the batches
sent since.

A piece unchanged since the last checkpoint (frozen weights, an embedding that is not
trained) has the same digest and is never read again, so a checkpoint costs the
consumer's link the bytes that changed. Each piece read is checked against the digest
the executor named; a piece that does not match is refused, not kept.

The pieces live in the client's memory, keyed by digest, or in a directory of its disk
(a ``BlobStore`` of its own: written atomically, checked against their names when read
back, so a piece damaged on disk fails the move with that reason instead of restoring
wrong bytes). Those the latest checkpoint does not name are dropped from memory when it is
taken; on disk they stay until room is needed, the directory holding at most the last
checkpoint's pieces and the next one's.

With a standby host (``blobs.standby``) the pieces stay on the host side: a KEEP
request names them as DIGESTS does, and the executor copies them for the standby to
pull (``host/kept.py``). The checkpoint counts (``StandbyCheckpoint``) once the standby
holds every piece; the client keeps the manifest, and the log is cut there. A move then
sends the fresh executor a RESTORE: it makes the storages and pulls their pieces from
the standby, host to host, so the consumer's link carries digests, not state.

This module plans and holds; ``session.py`` does the I/O.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .._errors import BlobMismatchError, MalformedMessageError
from ..blobs.names import PIECE, digest
from ..blobs.service import Source
from ..blobs.standby import HostCheckpoint
from ..blobs.store import BlobStore, PinnedBlob
from ..wire import native as wire
from ..wire.manifest import Manifest, StorageEntry
from . import records

#: Bytes of pieces one batch uploads or reads back, so that its frame (or its reply) stays
#: well under the channel's limit (256 MiB).
GROUP_BYTES = 64 * 1024**2


@dataclass(frozen=True)
class Piece:
    """One piece of a storage: ``nbytes`` bytes at byte ``offset`` of storage ``handle``,
    named ``name``."""

    handle: int
    offset: int
    nbytes: int
    name: str

    def view(self) -> records.TensorRef:
        """The piece as a flat byte view of its storage (a READBACK's source, an
        UPLOAD's destination)."""
        return records.TensorRef(self.handle, self.offset, "uint8", (self.nbytes,), (1,))


@dataclass(frozen=True)
class Checkpoint:
    """A session as one executor held it at a sync point.

    Attributes:
        storages: ``(handle, nbytes)`` of every live storage.
        pieces: every storage's pieces, in storage order.
        rng_state: the session generator's state.
        names: how many op names the executor had interned: a move sends these first,
            then the batches sent since, which carry the rest.
    """

    storages: tuple[tuple[int, int], ...]
    pieces: tuple[Piece, ...]
    rng_state: bytes
    names: int

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.storages)


@dataclass(frozen=True)
class StandbyCheckpoint:
    """A checkpoint whose pieces a standby host keeps (``blobs.standby``): the client
    holds only its manifest and the generator's state.

    Attributes:
        held: the storages' pieces by digest, the generator's state, and the hosts that
            keep the pieces (with the grants that open them).
        names: as ``Checkpoint.names``.
    """

    held: HostCheckpoint
    names: int

    @property
    def nbytes(self) -> int:
        return self.held.nbytes

    def restore_request(self) -> bytes:
        """The RESTORE batch that rebuilds the storages on a fresh executor, which pulls
        their pieces from the hosts that keep them."""
        sources = [(source.address, source.grant) for source in self.held.sources]
        entries = [(e.handle, e.nbytes, e.digests) for e in self.held.manifest.storages]
        return wire.encode_restore(sources, entries)

    def rng_batch(self) -> bytes:
        """The batch that sets the generator's state back, after the storages."""
        return records.encode([records.RngSet(bytes(self.held.manifest.rng_state))], [])


def host_checkpoint(
    seq: int,
    manifest: Sequence[tuple[int, int, Sequence[str]]],
    rng_state: bytes,
    source: Source,
) -> HostCheckpoint:
    """A KEEP answer's manifest as the standby link copies it: the pieces at ``source``."""
    storages = tuple(StorageEntry(h, torch.uint8, n, tuple(d)) for h, n, d in manifest)
    return HostCheckpoint(seq, Manifest("", memoryview(rng_state), storages), (source,))


def pieces_of(manifest: Sequence[tuple[int, int, Sequence[str]]]) -> list[Piece]:
    """The pieces a DIGESTS answer names (``wire.native.parse_manifest``'s entries)."""
    out = []
    for handle, nbytes, names in manifest:
        for index, name in enumerate(names):
            offset = index * PIECE
            out.append(Piece(handle, offset, min(PIECE, nbytes - offset), name))
    return out


class PieceStore:
    """The pieces the client holds, by name: in memory, or under ``directory``, which it
    then owns (``close`` removes it)."""

    def __init__(self, directory: Path | None = None) -> None:
        self._data: dict[str, bytes] = {}
        self._disk = None if directory is None else BlobStore(directory, cap=0)
        self._pins: dict[str, PinnedBlob] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._data or name in self._pins

    @property
    def nbytes(self) -> int:
        """Bytes of the pieces held for checkpoints."""
        held = sum(len(data) for data in self._data.values())
        return held + sum(pin.size for pin in self._pins.values())

    def missing(self, pieces: Sequence[Piece]) -> list[Piece]:
        """The pieces to read back: those not held, each name once."""
        wanted: dict[str, Piece] = {}
        for piece in pieces:
            if piece.name not in self:
                wanted.setdefault(piece.name, piece)
        return list(wanted.values())

    def make_room(self, state_bytes: int) -> None:
        """Before a checkpoint of a session holding ``state_bytes``: the disk keeps the
        last checkpoint's pieces while the next one's arrive, and no more."""
        if self._disk is not None:
            self._disk.cap = self.nbytes + state_bytes

    def add(self, piece: Piece, data: bytes | memoryview) -> None:
        """Keep ``data`` as ``piece``'s bytes.

        Raises:
            MalformedMessageError: the bytes are not the piece the executor named.
            OSError: the checkpoint directory could not keep them.
        """
        if len(data) != piece.nbytes or digest(data) != piece.name:
            raise MalformedMessageError(
                f"storage {piece.handle}'s piece at byte {piece.offset} read back is not "
                "the bytes its digest names"
            )
        if self._disk is None:
            self._data[piece.name] = bytes(data)
            return
        pinned = self._disk.keep(piece.name, memoryview(data))
        if pinned is None:
            raise OSError(f"the checkpoint directory {self._disk.root} could not keep a piece")
        self._pins[piece.name] = pinned

    def read(self, name: str) -> bytes | memoryview:
        """A held piece's bytes.

        Raises:
            BlobMismatchError: the piece was damaged on disk.
        """
        if self._disk is None:
            return self._data[name]
        try:
            return self._pins[name].read()
        except BlobMismatchError as exc:
            raise BlobMismatchError(
                f"a checkpoint piece in {self._disk.root} is damaged on disk ({exc}); the "
                "session cannot be restored from it"
            ) from exc

    def keep_only(self, pieces: Sequence[Piece]) -> None:
        """Let go of every piece no checkpoint of ``pieces`` names."""
        named = {piece.name for piece in pieces}
        self._data = {name: data for name, data in self._data.items() if name in named}
        for name in [name for name in self._pins if name not in named]:
            self._pins.pop(name).close()

    def close(self) -> None:
        """Let go of every piece; remove the directory, if any."""
        self.keep_only([])
        if self._disk is not None:
            shutil.rmtree(self._disk.root, ignore_errors=True)

    def restore_batches(self, checkpoint: Checkpoint) -> Iterator[bytes]:
        """The batches that rebuild ``checkpoint`` on a fresh executor: the storages,
        their pieces' bytes, then the generator's state."""
        yield records.encode([records.Alloc(h, n) for h, n in checkpoint.storages], [])
        for group in groups(checkpoint.pieces):
            uploads = [
                records.Upload(
                    p.view(), records.HostTensor("uint8", (p.nbytes,), bytes(self.read(p.name)))
                )
                for p in group
            ]
            yield records.encode(uploads, [])
        yield records.encode([records.RngSet(checkpoint.rng_state)], [])


def groups(pieces: Sequence[Piece]) -> Iterator[list[Piece]]:
    """``pieces`` in order, in groups of at most ``GROUP_BYTES`` (one piece at least)."""
    group: list[Piece] = []
    held = 0
    for piece in pieces:
        if group and held + piece.nbytes > GROUP_BYTES:
            yield group
            group, held = [], 0
        group.append(piece)
        held += piece.nbytes
    if group:
        yield group


def readback_batch(pieces: Sequence[Piece]) -> bytes:
    """The batch that reads ``pieces`` back: its readbacks come in that order."""
    return records.encode([records.Readback(piece.view()) for piece in pieces], [])


def rng_batch() -> bytes:
    """The batch that reads the session generator's state back."""
    return records.encode([records.RngGet()], [])
