"""The executor side of the native device: one session's replay loop, loaded from C++.

``Replayer(device, quota_bytes)`` (``csrc/replay.cpp``) holds a session's storages,
its op name table and its resolved operator handles; ``replay(batch, new_names)`` runs
one batch of wire records and returns the readbacks' bytes, raising ``ReplayError``
(``errors.py``) for a record that cannot run. Unlike the device library, the replay
library registers nothing with the dispatcher, so any process may load it: the host's
executor (``cumulus_p2p.host.executor``) serves native sessions with it beside the
Python device's, a ``ReplaySession`` each. A session's checkpoint can stay on the host
side: KEEP copies its pieces for a standby host to pull (``kept``), and a failover's fresh
host makes the storages and fills them from the standby (``open_restore``; the executor
does the pulling).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from types import ModuleType

import msgpack
import torch

from .._errors import MalformedMessageError
from ..blobs.names import PIECE, digest, is_digest
from ..blobs.store import BlobStore, PinnedBlob, close_pins, pin_held
from ..host.kept import KeptPieces
from ..host.restoring import PieceTargets
from ..host.session import SessionStats
from ..host.waits import WaitWindow
from ..wire import native as wire
from ..wire.manifest import StorageEntry
from . import named, records
from .errors import ReplayError as ReplayError

#: The most bytes of a HAVE request: some thousands of digests.
MAX_HAVE_BYTES = 1 << 20
#: Per-session memory quota when none is given: as the Python executor's default.
DEFAULT_QUOTA = 8 * 1024**3

_LIBRARY: ModuleType | None = None


def library(verbose: bool = False) -> ModuleType:
    """Build (if sources changed) and load the replay library, once per process."""
    global _LIBRARY
    if _LIBRARY is None:
        from ._build import build_replay

        _LIBRARY = build_replay(verbose=verbose)
    return _LIBRARY


def new_replayer(device: str = "cpu", quota_bytes: int = DEFAULT_QUOTA):
    """A session's replay loop on ``device`` (``"cpu"``, ``"cuda"``...), its live storages
    capped at ``quota_bytes``."""
    return library().Replayer(device, quota_bytes)


class ReplaySession:
    """One native session on its executor: its replay loop and its first failure.

    A failed record ends the session's usefulness (``wire.native`` says why): later
    batches do not run, and every later reply repeats the failure. The caller owns the
    I/O: it hands each request frame to ``run`` (a thread may: ``run`` holds the GIL
    only to parse) and sends back what ``run`` returns.
    """

    def __init__(self, replayer, store: BlobStore | None = None) -> None:
        """``store``: the host's blob store, where NAMED requests' pieces are read and
        their large uploads kept (None: named uploads are refused, none are kept)."""
        self._replayer = replayer
        self._store = store
        #: The pieces the last HAVE found, pinned until the next (the NAMED that follows
        #: it must find them).
        self._pins: dict[str, PinnedBlob] = {}
        self.failure: ReplayError | None = None
        self.batches = 0
        #: BATCH requests received, run or not: a resumed client resends those after.
        self.received = 0
        #: The reply to the last BATCH that asked for one (RESEND sends it again).
        self._last_reply: list[bytes] | None = None
        #: Its waits for device turns (``waits.py``), as status shows them.
        self.waits = WaitWindow()
        #: Checkpoint pieces kept for a standby to pull (KEEP), under the session's grant.
        self.kept = KeptPieces()

    def run(self, frame: bytes | bytearray) -> tuple[bool, list[bytes] | None]:
        """Run one request: (whether the session goes on, the reply's parts or None when
        the client asked for none).

        Raises:
            MalformedMessageError: the frame is not a request; the session cannot go on.
        """
        kind, reply, names, batch = wire.parse_request(frame)
        if kind == wire.BYE:
            return False, None
        if kind == wire.RESTORE:  # it pulls from other hosts: the executor's I/O
            raise MalformedMessageError("a restore is the executor's to run, not run's")
        if kind == wire.RESEND:
            if self._last_reply is None:
                raise MalformedMessageError("RESEND, but no batch asked for a reply")
            return True, self._last_reply
        if kind == wire.HAVE:
            return True, wire.ok([msgpack.packb(self._have(batch))])
        if kind in wire.BATCHES:
            self.received += 1
            self._last_reply = None
        readbacks = self._answer(kind, names, batch) if self.failure is None else []
        if not reply:
            return True, None
        if self.failure is not None:
            answer = wire.failed(self.failure.record, self.failure.kind, str(self.failure))
        else:
            answer = wire.ok(readbacks)
        if kind in wire.BATCHES:
            self._last_reply = answer
        return True, answer

    def _answer(self, kind: int, names: list[str], batch: memoryview) -> list[bytes]:
        """Run a BATCH or NAMED (its readbacks), or name the storages (DIGESTS, KEEP)."""
        if kind in (wire.DIGESTS, wire.KEEP):
            return [self._manifest(keep=kind == wire.KEEP)]
        data = named.resolve(batch, self._piece, self._keep) if kind == wire.NAMED else batch
        try:
            readbacks = self._replayer.replay(bytes(data), names)
        except ReplayError as exc:
            self.failure = exc
            return []
        self.batches += 1
        return readbacks

    def _manifest(self, keep: bool) -> bytes:
        """Every live storage's pieces, named: the DIGESTS answer a checkpoint reads. With
        ``keep``, the pieces are copied into ``kept`` too (those unchanged since the last
        KEEP are not copied again)."""
        entries, kept = [], []
        for handle in self._replayer.handles():
            # A GPU's storage comes to the host once; a CPU's is hashed where it lies.
            data = memoryview(self._replayer.storage_view(handle).cpu().numpy())
            spans = [data[at : at + PIECE] for at in range(0, len(data), PIECE)]
            names = [digest(span) for span in spans]
            entries.append((handle, len(data), names))
            kept += zip(names, spans, strict=True)
        if keep:
            self.kept.snapshot(kept)
        return wire.encode_manifest(entries)

    def open_restore(self, entries: Sequence[tuple[int, int, Sequence[str]]]) -> PieceTargets:
        """Make a RESTORE's storages, empty, and say where each of their pieces goes.

        Raises:
            ReplayError: a storage could not be made (over the quota, a handle in use);
                none of the restore's is left.
        """
        before = set(self._replayer.handles())
        allocs = [records.Alloc(handle, nbytes) for handle, nbytes, _ in entries]
        try:
            self._replayer.replay(records.encode(allocs, []), [])
        except ReplayError:
            self.drop(set(self._replayer.handles()) - before)
            raise
        anchors = {handle: self._replayer.storage_view(handle) for handle, _, _ in entries}
        storages = tuple(StorageEntry(h, torch.uint8, n, tuple(d)) for h, n, d in entries)
        return PieceTargets(storages, anchors)

    def drop(self, handles: Iterable[int]) -> None:
        """Free ``handles``' storages (a restore that could not be filled)."""
        frees = [records.Free(handle) for handle in handles]
        if frees:
            self._replayer.replay(records.encode(frees, []), [])

    def _have(self, batch: memoryview) -> list[bool]:
        """Which pieces of a HAVE request the host's store holds; those stay pinned."""
        wanted = msgpack.unpackb(batch) if len(batch) <= MAX_HAVE_BYTES else None
        if not isinstance(wanted, list) or not all(is_digest(n) for n in wanted):
            raise MalformedMessageError("HAVE takes a msgpack list of digests")
        close_pins(self._pins)
        self._pins = pin_held(self._store, wanted)
        return [name in self._pins for name in wanted]

    def _piece(self, name: str) -> memoryview | None:
        pinned = self._pins.get(name)
        return None if pinned is None else pinned.read()

    def _keep(self, name: str, data: memoryview) -> None:
        # Public, as a Python session's uploads are: other hosts may fetch it from here.
        if self._store is not None and name not in self._pins:
            self._store.put(name, data, public=True)

    @property
    def quota_bytes(self) -> int:
        """The most bytes the session's storages may hold."""
        return self._replayer.quota_bytes

    @property
    def live_bytes(self) -> int:
        """Bytes of the session's live storages."""
        return self._replayer.live_bytes

    @property
    def stats(self) -> SessionStats:
        """Its ops run and memory in use, as a Python session's ``stats`` (a copy)."""
        replayer = self._replayer
        live = replayer.live_bytes
        return SessionStats(ops=replayer.ops_run, bytes_in_use=live, peak_bytes=live)

    def close(self) -> None:
        """Let go of the pieces kept for a standby, the pins, and the storages."""
        self.kept.close()
        close_pins(self._pins)
        self._replayer = None
