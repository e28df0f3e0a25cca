"""A standby: a second host that keeps a session's checkpoints off the consumer's link.

Theory of operation
-------------------
Without a standby, every checkpoint's changed pieces cross the consumer's link to its
disk, and a failover uploads them again to the new host (``failover.py``). A home uplink
makes both slow: a gigabyte of state takes minutes each way.

With one, the consumer keeps only the manifest of digests:

1. At a checkpoint the primary host copies the pieces that changed into memory and names
   every piece (``["checkpoint", {"keep": true}]``, ``kept.py``); the op stream goes on.
2. The consumer tells the standby to pull them from the primary, host to host
   (``blobs/service.py``), in the background. The standby keeps them pinned in its store.
3. Only when the standby has them all does the checkpoint count: the replay log is cut
   there (``HostCheckpoint.seq``). Until then the previous one stands (the standby keeps
   its pieces pinned until a copy succeeds), so a host lost mid-copy costs a longer
   replay, never the state. A checkpoint does not start while the previous one is still
   being copied. A standby that is lost, or fails ``MAX_FAILURES`` copies in a row
   (its store full, say), gets no more: the consumer's store takes the checkpoints
   from then on. One failure is forgiven: the source of that copy, the session's host,
   may just have died, and the next copy comes from its replacement. A checkpoint
   larger than the standby's lease lends is refused by it (the host keeps its terms):
   the next checkpoint goes to a new standby, leased for the checkpoint and half as much
   again, and the old lease ends without blame.
4. At failover, the consumer sends the fresh host the manifest (a ``restore``): it
   makes the storages and pulls their pieces from the standby straight into them
   (``restoring.py``; from its own store, if it is the standby).

``CheckpointPlacement`` is the consumer's choice (``--checkpoint-to``): the consumer's
disk, the standby, or both (then either may restore the session, whichever holds the
latest checkpoint).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass

from .._errors import CumulusError, SessionClosedError
from ..blobs.service import Source, grant_of
from ..channel.transport import FrameChannel
from ..wire.manifest import Manifest
from ..wire.protocol import PROTOCOL_VERSION, decode_frame, encode_frame

log = logging.getLogger(__name__)

#: Memory a standby's session asks for: it holds blobs on disk, never tensors.
STANDBY_QUOTA = 1
#: Copies failed in a row after which checkpoints go to the consumer's store instead.
MAX_FAILURES = 2


class CheckpointPlacement(enum.Enum):
    """Where a session's checkpoints are kept."""

    CONSUMER = "consumer"
    STANDBY = "standby"
    BOTH = "both"

    @property
    def on_standby(self) -> bool:
        return self is not CheckpointPlacement.CONSUMER

    @property
    def on_consumer(self) -> bool:
        return self is not CheckpointPlacement.STANDBY


@dataclass(frozen=True)
class HostCheckpoint:
    """A checkpoint kept on the host side: what the consumer keeps of it is this."""

    seq: int
    manifest: Manifest
    #: Hosts that keep its pieces, and the grants that open them.
    sources: tuple[Source, ...]

    @property
    def digests(self) -> list[str]:
        return [name for entry in self.manifest.storages for name in entry.digests]

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for entry in self.manifest.storages)


@dataclass(frozen=True)
class Replication:
    """One finished copy to the standby: how many bytes it fetched, and how long it took."""

    seq: int
    fetched_bytes: int
    seconds: float


class StandbyError(CumulusError):
    """The standby could not keep a checkpoint."""


class StandbyLink:
    """The consumer's session with its standby host: it copies checkpoints there.

    Each copy runs in a thread of its own (the standby pulls while training goes on);
    ``close`` waits for it.
    """

    def __init__(self, channel: FrameChannel, *, address: str) -> None:
        """``channel``: a fresh connection to the standby's executor, at ``address``
        (``host:port``, as the other hosts reach it)."""
        self.address = address
        self._channel = channel
        channel.send_frame(encode_frame(["hello", PROTOCOL_VERSION, {"quota": STANDBY_QUOTA}]))
        header, _ = decode_frame(channel.recv_frame())
        if header[0] != "welcome" or not isinstance(header[2], dict):
            raise StandbyError(f"the standby at {address} refused the session: {header[1:]}")
        self.source = Source(address, grant_of(header[2]["token"]))
        self._thread: threading.Thread | None = None
        self._finished: HostCheckpoint | None = None
        self.replications: list[Replication] = []
        #: Copies that failed in a row, and why the standby itself is gone (if it is).
        self.failures = 0
        self.lost_because = ""
        #: Bytes the last checkpoint came to, when they were more than the standby's lease
        #: lends: the next standby must be leased larger (0: it was not outgrown).
        self.outgrown_bytes = 0

    @property
    def lost(self) -> bool:
        """The standby's session is gone (the host vanished, or ended the lease)."""
        return bool(self.lost_because)

    @property
    def why_unusable(self) -> str:
        """Why the next checkpoint should not go here; "" while it is usable."""
        if self.lost:
            return self.lost_because
        if self.outgrown_bytes:
            return f"the checkpoint ({self.outgrown_bytes / 2**30:.2f} GiB) outgrew the standby"
        if self.failures >= MAX_FAILURES:
            return f"{self.failures} copies failed in a row"
        return ""

    @property
    def usable(self) -> bool:
        """Worth the next checkpoint: reachable, and not failing copy after copy. One
        failed copy is forgiven (its source, the session's host, may just have died)."""
        return not self.lost and not self.outgrown_bytes and self.failures < MAX_FAILURES

    @property
    def busy(self) -> bool:
        """A copy is under way."""
        return self._thread is not None and self._thread.is_alive()

    def replicate(self, checkpoint: HostCheckpoint) -> None:
        """Start copying ``checkpoint``'s pieces to the standby.

        Raises:
            StandbyError: the previous copy has not finished.
        """
        if self.busy:
            raise StandbyError("the previous checkpoint is still being copied")
        self._thread = threading.Thread(
            target=self._copy, args=(checkpoint,), name="cumulus-standby", daemon=True
        )
        self._thread.start()

    def wait(self) -> None:
        """Wait for the copy under way, if any."""
        if self._thread is not None:
            self._thread.join()

    def take_finished(self) -> HostCheckpoint | None:
        """The latest checkpoint the standby now holds, once: None if none finished since
        the last call. Its only source is the standby."""
        if self.busy:
            return None
        finished, self._finished = self._finished, None
        return finished

    def close(self) -> None:
        """Wait for the copy under way, then end the standby's session."""
        self.wait()
        try:
            self._channel.send_frame(encode_frame(["bye"]))
        except (OSError, CumulusError):
            pass  # already gone
        self._channel.close()

    def _copy(self, checkpoint: HostCheckpoint) -> None:
        started = time.perf_counter()
        sources = [[s.address, s.grant] for s in checkpoint.sources]
        request = {"sources": sources, "digests": checkpoint.digests}
        try:
            self._channel.send_frame(encode_frame(["pull", request]))
            header, _ = decode_frame(self._channel.recv_frame())
        except (SessionClosedError, CumulusError) as exc:
            self.lost_because = f"lost the standby: {exc}"
            self._failed(checkpoint, self.lost_because)
            return
        result = header[1] if header[0] == "pulled" and len(header) == 2 else None
        if not isinstance(result, dict) or result.get("error") is not None:
            why = result.get("error") if isinstance(result, dict) else header
            needed = result.get("needed_bytes") if isinstance(result, dict) else None
            if type(needed) is int and needed > 0:
                self.outgrown_bytes = needed
            self._failed(checkpoint, str(why))
            return
        seconds = time.perf_counter() - started
        self.failures = 0
        self.replications.append(Replication(checkpoint.seq, result["fetched_bytes"], seconds))
        self._finished = HostCheckpoint(checkpoint.seq, checkpoint.manifest, (self.source,))

    def _failed(self, checkpoint: HostCheckpoint, why: str) -> None:
        self.failures += 1
        log.warning(
            "cumulus: the standby at %s did not keep checkpoint %d (%s); the previous one stands",
            self.address,
            checkpoint.seq,
            why,
        )
