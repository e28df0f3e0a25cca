"""The consumer's end of a session: handles, batching, sync points, frees.

Ops are queued, not sent: the client assigns output handles itself, so nothing waits for
the executor until a true sync point (a value, a copy to the CPU, ``synchronize``). The
queue leaves as one frame when it is long, when it carries many bytes, or at a sync point.

Tensors die in whatever thread the garbage collector picks, so ``free`` only appends to a
list; the frees ride along with the next batch, after that batch's ops.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

import torch

from .._errors import RemoteProtocolError, SessionClosedError
from .errors import remote_error
from .protocol import (
    PROTOCOL_VERSION,
    CpuTensorRef,
    TensorRef,
    decode_frame,
    encode_frame,
    split_blobs,
)
from .transport import FrameChannel

#: Ops queued before a batch leaves without a sync point.
DEFAULT_BATCH_OPS = 1024
#: Handles at and above DYN_BASE are for data-dependent outputs, DYN_BLOCK per op.
DYN_BASE = 1 << 40
DYN_BLOCK = 1 << 10
#: Bytes of inline tensors queued before a batch leaves.
DEFAULT_BATCH_BYTES = 16 * 1024 * 1024


class RemoteSession:
    """A live session with one executor, over any ``FrameChannel``."""

    def __init__(
        self,
        channel: FrameChannel,
        *,
        quota_bytes: int | None = None,
        batch_ops: int = DEFAULT_BATCH_OPS,
    ) -> None:
        self._channel = channel
        self._batch_ops = batch_ops
        self._ops: list[list] = []
        self._blobs: list[memoryview] = []
        self._blob_bytes = 0
        self._keepalive: list[torch.Tensor] = []
        self._frees: list[int] = []
        self._seq = 0
        # next() on a count is atomic under the GIL: no lock on the hot path.
        self._handles = itertools.count(1)
        self._dyn_blocks = itertools.count(0)
        self._lock = threading.RLock()
        self.closed = False
        self.bytes_allocated = 0
        self.peak_bytes_allocated = 0
        options = {} if quota_bytes is None else {"quota": quota_bytes}
        self.info = self._handshake(options)

    def _handshake(self, options: dict) -> dict:
        self._channel.send_frame(encode_frame(["hello", PROTOCOL_VERSION, options]))
        header, _ = decode_frame(self._channel.recv_frame())
        if header[0] == "fatal":
            raise SessionClosedError(f"executor refused the session: {header[1]}")
        if header[0] != "welcome" or len(header) != 3 or not isinstance(header[2], dict):
            raise RemoteProtocolError(f"expected welcome from the executor, got {header[0]!r}")
        return header[2]

    # --- building batches ---------------------------------------------------------------

    def new_handle(self) -> int:
        """A fresh storage handle for an output whose layout the client knows."""
        return next(self._handles)

    def new_dynamic_block(self) -> int:
        """The first of ``DYN_BLOCK`` handles the executor may give a data-dependent op's
        outputs; a range apart from ``new_handle``'s, so neither side can collide."""
        return DYN_BASE + next(self._dyn_blocks) * DYN_BLOCK

    def allocated(self, nbytes: int) -> None:
        self.bytes_allocated += nbytes
        if self.bytes_allocated > self.peak_bytes_allocated:
            self.peak_bytes_allocated = self.bytes_allocated

    def free(self, handle: int, nbytes: int) -> None:
        """Queue a storage for release. Safe from any thread and from ``__del__``."""
        self._frees.append(handle)
        self.bytes_allocated -= nbytes

    def add_blob(self, tensor: torch.Tensor) -> CpuTensorRef:
        """Attach a CPU tensor's bytes to the next batch and return its wire reference.

        Small tensors are copied (the caller may reuse its buffer after the op returns, as
        with any synchronous copy); large ones leave with the batch right away, straight
        from their own memory.
        """
        with self._lock:
            flat = tensor.detach().contiguous().reshape(-1)
            if flat.data_ptr() == tensor.data_ptr() and flat.numel() * flat.element_size() < 65536:
                flat = flat.clone()
            view = memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")
            self._keepalive.append(flat)
            self._blobs.append(view)
            self._blob_bytes += len(view)
            return CpuTensorRef(tensor.dtype, tuple(tensor.shape), len(self._blobs) - 1)

    def submit(self, record: list, *, flush_now: bool = False) -> None:
        """Queue one op record; send the batch if it is full."""
        with self._lock:
            self._ops.append(record)
            if (
                flush_now
                or len(self._ops) >= self._batch_ops
                or self._blob_bytes >= DEFAULT_BATCH_BYTES
            ):
                self.flush()

    def flush(self, query: list | None = None) -> tuple[Any, list[memoryview]]:
        """Send everything queued; with a ``query``, wait for and return its answer."""
        with self._lock:
            if self.closed:
                raise SessionClosedError("the cumulus session is closed; attach a new one")
            frees, self._frees = self._frees, []
            if not self._ops and not frees and query is None:
                return None, []
            self._seq += 1
            lengths = [len(b) for b in self._blobs]
            header = ["batch", self._seq, self._ops, frees, query, lengths]
            blobs, keepalive = self._blobs, self._keepalive
            self._ops, self._blobs, self._keepalive, self._blob_bytes = [], [], [], 0
            try:
                self._channel.send_frame(encode_frame(header, blobs))
            except SessionClosedError:
                self.closed = True
                raise
            del keepalive
            if query is None:
                return None, []
            return self._await_reply(self._seq)

    def _await_reply(self, seq: int) -> tuple[Any, list[memoryview]]:
        header, area = decode_frame(self._channel.recv_frame())
        if header[0] == "fatal":
            self.closed = True
            raise SessionClosedError(f"executor ended the session: {header[1]}")
        if header[0] != "reply" or len(header) != 5 or header[1] != seq:
            raise RemoteProtocolError(f"unexpected executor message {header[0]!r}")
        _, _, error, result, lengths = header
        if error is not None:
            kind, message, op = error
            raise remote_error(kind, message, op)
        return result, split_blobs(area, lengths)

    # --- sync points --------------------------------------------------------------------

    def call(self, record: list) -> Any:
        """Run an op whose outputs only the executor can describe; return its description."""
        with self._lock:
            self._ops.append(record)
            result, _ = self.flush(["call"])
            return result

    def fetch(self, ref: TensorRef) -> memoryview:
        """Return the bytes of a remote tensor, contiguous, in its dtype."""
        _, blobs = self.flush(["fetch", ref])
        return blobs[0]

    def synchronize(self) -> None:
        """Wait until every queued op has run; raise the first error among them."""
        self.flush(["sync"])

    def stats(self) -> dict:
        """The executor's view of this session: ops run, bytes in use, quota."""
        result, _ = self.flush(["stats"])
        return result

    def seed(self, seed: int) -> None:
        self.submit(["@seed", [int(seed) & (2**64 - 1)], {}, None])

    def close(self) -> None:
        """End the session; the executor releases all of its memory. Idempotent."""
        with self._lock:
            if self.closed:
                return
            try:
                self.flush()
                self._channel.send_frame(encode_frame(["bye"]))
            except SessionClosedError:
                pass
            finally:
                self.closed = True
                self._channel.close()


class _Current:
    session: RemoteSession | None = None


#: The session the ``cumulus`` device currently talks to (one per process).
CURRENT = _Current()


def current_session() -> RemoteSession:
    """The attached session. Raises ``SessionClosedError`` with what to do if there is none."""
    session = CURRENT.session
    if session is None or session.closed:
        raise SessionClosedError(
            "no cumulus session is attached: call cumulus_p2p.remote.attach('host:port') "
            "(or run under `cumulus-node --consume`) before using device='cumulus'"
        )
    return session
