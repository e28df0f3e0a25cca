"""The executor's per-session state machine: a handle table, a quota, and op execution.

Theory of operation
-------------------
A session owns a table ``handle -> anchor tensor`` (``handles.py``): one entry per remote
*storage* the client has created. Every tensor argument arrives as a ``TensorRef`` naming a
handle and a layout; it is rebuilt with ``as_strided`` on the anchor's storage after a bounds
check, so a forged handle or an out-of-bounds view is an error for that op and never a lookup
into another session. Outputs that need new memory are registered under the handles the client
chose; outputs that alias inputs need no entry at all.

Ops run one batch at a time. An op that fails poisons its output handles and records the
*first* error; the error is reported with the next reply and the session carries on. Memory
is counted per storage and capped by a quota; going over it is an out-of-memory error for
that op only.

For failover (``failover.py``) a session can describe itself (the ``checkpoint`` query:
every storage's handle, dtype and size, plus the RNG state), hand out its bytes (``read``)
and be rebuilt from them (the ``@restore`` and ``@rng`` records), each checked like any
other input. It can also be *parked* when its consumer vanishes (``park``: tensors move to
host memory, pinned, when they lived on a GPU) and resume later on a new connection,
answering the last query again if its reply was lost (``resend``).

Uploads of large CPU tensors arrive as ``@blob`` records naming their bytes by digest
(``blobs/names.py``): ``have`` pins the blobs of the host's store (``DeviceContext.blobs``) that
the client may then name without bytes; bytes that do come are checked against their
digest before they are used or kept, and a private session's are never kept.

This module does no network I/O: the trio shell in ``executor.py`` feeds it decoded batches and
sends back what it returns. It does run torch ops, on the device it was given.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .._errors import BlobMismatchError, RemoteProtocolError, StandbyFullError
from ..blobs.names import MAX_HAVE, PIECE, digest, is_digest
from ..blobs.store import BlobStore, PinnedBlob, close_pins, pin_held
from ..wire.manifest import StorageEntry
from ..wire.ops import UnknownOpError, resolve_op
from ..wire.protocol import (
    CpuTensorRef,
    DeviceToken,
    TensorRef,
    aligned_bytes,
    split_blobs,
    storage_extent,
)
from .collectives import CollectiveGroups, Membership
from .eviction import Tier
from .graph_compiler import GraphRunner
from .graphs import GraphError, GraphProgram, NodeFailed, define
from .handles import (
    MAX_HANDLE,
    ErrorKind,
    HandleTable,
    OpFailed,
    anchor_over,
    raw_bytes,
    unpin,
)
from .kept import KeptPieces
from .restoring import PieceTargets
from .scheduler import DEFAULT_RANK
from .waits import WaitWindow

#: torch's own default CPU seed, so an unseeded session draws what a fresh process draws.
DEFAULT_SEED = 67280421310721
DYN_BLOCK = 1 << 10  # handles a client reserves per data-dependent op (client.DYN_BLOCK)
#: Most bytes one ``read`` or ``fetch`` reply may carry, well inside the frame limit; the
#: client reads larger tensors in pieces of 16 MiB and checkpoints in 32 MiB (``transfer.py``).
MAX_READ_BYTES = 64 * 1024 * 1024
#: Queries whose reply blobs are recomputed, not kept, for ``resend``.
_BLOB_QUERIES = {"fetch", "checkpoint", "read", "rng"}
#: Batches this short run on the event loop itself (``Batch.light``); longer ones go to a
#: worker thread so the loop keeps serving other sessions' I/O while the device computes.
_INLINE_OPS = 8
_EMPTY_OPS = {"empty.memory_format", "empty_strided.default", "new_empty.default"}


@dataclass
class DeviceContext:
    """What all sessions on one executor share: the device, its RNG, and the runner of
    graph programs (with the code it compiled for them).

    Sessions take turns on the device (the executor runs one batch at a time), so each
    swaps its own generator state in when its batch starts. The swap happens only when
    the owner changes, so a lone tenant pays nothing.
    """

    device: torch.device
    rng_owner: ExecutorSession | None = None
    graphs: GraphRunner = field(default_factory=GraphRunner)
    #: The host's blob store, shared with its other processes (None: blobs are not kept).
    blobs: BlobStore | None = None

    def generator(self) -> torch.Generator:
        if self.device.type == "cuda":
            return torch.cuda.default_generators[self.device.index or 0]
        return torch.default_generator

    def take_rng(self, session: ExecutorSession) -> None:
        if self.rng_owner is session:
            return
        gen = self.generator()
        if self.rng_owner is not None:
            self.rng_owner.rng_state = gen.get_state()
        if session.rng_state is None:
            gen.manual_seed(DEFAULT_SEED)
        else:
            gen.set_state(session.rng_state)
        self.rng_owner = session

    def forget(self, session: ExecutorSession) -> None:
        if self.rng_owner is session:
            self.rng_owner = None

    def release(self, session: ExecutorSession) -> None:
        """Let go of the generator, keeping the session's draw position with the session."""
        if self.rng_owner is session:
            session.rng_state = self.generator().get_state()
            self.rng_owner = None


@dataclass
class Batch:
    """A decoded ``batch`` request."""

    seq: int
    ops: list
    frees: list
    query: list | None
    blobs: list[memoryview]
    #: Bytes of the storages its ops create, as the client counted them: the executor
    #: makes room for them before it runs the ops (a hint; quotas are checked per op).
    grows: int = 0

    @property
    def light(self) -> bool:
        """Short, and without blob records (which may read and hash 16 MiB each): cheaper
        to run on the event loop than to hand to a thread."""
        return len(self.ops) <= _INLINE_OPS and not any(
            type(r) is list and r and r[0] == "@blob" for r in self.ops
        )


@dataclass
class Reply:
    """What the shell sends back: ``error`` is ``(type, message, op)`` or None."""

    seq: int
    error: tuple[str, str, str] | None
    result: Any = None
    blobs: list = field(default_factory=list)


@dataclass
class SessionStats:
    ops: int = 0
    #: Seconds spent running batches (decoding arguments, launching kernels, registering
    #: outputs): the executor's own cost. On CUDA kernels run asynchronously, so this is
    #: the host-side time per op, not the GPU's.
    busy_s: float = 0.0
    failed_ops: int = 0
    bytes_in_use: int = 0
    peak_bytes: int = 0
    #: Graph calls that ran code compiled for the device (``graph_compiler.py``).
    compiled_graph_runs: int = 0
    storages: int = 0
    #: Its waits for device turns over the last minute (``waits.py``), in ms; filled in
    #: only in the copies ``Executor.session_stats`` gives; None while it took no turn
    #: in that minute (or takes none: a CPU).
    wait_p50_ms: float | None = None
    wait_p99_ms: float | None = None
    #: Where its evicted storages are (``eviction.Tier``'s value; "device" while none
    #: is), and what stays on the device: also filled in by ``Executor.session_stats``.
    tier: str = "device"
    bytes_on_device: int = 0
    #: Bytes of the host's store it holds pinned: a standby's latest checkpoint, there
    #: once they are (``hold``).
    held_bytes: int = 0


class ExecutorSession:
    """One client's tensors and op stream on an executor."""

    def __init__(
        self,
        ctx: DeviceContext,
        *,
        quota_bytes: int,
        private: bool = False,
        hold_bytes: int | None = None,
        peer_links: bool = True,
    ) -> None:
        self.ctx = ctx
        self.device = ctx.device
        #: A private session's blobs are used, never kept in the host's store.
        self.private = private
        self._pins: dict[str, PinnedBlob] = {}  # what the last ``have`` found, held
        #: Checkpoint pieces kept for a standby to pull, or pulled for this session.
        self.kept = KeptPieces()
        #: Most bytes of the host's store ``hold`` may pin (a standby lease's disk).
        self.hold_bytes = hold_bytes
        self.rng_state: torch.Tensor | None = None
        self.stats = SessionStats()
        #: How long each device turn it asked for took to come.
        self.waits = WaitWindow()
        self._handles = HandleTable(self.device, self.stats, quota_bytes=quota_bytes)
        self._error: tuple[str, str, str] | None = None
        self._dyn_result: Any = None
        #: Where its evicted storages are (``eviction.Tier``; the device while none is),
        #: which they are, and their pieces while on disk.
        self.tier = Tier.DEVICE
        self._off: set[int] = set()
        self._paged: dict[int, list[PinnedBlob]] = {}
        # A session may be brought back ahead of its turn, in a thread, while another
        # session's turn evicts: one move at a time.
        self._moving = threading.RLock()
        #: The lease's rank (``scheduler.lease_rank``) and when a batch last ran: what
        #: the eviction policy weighs.
        self.rank: tuple = DEFAULT_RANK
        self.last_op_at = time.monotonic()
        self.evictions = 0
        self.evicted_bytes = 0  # moved off the device, over all its evictions
        self._graphs: dict[int, tuple[bytes, GraphProgram]] = {}  # graph id -> (key, program)
        self._last_answer: tuple[int, list, Any, Any] | None = None  # seq, query, error, result
        self.last_seq = 0
        self._groups = CollectiveGroups(peer_links)  # the job's groups, when it spans hosts

    @property
    def quota_bytes(self) -> int:
        return self._handles.quota_bytes

    # --- the batch ----------------------------------------------------------------------

    def run_batch(self, batch: Batch) -> Reply | None:
        """Run every op of ``batch`` in order, apply its frees, answer its query."""
        started = time.perf_counter()
        if self.tier is not Tier.DEVICE:
            self.bring_back(_named(batch))
        self.last_op_at = time.monotonic()
        self._handles.clock += 1
        self.ctx.take_rng(self)
        self.last_seq = batch.seq
        for record in batch.ops:
            self._run_record(record, batch.blobs)
        for handle in batch.frees:
            self._handles.release(handle)
        if self._off:
            self._forget_freed()
        self.stats.busy_s += time.perf_counter() - started
        if batch.query is None:
            return None
        return self._answer(batch.seq, batch.query)

    def _run_record(self, record: Any, blobs: list[memoryview]) -> None:
        name = record[0] if isinstance(record, list) and record else "?"
        self._dyn_result = None
        try:
            if not (isinstance(record, list) and len(record) == 4 and isinstance(name, str)):
                raise OpFailed(ErrorKind.PROTOCOL_ERROR, "malformed op record")
            _, args, kwargs, outs = record
            if name in _RECORDS:
                _RECORDS[name](self, args, blobs)
                return
            if name == "@run":
                self._run_graph(args, outs)
                return
            self._run_op(name, args, kwargs, outs, blobs)
            self.stats.ops += 1
        except OpFailed as exc:
            self._fail(record, exc.op or name, exc.kind, str(exc))
        except Exception as exc:  # a bug here must cost one op, never the executor
            self._fail(record, name, ErrorKind.INTERNAL, f"{type(exc).__name__}: {exc}")

    def _run_op(self, name: str, args: Any, kwargs: Any, outs: Any, blobs) -> None:
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            raise OpFailed(ErrorKind.PROTOCOL_ERROR, "op arguments must be an array and a map")
        try:
            op = resolve_op(name)
        except UnknownOpError as exc:
            raise OpFailed(ErrorKind.UNKNOWN_OP, str(exc)) from None
        inputs: list[torch.Tensor] = []
        real_args = [self._materialize(a, blobs, inputs) for a in args]
        real_kwargs = {k: self._materialize(v, blobs, inputs) for k, v in kwargs.items()}
        if name.split(".", 2)[1] + "." + name.split(".", 2)[2] in _EMPTY_OPS:
            self._handles.check_quota(_requested_bytes(op, real_args, real_kwargs))
        try:
            result = op(*real_args, **real_kwargs)
        except torch.OutOfMemoryError as exc:
            raise OpFailed(ErrorKind.OUT_OF_MEMORY, str(exc)) from None
        except Exception as exc:  # any torch failure is this op's error, not the session's
            raise OpFailed(type(exc).__name__, str(exc)) from None
        self._register_outputs(result, outs, inputs)

    def _seed(self, args: Any, blobs: list[memoryview]) -> None:
        if not _args_are(args, int):
            raise OpFailed(ErrorKind.PROTOCOL_ERROR, "@seed takes one integer")
        self.ctx.generator().manual_seed(args[0] & (2**64 - 1))

    # --- collectives among a job's hosts (``collectives.py``) ----------------------------

    def take_peer_bytes(self) -> int:
        """The bytes its collectives carried between hosts since the last call (the
        lease's receipts carry them)."""
        return self._groups.take_peer_bytes()

    def _serve_group_store(self, args: Any, blobs: list[memoryview]) -> None:
        if not (_args_are(args, str, int, str) or _args_are(args, str, int, str, str)):
            message = "@pg_store takes [host, world, secret, links (optional)]"
            raise OpFailed(ErrorKind.PROTOCOL_ERROR, message)
        self._dyn_result = self._groups.serve_store(*args)

    def _join_group(self, args: Any, blobs: list[memoryview]) -> None:
        self._groups.join(Membership.parse(args))

    def _all_reduce(self, args: Any, blobs: list[memoryview]) -> None:
        name, ref, op = _collective_args(args, "@pg_allreduce", str)
        self._groups.all_reduce(name, self._handles.view(ref), op)

    def _broadcast(self, args: Any, blobs: list[memoryview]) -> None:
        name, ref, root = _collective_args(args, "@pg_broadcast", int)
        self._groups.broadcast(name, self._handles.view(ref), root)

    def _all_gather(self, args: Any, blobs: list[memoryview]) -> None:
        if not (
            _args_are(args, str, TensorRef, list) and all(type(ref) is TensorRef for ref in args[2])
        ):
            message = "@pg_allgather takes [group, tensor, [outputs]]"
            raise OpFailed(ErrorKind.PROTOCOL_ERROR, message)
        outputs = [self._handles.view(ref) for ref in args[2]]
        self._groups.all_gather(args[0], outputs, self._handles.view(args[1]))

    def _all_gather_base(self, args: Any, blobs: list[memoryview]) -> None:
        if not _args_are(args, str, TensorRef, TensorRef):
            message = "@pg_allgather_base takes [group, output, tensor]"
            raise OpFailed(ErrorKind.PROTOCOL_ERROR, message)
        name, output, tensor = args
        self._groups.all_gather_base(name, self._handles.view(output), self._handles.view(tensor))

    def _reduce_scatter(self, args: Any, blobs: list[memoryview]) -> None:
        if not _args_are(args, str, TensorRef, TensorRef, str):
            message = "@pg_reduce_scatter takes [group, output, tensor, op]"
            raise OpFailed(ErrorKind.PROTOCOL_ERROR, message)
        name, output, tensor, op = args
        self._groups.reduce_scatter(
            name, self._handles.view(output), self._handles.view(tensor), op
        )

    def _resize_storage(self, args: Any, blobs: list[memoryview]) -> None:
        # The tensor names the storage (so that a batch resizing a paged-out storage
        # brings it back first), not a view of it: it may outgrow the new size.
        if not _args_are(args, TensorRef, int):
            raise OpFailed(ErrorKind.PROTOCOL_ERROR, "@resize_storage takes [tensor, nbytes]")
        self._handles.resize(args[0].handle, args[1])

    # --- compiled graphs ----------------------------------------------------------------

    def _define_graph(self, args: Any, blobs: list[memoryview]) -> None:
        """``@graph [graph_id, definition]``: validate a graph (``graphs.py``) and keep it.

        Defining an id again with the same graph is allowed (a failover re-sends them).
        """
        if not (isinstance(args, list) and len(args) == 2 and type(args[0]) is int):
            raise OpFailed(ErrorKind.PROTOCOL_ERROR, "@graph takes [graph_id, definition]")
        graph_id, definition = args
        try:
            define(self._graphs, graph_id, definition, self.device)
        except GraphError as exc:
            raise OpFailed(ErrorKind.INVALID_GRAPH, str(exc)) from None

    def _run_graph(self, args: Any, outs: Any) -> None:
        """``@run [graph_id, inputs]``: one call of a defined graph; ``outs`` gives each
        output's ``[handle, sizes, strides, offset]``, or nil where the client needs no
        handle (the output is an input, or shares a storage named by another output)."""
        if not (isinstance(args, list) and len(args) == 2 and isinstance(args[1], list)):
            raise OpFailed(ErrorKind.PROTOCOL_ERROR, "@run takes [graph_id, inputs]")
        graph_id, refs = args
        known = self._graphs.get(graph_id) if type(graph_id) is int else None
        if known is None:
            raise OpFailed(
                ErrorKind.INVALID_GRAPH,
                f"no graph {graph_id!r} in this session (send @graph first)",
            )
        key, program = known
        if not isinstance(outs, list) or len(outs) != len(program.outputs):
            raise OpFailed(
                ErrorKind.PROTOCOL_ERROR,
                f"graph {graph_id} has {len(program.outputs)} outputs; the call declared "
                f"{len(outs) if isinstance(outs, list) else 'none'}",
            )
        if not all(type(r) is TensorRef for r in refs):
            raise OpFailed(ErrorKind.PROTOCOL_ERROR, "graph inputs must be tensor references")
        inputs = [self._handles.view(r) for r in refs]
        self._handles.check_quota(program.factory_bytes)
        try:
            budget = self.quota_bytes - self._handles.bytes_in_use
            results, compiled = self.ctx.graphs.run(key, program, inputs, budget)
        except GraphError as exc:
            raise OpFailed(ErrorKind.INVALID_GRAPH, f"graph {graph_id}: {exc}") from None
        except NodeFailed as exc:
            kind = type(exc.error).__name__
            if isinstance(exc.error, torch.OutOfMemoryError):
                kind = ErrorKind.OUT_OF_MEMORY
            where = f"{exc.op} (node {exc.index} of compiled graph {graph_id})"
            raise OpFailed(kind, str(exc.error), op=where) from None
        self.stats.ops += len(program.nodes)
        self.stats.compiled_graph_runs += compiled
        self._register_graph_outputs(results, outs, inputs)

    def _register_graph_outputs(self, results: list, outs: list, inputs: list) -> None:
        """Register each declared output; outputs sharing a storage share one handle."""
        counts: dict[Any, int] = {}
        for spec in outs:
            if isinstance(spec, list) and spec:
                counts[spec[0]] = counts.get(spec[0], 0) + 1
        added: list[int] = []
        storages: dict[int, int] = {}  # handle -> the storage registered under it
        try:
            for index, (value, spec) in enumerate(zip(results, outs, strict=True)):
                if spec is None:
                    continue
                if not isinstance(value, torch.Tensor):
                    raise OpFailed(
                        ErrorKind.PROTOCOL_ERROR, f"graph output {index} is not a tensor here"
                    )
                handle = spec[0] if isinstance(spec, list) and spec else None
                if handle in storages:
                    self._check_shared(index, value, spec, storages[handle])
                elif counts.get(handle) == 1:
                    added.append(self._register_declared(value, spec, inputs))
                else:
                    self._check_shared(index, value, spec, value.untyped_storage()._cdata)
                    if _aliases(value, inputs):
                        raise OpFailed(ErrorKind.RUNTIME, f"graph output {index} aliases an input")
                    self._handles.add(handle, value)
                    added.append(handle)
                    storages[handle] = value.untyped_storage()._cdata
            self._handles.check_quota(0)
        except OpFailed:
            for handle in added:
                self._handles.release(handle)
            raise

    @staticmethod
    def _check_shared(index: int, value: torch.Tensor, spec: Any, storage: int) -> None:
        """An output that shares its storage must be laid out exactly as captured."""
        expected = list(spec[1:]) if isinstance(spec, list) and len(spec) == 4 else None
        actual = [list(value.shape), list(value.stride()), value.storage_offset()]
        if expected != actual or value.untyped_storage()._cdata != storage:
            raise OpFailed(
                ErrorKind.RUNTIME,
                f"graph output {index} came out as {actual} where the capture expected "
                f"{expected}; run this code without torch.compile",
            )

    # --- restoring from a checkpoint ----------------------------------------------------

    def _restore(self, args: Any, blobs: list[memoryview]) -> None:
        """``@restore [handle, dtype, nbytes, start, data]``: one piece of a storage's bytes.

        The piece at ``start`` 0 creates the storage (a new handle, within quota); later
        pieces fill the same storage and must repeat its dtype and size. ``data`` is
        inline bytes, or the name of a whole ``PIECE`` the host's store holds (``have``).
        """
        if not (isinstance(args, list) and len(args) == 5):
            raise OpFailed(
                ErrorKind.PROTOCOL_ERROR, "@restore takes [handle, dtype, nbytes, start, data]"
            )
        handle, dtype, nbytes, start, data = args
        if type(handle) is not int or not 0 < handle < MAX_HANDLE:
            raise OpFailed(ErrorKind.INVALID_HANDLE, f"@restore: bad handle {handle!r}")
        if not isinstance(dtype, torch.dtype):
            raise OpFailed(ErrorKind.TYPE, "@restore: dtype must be a dtype")
        if type(nbytes) is not int or type(start) is not int or nbytes < 0 or start < 0:
            raise OpFailed(
                ErrorKind.VALUE, "@restore: size and start must be non-negative integers"
            )
        piece = self._restore_piece(data, blobs, nbytes, start)
        if start + piece.numel() > nbytes:
            raise OpFailed(
                ErrorKind.INDEX,
                f"@restore: bytes [{start}, {start + piece.numel()}) are out of bounds for a "
                f"storage of {nbytes} bytes",
            )
        if start == 0:
            self._create_storage(handle, dtype, nbytes)
        anchor = self._handles.restore_target(handle, dtype, nbytes, start)
        raw_bytes(anchor, start, piece.numel()).copy_(piece)
        self._handles.restored(handle, start + piece.numel())

    def _restore_piece(self, data: Any, blobs: list[memoryview], nbytes: int, start: int):
        """A ``@restore`` record's bytes: inline, or a whole piece from the store."""
        if isinstance(data, str) and is_digest(data):
            if start % PIECE or start >= nbytes:
                raise OpFailed(
                    ErrorKind.INDEX,
                    f"@restore: a named piece starts at a multiple of {PIECE} bytes below "
                    f"the storage's {nbytes}, not at {start}",
                )
            return self._stored_blob(data, min(PIECE, nbytes - start))
        if type(data) is not CpuTensorRef or data.dtype != torch.uint8 or len(data.sizes) != 1:
            raise OpFailed(
                ErrorKind.PROTOCOL_ERROR,
                "@restore: data must be inline uint8 bytes or a piece's name",
            )
        return _inline_tensor(data, blobs)

    def open_pulled_restore(self, entries: tuple[StorageEntry, ...]) -> PieceTargets:
        """Create a checkpoint's storages, within quota, for a pull to fill
        (``restoring.py``); returns where each of their pieces goes.

        Raises:
            OpFailed: a handle is in use, or the storages do not fit the quota (then none
                is left).
        """
        made: list[int] = []
        try:
            for entry in entries:
                self._create_storage(entry.handle, entry.dtype, entry.nbytes)
                made.append(entry.handle)
        except OpFailed:
            self.drop_storages(made)
            raise
        anchors = {h: self._handles.get(h).anchor for h in made}
        return PieceTargets(entries, anchors)

    def drop_storages(self, handles: list[int]) -> None:
        """Release the storages of a restore that failed."""
        for handle in handles:
            self._handles.release(handle)

    def _create_storage(self, handle: int, dtype: torch.dtype, nbytes: int) -> None:
        if handle in self._handles:
            raise OpFailed(ErrorKind.INVALID_HANDLE, f"@restore: handle {handle} is already in use")
        self._handles.check_quota(nbytes)
        raw = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._handles.add(handle, anchor_over(raw.untyped_storage(), dtype, self.device))

    def _set_rng(self, args: Any, blobs: list[memoryview]) -> None:
        """``@rng [data]``: the session generator's state, as ``checkpoint`` reported it."""
        if not _args_are(args, CpuTensorRef):
            raise OpFailed(ErrorKind.PROTOCOL_ERROR, "@rng takes one inline tensor")
        ref = args[0]
        if ref.dtype != torch.uint8 or len(ref.sizes) != 1:
            raise OpFailed(ErrorKind.PROTOCOL_ERROR, "@rng: the state must be uint8 bytes")
        state = _inline_tensor(ref, blobs)
        generator = self.ctx.generator()
        expected = generator.get_state().numel()
        if state.numel() != expected:
            raise OpFailed(
                ErrorKind.VALUE,
                f"@rng: a generator state of {state.numel()} bytes does not fit this "
                f"executor's {self.device.type} generator, whose state is {expected} bytes",
            )
        try:
            generator.set_state(state.clone())
        except RuntimeError as exc:  # torch validates the state's contents
            raise OpFailed(ErrorKind.VALUE, f"@rng: not a valid generator state: {exc}") from None

    # --- content-addressed uploads -----------------------------------------------------

    def have(self, values: list) -> list[bool]:
        """Which of the blobs named by ``values`` the host's store holds. Those it holds
        stay pinned (never evicted) until the next ``have`` or the session's end, so the
        ``@blob`` records that follow may name them without bytes.

        Raises:
            RemoteProtocolError: not a list of at most ``MAX_HAVE`` digests.
        """
        if not isinstance(values, list) or len(values) > MAX_HAVE:
            raise RemoteProtocolError(f"have takes a list of at most {MAX_HAVE} digests")
        if not all(is_digest(v) for v in values):
            raise RemoteProtocolError("have takes blob names: 64 lower-case hex digits each")
        close_pins(self._pins)
        self._pins = pin_held(self.ctx.blobs, values)
        return [v in self._pins for v in values]

    def hold(self, names: list[str]) -> int:
        """Pin the blobs ``names`` of the host's store for this session, in place of those
        held before (a standby keeps its latest checkpoint so); returns how many it holds.

        Raises:
            StandbyFullError: they come to more than ``hold_bytes``; those held before stay.
        """
        pins = pin_held(self.ctx.blobs, names)
        held = sum(p.size for p in pins.values())
        if self.hold_bytes is not None and held > self.hold_bytes:
            close_pins(pins)
            raise StandbyFullError(
                f"the checkpoint's {held / 2**30:.2f} GiB is more than the "
                f"{self.hold_bytes / 2**30:.2f} GiB this standby is leased to keep; lease a "
                "larger standby (cumulus-node --consume --standby-gib)",
                needed_bytes=held,
            )
        self.kept.hold(pins)
        self.stats.held_bytes = held
        return len(pins)

    def _blob(self, args: Any, blobs: list[memoryview]) -> None:
        """``@blob [target, digest, dtype, sizes, data]``: copy the blob named ``digest``,
        read as a ``dtype`` tensor of ``sizes``, into ``target``. ``data`` is its bytes
        (inline uint8), checked against the digest and kept in the host's store unless
        the session is private; nil names a blob the last ``have`` found here."""
        if not (isinstance(args, list) and len(args) == 5):
            raise OpFailed(
                ErrorKind.PROTOCOL_ERROR, "@blob takes [target, digest, dtype, sizes, data]"
            )
        target, value, dtype, sizes, data = args
        if type(target) is not TensorRef or not is_digest(value):
            raise OpFailed(
                ErrorKind.PROTOCOL_ERROR, "@blob needs a tensor and a blob name (64 hex digits)"
            )
        if not isinstance(dtype, torch.dtype):
            raise OpFailed(ErrorKind.TYPE, "@blob: dtype must be a dtype")
        if not (isinstance(sizes, list) and all(type(n) is int and n >= 0 for n in sizes)):
            raise OpFailed(ErrorKind.VALUE, "@blob: sizes must be non-negative integers")
        nbytes = math.prod(sizes) * dtype.itemsize
        if nbytes > MAX_READ_BYTES:
            raise OpFailed(
                ErrorKind.VALUE, f"@blob: a blob may hold at most {MAX_READ_BYTES} bytes"
            )
        dst = self._handles.view(target)
        if data is None:
            raw = self._stored_blob(value, nbytes)
        else:
            ok = type(data) is CpuTensorRef and data.dtype == torch.uint8
            if not ok or list(data.sizes) != [nbytes]:
                raise OpFailed(
                    ErrorKind.PROTOCOL_ERROR, f"@blob: data must be {nbytes} inline uint8 bytes"
                )
            raw = _inline_tensor(data, blobs)
            self._keep_blob(value, raw)
        try:
            dst.copy_(raw.view(dtype).reshape(sizes))
        except Exception as exc:  # a shape or dtype the target cannot take
            raise OpFailed(type(exc).__name__, f"@blob: {exc}") from None

    def _stored_blob(self, value: str, nbytes: int) -> torch.Tensor:
        pinned = self._pins.get(value)
        store = self.ctx.blobs
        if pinned is None and store is not None:
            pinned = store.pin(value)  # not asked about: still here, maybe
            if pinned is not None:
                self._pins[value] = pinned
        if pinned is None:
            raise OpFailed(
                ErrorKind.PROTOCOL_ERROR,
                f"@blob: this host does not hold blob {value[:16]}; send its bytes",
            )
        if pinned.size != nbytes:
            raise OpFailed(
                ErrorKind.VALUE,
                f"@blob: blob {value[:16]} holds {pinned.size} bytes, not {nbytes}",
            )
        raw = torch.empty(nbytes, dtype=torch.uint8)
        try:
            pinned.read_into(memoryview(raw.numpy()) if nbytes else memoryview(bytearray()))
        except BlobMismatchError as exc:
            raise OpFailed(ErrorKind.BLOB_MISMATCH, str(exc)) from None
        return raw

    def _keep_blob(self, value: str, raw: torch.Tensor) -> None:
        """Check bytes against their digest; keep them in the store unless private."""
        data = memoryview(raw.numpy()) if raw.numel() else memoryview(b"")
        store = self.ctx.blobs
        try:
            if store is not None and not self.private:
                store.put(value, data, public=True)
            elif digest(data) != value:
                raise BlobMismatchError(
                    f"a blob sent as {value[:16]} does not match its hash; it was not used"
                )
        except BlobMismatchError as exc:
            raise OpFailed(ErrorKind.BLOB_MISMATCH, str(exc)) from None

    # --- arguments ----------------------------------------------------------------------

    def _materialize(self, value: Any, blobs: list[memoryview], inputs: list) -> Any:
        if type(value) is TensorRef:
            tensor = self._handles.view(value)
            inputs.append(tensor)
            return tensor
        if type(value) is list:
            return [self._materialize(v, blobs, inputs) for v in value]
        if type(value) is CpuTensorRef:
            return _inline_tensor(value, blobs)
        if isinstance(value, DeviceToken):
            return self.device
        return value

    # --- outputs ------------------------------------------------------------------------

    def _register_outputs(self, result: Any, outs: Any, inputs: list[torch.Tensor]) -> None:
        if isinstance(outs, list) and len(outs) == 2 and outs[0] == "dyn":
            self._dyn_result = self._register_dynamic(result, outs[1], inputs)
            return
        tensors = _flat_tensors(result)
        if outs is None:
            return
        if not isinstance(outs, list) or len(outs) != len(tensors):
            raise OpFailed(
                ErrorKind.PROTOCOL_ERROR,
                f"op produced {len(tensors)} tensors but the client declared {len(outs)}",
            )
        added: list[int] = []
        try:
            for tensor, spec in zip(tensors, outs, strict=True):
                if spec is not None:
                    added.append(self._register_declared(tensor, spec, inputs))
            self._handles.check_quota(0)
        except OpFailed as exc:
            for handle in added:
                self._handles.release(handle)
            raise exc

    def _register_declared(self, tensor: torch.Tensor, spec: Any, inputs: list) -> int:
        if not (isinstance(spec, list) and len(spec) == 4):
            raise OpFailed(
                ErrorKind.PROTOCOL_ERROR, "output spec must be [handle, sizes, strides, offset]"
            )
        handle, sizes, strides, offset = spec
        if list(tensor.shape) != sizes:
            # Meta and the real kernel disagree (eval-mode batch_norm's unused statistics).
            # Only this output is unusable; the op's other outputs are fine.
            if type(handle) is int:
                self._handles.poison(
                    handle,
                    f"the executor produced shape {list(tensor.shape)} where the client "
                    f"expected {sizes}; this output cannot be used",
                )
            return handle
        if (
            list(tensor.stride()) != strides
            or tensor.storage_offset() != offset
            or _aliases(tensor, inputs)
        ):
            # Keep the client's picture true: lay the result out exactly as it expects.
            fresh = _strided_with_offset(sizes, strides, offset, tensor, self.device)
            fresh.copy_(tensor)
            tensor = fresh
        self._handles.add(handle, tensor)
        return handle

    def _register_dynamic(self, result: Any, first_handle: Any, inputs: list) -> Any:
        """Register an op's outputs whose shapes the client could not know; describe them."""
        if type(first_handle) is not int:
            raise OpFailed(ErrorKind.PROTOCOL_ERROR, "dyn output needs an integer first handle")
        if len(_flat_tensors(result)) > DYN_BLOCK:
            raise OpFailed(ErrorKind.RUNTIME, f"an op may return at most {DYN_BLOCK} tensors")
        refs = {tensor.untyped_storage()._cdata: ref for tensor, ref in self._input_refs(inputs)}
        described = self._describe(result, refs, itertools.count(first_handle))
        self._handles.check_quota(0)
        return described

    def _describe(self, value: Any, refs: dict[int, int], handles: Iterator[int]) -> Any:
        """``value`` as the client will see it: a tensor sharing an input's storage names
        that input's handle; any other takes the next of ``handles``.

        A method, not a closure calling itself: such a closure is a reference cycle that
        keeps the op's inputs alive until the garbage collector runs, which on a GPU is
        tens of large results later.
        """
        if isinstance(value, torch.Tensor):
            ref = refs.get(value.untyped_storage()._cdata)
            if ref is None:
                ref = next(handles)
                self._handles.add(ref, value)
            shape, stride = tuple(value.shape), tuple(value.stride())
            return TensorRef(ref, value.dtype, value.storage_offset(), shape, stride)
        if isinstance(value, (list, tuple)):
            return [self._describe(v, refs, handles) for v in value]
        if isinstance(value, (bool, int, float, complex)) or value is None:
            return value
        raise OpFailed(ErrorKind.TYPE, f"op returned an unsendable {type(value).__name__}")

    def _input_refs(self, inputs: list) -> list[tuple[torch.Tensor, int]]:
        by_storage = {e.anchor.untyped_storage()._cdata: h for h, e in self._handles.items()}
        return [
            (t, by_storage[t.untyped_storage()._cdata])
            for t in inputs
            if t.untyped_storage()._cdata in by_storage
        ]

    def _fail(self, record: Any, name: str, kind: str, message: str) -> None:
        self.stats.failed_ops += 1
        outs = record[3] if isinstance(record, list) and len(record) == 4 else None
        why = f"{name} failed ({kind}: {message})"
        if isinstance(outs, list):
            if len(outs) == 2 and outs[0] == "dyn":
                self._dyn_result = None
            else:
                for spec in outs:
                    if isinstance(spec, list) and spec and type(spec[0]) is int:
                        self._handles.poison(spec[0], why)
        if self._error is None:
            self._error = (kind, message, name)

    # --- queries ------------------------------------------------------------------------

    def _answer(self, seq: int, query: Any) -> Reply:
        reply = Reply(seq, None)
        try:
            reply.result, reply.blobs = self._respond(query)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except OpFailed as exc:
            if self._error is None:
                self._error = (exc.kind, str(exc), "query")
        except Exception as exc:  # same rule as for ops: the session survives
            if self._error is None:
                self._error = (ErrorKind.INTERNAL, f"{type(exc).__name__}: {exc}", "query")
        reply.error, self._error = self._error, None
        if reply.error is not None:
            reply.result, reply.blobs = None, []
        self._dyn_result = None
        self._last_answer = (seq, query, reply.error, reply.result)
        return reply

    def _respond(self, query: Any) -> tuple[Any, list]:
        kind = query[0] if isinstance(query, list) and query else None
        if kind == "fetch" and len(query) == 2 and type(query[1]) is TensorRef:
            return None, [_tensor_bytes(self._fetched(query[1]))]
        if kind == "call":
            return self._dyn_result, []
        if kind == "stats":
            return self._stats_map(), []
        if kind == "sync":
            return None, []
        if kind == "rng" and len(query) == 1:
            return None, [_tensor_bytes(self.ctx.generator().get_state())]
        if kind == "checkpoint" and len(query) in (1, 2):
            keep = len(query) == 2 and query[1] == {"keep": True}
            return self._manifest(keep=keep), [_tensor_bytes(self.ctx.generator().get_state())]
        if kind == "read" and len(query) == 2:
            return None, self._read(query[1])
        raise OpFailed(ErrorKind.PROTOCOL_ERROR, f"unknown query {query!r}")

    def _fetched(self, ref: TensorRef) -> torch.Tensor:
        tensor = self._handles.view(ref)
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > MAX_READ_BYTES:
            raise OpFailed(
                ErrorKind.VALUE,
                f"a fetch of {nbytes} bytes is over the {MAX_READ_BYTES} bytes one reply may "
                "carry; fetch it in pieces (views of at most that size)",
            )
        return tensor

    def _manifest(self, *, keep: bool = False) -> dict:
        """Every live storage: handle, dtype, size and the digests of its ``PIECE``s, so
        the client reads only the pieces it does not hold from an earlier checkpoint.

        ``keep``: the pieces stay here too (``kept.py``), copied now, for a standby to
        pull while the op stream goes on; the grant to them is in the reply.
        """
        storages: list[list] = []
        pieces = self._named_pieces(storages)
        if keep:
            self.kept.snapshot(pieces)
        else:
            for _ in pieces:  # digests only: each piece's bytes go as soon as it is named
                pass
        return {"device": str(self.device), "storages": storages}

    def _named_pieces(self, storages: list[list]) -> Iterator[tuple[str, memoryview]]:
        """Each live storage's ``PIECE``s with their digests, one at a time (a GPU
        storage crosses to host memory a piece at a time); ``storages`` gets the manifest
        entry of each, its digests complete once its last piece is out."""
        for handle, entry in self._handles.items():
            names: list[str] = []
            storages.append([handle, entry.anchor.dtype, entry.capacity, names])
            for start in range(0, entry.capacity, PIECE):
                length = min(PIECE, entry.capacity - start)
                data = _tensor_bytes(raw_bytes(entry.anchor, start, length))
                names.append(digest(data))
                yield names[-1], data

    def _read(self, ranges: Any) -> list[memoryview]:
        """The bytes ``[[handle, start, length], ...]`` of whole storages, for a checkpoint."""
        if not isinstance(ranges, list):
            raise OpFailed(ErrorKind.PROTOCOL_ERROR, "read takes a list of [handle, start, length]")
        total, out = 0, []
        for entry in ranges:
            ok = isinstance(entry, list) and len(entry) == 3
            if not ok or not all(type(v) is int and v >= 0 for v in entry):
                raise OpFailed(ErrorKind.PROTOCOL_ERROR, f"bad read range {entry!r}")
            handle, start, length = entry
            storage = self._handles.get(handle)
            if storage is None:
                raise OpFailed(ErrorKind.INVALID_HANDLE, f"no tensor with handle {handle} here")
            if start + length > storage.capacity:
                raise OpFailed(ErrorKind.INDEX, f"read of storage {handle} is out of bounds")
            total += length
            if total > MAX_READ_BYTES:
                raise OpFailed(
                    ErrorKind.VALUE, f"one read may return at most {MAX_READ_BYTES} bytes"
                )
            out.append(_tensor_bytes(raw_bytes(storage.anchor, start, length)))
        return out

    # --- resuming -----------------------------------------------------------------------

    def resend(self, seq: int) -> Reply:
        """The reply to batch ``seq`` again: a resumed client lost it with the connection.

        Only the latest query can be asked for, and nothing has run since it, so blobs are
        recomputed from the same state rather than kept.

        Raises:
            RemoteProtocolError: ``seq`` is not the latest batch, or it asked nothing.
        """
        last = self._last_answer
        if last is None or last[0] != seq or self.last_seq != seq:
            raise RemoteProtocolError(f"batch {seq} is not the last answered batch; no resend")
        _, query, error, result = last
        reply = Reply(seq, error, result)
        if error is None and query[0] in _BLOB_QUERIES:
            self.ctx.take_rng(self)
            try:
                reply.blobs = self._respond(query)[1]
            except OpFailed as exc:  # cannot happen on unchanged state; report, never crash
                reply.error, reply.result = (exc.kind, str(exc), "query"), None
        return reply

    def park(self, tier: Tier = Tier.RAM) -> int:
        """Set the session aside while its consumer is away: its storages leave the
        device for ``tier`` (``evict``), its RNG state stays with it, and ``unpark``
        brings them back. Returns the bytes it holds in host memory (none on disk).

        Raises:
            OSError: the disk tier could not keep the pieces (the session stays as it was).
        """
        self.ctx.release(self)
        if self.tier is not tier or self.bytes_on_device:
            self.evict(tier)  # from host memory to disk too
        return 0 if self.tier is Tier.DISK else self._handles.bytes_in_use

    def unpark(self) -> None:
        """Bring a parked session's storages back to its device."""
        self.bring_back()

    # --- tiers (``eviction.py``) ----------------------------------------------------------

    def evict(self, tier: Tier, need: int | None = None) -> int:
        """Move the session's storages off the device, between batches: to the host's
        memory (``RAM``) or to the host's blob store on disk (``DISK``). All of them, or
        with ``need``, storage by storage, those no op named for longest until ``need``
        bytes are off. Storages in host memory already go on to disk with the rest when
        ``tier`` is the disk (a demotion: from host memory, not through the device).
        Handles, graphs and the generator's state stay; the storages come back before
        the next batch runs (``bring_back``). Returns the bytes moved.

        Raises:
            ValueError: ``tier`` is the device, or the disk tier without a blob store.
            OSError: the blob store could not keep the pieces (nothing moved then).
        """
        with self._moving:
            return self._evict(tier, need)

    def _evict(self, tier: Tier, need: int | None) -> int:
        if tier is Tier.DEVICE:
            raise ValueError("the device is not a tier to evict to")
        if tier is Tier.DISK and self.ctx.blobs is None:
            raise ValueError("this executor has no blob store (--blob-dir) to evict to disk")
        demoted = 0
        if (self.tier, tier) == (Tier.RAM, Tier.DISK):
            # Written from where they are: host memory (a CPU's "host memory" is its device).
            self._paged.update(self._handles.page_out(self.ctx.blobs, self._off))
            demoted = self._handles.capacity(self._off)
        elif tier is not self.tier:
            self._bring_back()  # off the device, its storages are in one tier at a time
        on_device = [handle for handle, _ in self._handles.items() if handle not in self._off]
        chosen = self._handles.coldest(on_device, need)
        if tier is Tier.DISK and self.ctx.blobs is not None:
            self._paged.update(self._handles.page_out(self.ctx.blobs, chosen))
        elif self.device.type == "cuda":
            self._handles.move_to(torch.device("cpu"), chosen)
        self._off.update(chosen)
        self.tier = tier
        moved = demoted + self._handles.capacity(chosen)
        self.evictions += 1 if chosen else 0
        self.evicted_bytes += moved
        return moved

    @property
    def bytes_on_device(self) -> int:
        """What the session's storages hold on the device: all but the evicted ones."""
        # Read from the event loop while a batch may run, which may free an evicted handle.
        entries = [self._handles.get(handle) for handle in list(self._off)]
        off = sum(entry.capacity for entry in entries if entry is not None)
        return self._handles.bytes_in_use - off

    def bring_back(self, handles: set[int] | None = None) -> None:
        """Put an evicted session's storages back on its device (nothing if they are):
        all of them, or those of ``handles`` (what a batch names; the rest stay off).

        Raises:
            BlobMismatchError: a piece on disk was damaged; the storages stay off the
                device, and the session can no longer run.
        """
        with self._moving:
            self._bring_back(handles)

    def _bring_back(self, handles: set[int] | None = None) -> None:
        back = set(self._off) if handles is None else self._off & handles
        if self.tier is Tier.DISK:
            paged = {h: self._paged.pop(h) for h in back if h in self._paged}
            try:
                self._handles.page_in(paged, self.device)
            except BlobMismatchError as exc:
                raise BlobMismatchError(
                    f"this session's memory evicted to disk is damaged ({exc}); it cannot run on"
                ) from exc
        elif self.tier is Tier.RAM and self.device.type == "cuda":
            self._handles.move_to(self.device, back)
        self._off -= back
        if not self._off:
            self.tier = Tier.DEVICE

    def _forget_freed(self) -> None:
        """After a batch: let go of the pieces of storages it freed while off the device."""
        with self._moving:
            freed = {h for h in self._off if h not in self._handles}
            unpin({h: self._paged.pop(h) for h in freed if h in self._paged})
            self._off -= freed
            if not self._off:
                self.tier = Tier.DEVICE

    def _stats_map(self) -> dict:
        s = self.stats
        return {
            "ops": s.ops,
            "failed_ops": s.failed_ops,
            "busy_s": s.busy_s,
            "bytes_in_use": s.bytes_in_use,
            "peak_bytes": s.peak_bytes,
            "storages": s.storages,
            "compiled_graph_runs": s.compiled_graph_runs,
            "quota": self.quota_bytes,
            "tier": self.tier.value,
            "evictions": self.evictions,
            "evicted_bytes": self.evicted_bytes,
        }

    def snapshot_storages(self) -> dict[int, torch.Tensor]:
        """The live anchors by handle (for checkpoints and the host-side cache)."""
        return {h: e.anchor for h, e in self._handles.items()}

    def close(self) -> None:
        """Release every tensor of the session, in every tier."""
        unpin(self._paged)
        self._paged = {}
        self._off.clear()
        self._handles.clear()
        self._graphs.clear()
        close_pins(self._pins)
        self.kept.close()
        self._groups.close()
        self.ctx.forget(self)


def _named(batch: Batch) -> set[int] | None:
    """The storage handles ``batch`` names (its ops' tensors, its query's), or None when
    its query reads every storage (a checkpoint): what must be on the device to run it."""
    query = batch.query
    if (
        isinstance(query, list)
        and query
        and query[0] not in ("fetch", "call", "stats", "sync", "rng")
    ):
        return None
    handles: set[int] = set()
    pending: list[Any] = [batch.ops, query]
    while pending:
        value = pending.pop()
        if type(value) is TensorRef:
            handles.add(value.handle)
        elif isinstance(value, list | tuple):
            pending.extend(value)
        elif isinstance(value, dict):
            pending.extend(value.values())
    return handles


_RECORDS = {
    "@seed": ExecutorSession._seed,
    "@restore": ExecutorSession._restore,
    "@rng": ExecutorSession._set_rng,
    "@graph": ExecutorSession._define_graph,
    "@blob": ExecutorSession._blob,
    "@pg_store": ExecutorSession._serve_group_store,
    "@pg_join": ExecutorSession._join_group,
    "@pg_allreduce": ExecutorSession._all_reduce,
    "@pg_broadcast": ExecutorSession._broadcast,
    "@pg_allgather": ExecutorSession._all_gather,
    "@pg_allgather_base": ExecutorSession._all_gather_base,
    "@pg_reduce_scatter": ExecutorSession._reduce_scatter,
    "@resize_storage": ExecutorSession._resize_storage,
}


def _args_are(args: Any, *types: type) -> bool:
    """Whether a record's ``args`` are a list of one value of each of ``types``, in order:
    of exactly that type (``type(a) is t``), so True is not an int."""
    return (
        isinstance(args, list)
        and len(args) == len(types)
        and all(type(arg) is kind for arg, kind in zip(args, types, strict=True))
    )


def _collective_args(args: Any, record: str, last: type) -> tuple[str, TensorRef, Any]:
    """``[group name, tensor, op or root]``, checked."""
    if not _args_are(args, str, TensorRef, last):
        raise OpFailed(ErrorKind.PROTOCOL_ERROR, f"{record} takes [group, tensor, {last.__name__}]")
    return args[0], args[1], args[2]


def _flat_tensors(result: Any) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (list, tuple)):
        return [t for r in result for t in _flat_tensors(r)]
    return []


def _aliases(tensor: torch.Tensor, inputs: list[torch.Tensor]) -> bool:
    cdata = tensor.untyped_storage()._cdata
    return any(t.untyped_storage()._cdata == cdata for t in inputs)


def _strided_with_offset(sizes, strides, offset, like: torch.Tensor, device) -> torch.Tensor:
    base = torch.empty(storage_extent(sizes, strides, offset), dtype=like.dtype, device=device)
    return base.as_strided(sizes, strides, offset)


def _inline_tensor(ref: CpuTensorRef, blobs: list[memoryview]) -> torch.Tensor:
    if ref.blob >= len(blobs):
        raise OpFailed(ErrorKind.PROTOCOL_ERROR, f"inline tensor names missing blob {ref.blob}")
    if any(s < 0 for s in ref.sizes):
        raise OpFailed(ErrorKind.PROTOCOL_ERROR, "inline tensor with a negative size")
    blob = blobs[ref.blob]
    numel = math.prod(ref.sizes)
    if numel * ref.dtype.itemsize != len(blob):
        raise OpFailed(ErrorKind.PROTOCOL_ERROR, "inline tensor size does not match its bytes")
    if numel == 0:
        return torch.empty(ref.sizes, dtype=ref.dtype)
    return aligned_bytes(blob).view(ref.dtype).reshape(ref.sizes)


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().contiguous().cpu()
    if flat.numel() == 0:
        return memoryview(b"")
    # A one-element "contiguous" tensor may still carry any stride: flatten explicitly.
    flat = flat.as_strided((flat.numel(),), (1,), flat.storage_offset())
    return memoryview(flat.view(torch.uint8).numpy())


def _requested_bytes(op, args: list, kwargs: dict) -> int:
    """Bytes an ``empty*`` factory will allocate, checked before it runs."""
    sizes = args[1] if op._schema.name == "aten::new_empty" else args[0]
    if not isinstance(sizes, list) or not all(type(s) is int for s in sizes):
        raise OpFailed(ErrorKind.TYPE, "size must be a list of integers")
    if any(s < 0 for s in sizes):
        raise OpFailed(ErrorKind.RUNTIME, "negative dimension in a size")
    dtype = kwargs.get("dtype") or torch.get_default_dtype()
    if not isinstance(dtype, torch.dtype):
        raise OpFailed(ErrorKind.TYPE, "dtype must be a dtype")
    return math.prod(sizes) * dtype.itemsize


def parse_batch(header: list, area: memoryview) -> Batch:
    """Validate a ``batch`` header's shape (not its ops: those fail one by one)."""
    if len(header) not in (6, 7):
        raise RemoteProtocolError("batch header must have 6 fields, or 7 with its growth")
    _, seq, ops, frees, query, blob_lengths, *rest = header
    if type(seq) is not int or not isinstance(ops, list) or not isinstance(frees, list):
        raise RemoteProtocolError("batch needs an integer seq, an op list and a free list")
    if query is not None and not isinstance(query, list):
        raise RemoteProtocolError("batch query must be an array or nil")
    grows = rest[0] if rest else 0
    if type(grows) is not int or grows < 0:
        raise RemoteProtocolError("batch growth must be a byte count (an integer, not negative)")
    return Batch(seq, ops, frees, query, split_blobs(area, blob_lengths), grows)
