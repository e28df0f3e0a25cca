"""A failover's restore filled by a pull: each piece lands in its storages as it arrives.

The fresh host of a failover creates the checkpoint's storages first, then pulls their
pieces from the hosts that keep them (``blobservice.pull``, with these ``PieceTargets``
as its sink). Each piece is checked against its digest and copied straight into every
place the manifest puts it, so the host holds the state plus a window of pieces in
flight, never a second copy, and the restore ends when the last piece arrives. Pieces
this host's store already holds (it is the standby, or kept them from an earlier run)
are read from there instead.
"""

from __future__ import annotations

import torch

from .._errors import BlobMismatchError
from ..blobs.names import PIECE, digest
from ..blobs.store import BlobStore
from ..wire.manifest import StorageEntry
from .handles import raw_bytes


class PieceTargets:
    """Where each piece of a restore goes (uint8 views of its storages), and which have
    arrived. A ``blobservice.Sink``."""

    def __init__(self, entries: tuple[StorageEntry, ...], anchors: dict[int, torch.Tensor]):
        self._targets: dict[str, list[torch.Tensor]] = {}
        for entry in entries:
            for index, name in enumerate(entry.digests):
                start = index * PIECE
                length = min(PIECE, entry.nbytes - start)
                view = raw_bytes(anchors[entry.handle], start, length)
                self._targets.setdefault(name, []).append(view)
        self._done: set[str] = set()

    def __contains__(self, name: object) -> bool:
        return name in self._done

    def missing(self) -> list[str]:
        """The pieces not yet in place."""
        return [name for name in self._targets if name not in self._done]

    def put(self, name: str, data: memoryview) -> bool:
        """Check a piece against its name and copy it into every place it goes.

        Raises:
            BlobMismatchError: ``data`` is not what ``name`` says, or no place wants it.
        """
        targets = self._targets.get(name)
        if targets is None or len(data) != targets[0].numel() or digest(data) != name:
            raise BlobMismatchError(f"a piece sent as {name[:16]} is not that piece")
        self._place(name, data)
        return True

    def _place(self, name: str, data: memoryview) -> None:
        """Copy checked bytes into every place piece ``name`` goes."""
        source = torch.frombuffer(data, dtype=torch.uint8)
        for target in self._targets[name]:
            target.copy_(source)
        self._done.add(name)

    def fill_from(self, store: BlobStore) -> int:
        """Put in place the pieces ``store`` holds (each checked as it is read); returns
        their bytes."""
        filled = 0
        for name in self.missing():
            pinned = store.pin(name)
            if pinned is None:
                continue
            try:
                if pinned.size != self._targets[name][0].numel():
                    continue  # not this piece after all: pulled instead
                buffer = memoryview(bytearray(pinned.size))
                pinned.read_into(buffer)  # checks it against its name
                self._place(name, buffer)
                filled += len(buffer)
            except BlobMismatchError:
                continue  # damaged on disk: pulled instead
            finally:
                pinned.close()
        return filled
