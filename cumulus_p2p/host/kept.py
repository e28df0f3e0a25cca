"""What a host keeps of one session for other hosts: checkpoint pieces, served by grant.

Theory of operation
-------------------
With a standby (``blobs/standby.py``), a checkpoint stays on the host side: the consumer's link
carries only the manifest of digests. Two hosts keep pieces for a session:

- The **primary**, the host that runs the session, keeps its latest checkpoint's pieces in
  memory (``snapshot``), copied at the checkpoint's sync point: the op stream then goes on
  writing the live storages while the standby pulls the copy. A piece unchanged since the
  last checkpoint is the same bytes and is not copied again, so a frozen base costs its
  hashing only.
- The **standby** pulls them into its blob store and keeps them pinned there (``hold``),
  so its store's cap never evicts the checkpoint it stands by for.

Either serves a piece only to a peer that presents the session's *grant*
(``blobservice.grant_of``), which only the consumer can hand out: these pieces are the
consumer's private state, never announced, and a peer asking for one without the grant
gets nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch

from ..blobs.store import PinnedBlob


class KeptPieces:
    """A session's pieces kept for other hosts: a snapshot in memory, and pinned blobs.

    Read from the blob service's threads while the session's thread replaces them, so the
    maps are swapped whole under a lock and never changed in place.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._memory: dict[str, memoryview] = {}
        self._pins: dict[str, PinnedBlob] = {}

    def snapshot(self, pieces: Iterable[tuple[str, memoryview]]) -> None:
        """Keep ``(digest, bytes)`` pieces in place of the previous snapshot; bytes are
        copied unless the previous snapshot held the piece."""
        with self._lock:
            old = self._memory
        new: dict[str, memoryview] = {}
        for name, data in pieces:
            if name not in new:
                held = old.get(name)
                new[name] = _copy(data) if held is None else held
        with self._lock:
            self._memory = new

    def hold(self, pins: dict[str, PinnedBlob]) -> None:
        """Keep ``pins`` (blobs in the host's store) in place of those held before."""
        with self._lock:
            old, self._pins = self._pins, dict(pins)
        for name, pinned in old.items():
            if self._pins.get(name) is not pinned:
                pinned.close()

    def piece(self, name: str) -> memoryview | None:
        """The bytes of piece ``name`` if it is kept here, checked when read from disk.

        Raises:
            BlobMismatchError: the pinned blob is damaged on disk.
        """
        with self._lock:
            data = self._memory.get(name)
            pinned = self._pins.get(name)
        if data is not None:
            return data
        return None if pinned is None else pinned.read()

    def close(self) -> None:
        """Let go of everything kept."""
        self.hold({})
        with self._lock:
            self._memory = {}


def _copy(data: memoryview) -> memoryview:
    # torch copies on every core: half the pause of bytearray's memcpy on two.
    source = torch.frombuffer(data, dtype=torch.uint8)
    return memoryview(source.clone().numpy())
