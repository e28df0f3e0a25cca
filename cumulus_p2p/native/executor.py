"""The executor side of the native device: one session's replay loop, loaded from C++.

``Replayer(device, quota_bytes)`` (``csrc/replay.cpp``) holds a session's storages,
its op name table and its resolved operator handles; ``replay(batch, new_names)`` runs
one batch of wire records and returns the readbacks' bytes, raising ``ReplayError``
(``errors.py``) for a record that cannot run. Unlike the device library, the replay
library registers nothing with the dispatcher, so any process may load it: the host's
executor (``cumulus_p2p.host.executor``) serves native sessions with it beside the
Python device's, a ``ReplaySession`` each.
"""

from __future__ import annotations

from types import ModuleType

from ..blobs.names import PIECE, digest
from ..wire import native as wire
from .errors import ReplayError as ReplayError

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

    def __init__(self, replayer) -> None:
        self._replayer = replayer
        self.failure: ReplayError | None = None
        self.batches = 0

    def run(self, frame: bytes | bytearray) -> tuple[bool, list[bytes] | None]:
        """Run one request: (whether the session goes on, the reply's parts or None when
        the client asked for none).

        Raises:
            MalformedMessageError: the frame is not a request; the session cannot go on.
        """
        kind, reply, names, batch = wire.parse_request(frame)
        if kind == wire.BYE:
            return False, None
        readbacks: list[bytes] = []
        if kind == wire.DIGESTS:
            if self.failure is None:
                readbacks = [self._manifest()]
        elif self.failure is None:
            try:
                readbacks = self._replayer.replay(bytes(batch), names)
                self.batches += 1
            except ReplayError as exc:
                self.failure = exc
        if not reply:
            return True, None
        if self.failure is not None:
            return True, wire.failed(self.failure.record, self.failure.kind, str(self.failure))
        return True, wire.ok(readbacks)

    def _manifest(self) -> bytes:
        """Every live storage's pieces, named: the DIGESTS answer a checkpoint reads."""
        entries = []
        for handle in self._replayer.handles():
            # A GPU's storage comes to the host once; a CPU's is hashed where it lies.
            data = memoryview(self._replayer.storage_view(handle).cpu().numpy())
            pieces = [digest(data[at : at + PIECE]) for at in range(0, len(data), PIECE)]
            entries.append((handle, len(data), pieces))
        return wire.encode_manifest(entries)
