"""The consumer's end of a session: handles, batching, sync points, frees.

Ops are queued, not sent: the client assigns output handles itself, so nothing waits for
the executor until a true sync point (a value, a copy to the CPU, ``synchronize``). The
queue leaves as one frame when it is long, when it carries many bytes, or at a sync point.

Tensors die in whatever thread the garbage collector picks, so ``free`` only appends to a
list; the frees ride along with the next batch, after that batch's ops.

With a ``reconnect`` callable the session survives losing its executor (``failover.py``
explains how): every frame sent is also kept in a replay log, a checkpoint of the
executor's state is taken at a sync point every ``checkpoint_interval`` seconds, and when
the channel breaks the session dials a new executor, restores the checkpoint there (or
resumes from the old host's cache), replays the log and retries what it was doing. The
caller sees a pause, nothing else.

Large uploads name their bytes (``blobs/names.py``): ``upload`` queues an ``@blob`` record whose
digest and bytes are settled when its batch leaves, with one ``have`` question for all the
batch's records, so the bytes a host already holds never cross again. The replay log keeps
every record with its bytes: a failover's new host may hold none of them.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from .._errors import (
    CumulusError,
    FailoverError,
    RemoteExecutionError,
    RemoteProtocolError,
    SessionClosedError,
)
from ..blobs.elsewhere import FetchElsewhere
from ..blobs.names import MAX_HAVE, NAMED_WINDOW, PIECE, digest
from ..blobs.service import Source, grant_of
from ..blobs.standby import CheckpointPlacement, HostCheckpoint, StandbyLink
from ..channel.transport import FrameChannel
from ..wire.manifest import Manifest, parse_manifest
from ..wire.protocol import (
    PROTOCOL_VERSION,
    CpuTensorRef,
    TensorRef,
    decode_frame,
    encode_frame,
    lost_reason,
    split_blobs,
)
from .checkpoint import Checkpoint, CheckpointStore, MemoryCheckpointStore
from .errors import remote_error
from .failover import (
    DEFAULT_MAX_LOG_BYTES,
    TRANSFER_CHUNK,
    CheckpointPolicy,
    FailoverStatistics,
    ImageAssembler,
    ReplayLog,
    plan_reads,
    restore_batches,
    rng_record,
)
from .transfer import PROGRESS_INTERVAL, STREAM_CHUNK, TransferProgress

log = logging.getLogger(__name__)

#: ``rejoin(ask, channel, info)``: re-form a session's group on its fresh host.
Rejoin = Callable[[Callable[[list, list], Any], FrameChannel, dict], None]
#: The error kind of a collective whose group broke (``host.handles.ErrorKind.GROUP``).
GROUP_ERROR = "CollectiveGroupError"

#: Ops queued before a batch leaves without a sync point. Short enough that the executor
#: starts computing while the client is still dispatching the rest of a training step
#: (one step of a small transformer is ~500 ops); long enough that frames stay cheap.
DEFAULT_BATCH_OPS = 128
#: Handles at and above DYN_BASE are for data-dependent outputs, DYN_BLOCK per op.
DYN_BASE = 1 << 40
DYN_BLOCK = 1 << 10
#: Bytes of inline tensors queued before a batch leaves.
DEFAULT_BATCH_BYTES = 16 * 1024 * 1024
#: Bytes an upload's host must lack before it is asked to fetch them from other hosts: a
#: fetch costs a lookup per piece and a round trip through the consumer's node.
FETCH_MIN = 8 * 1024 * 1024
#: Hosts tried, one ``reconnect()`` each, before failover gives up.
DEFAULT_FAILOVER_ATTEMPTS = 3


class RemoteSession:
    """A live session with one executor, over any ``FrameChannel``.

    Args:
        channel: a connected channel to the executor.
        quota_bytes: ask for a smaller memory quota than the executor's default.
        batch_ops: ops queued before a batch leaves without a sync point.
        reconnect: turns failover on. Called with no arguments when the channel breaks
            (after the channel's own resume, if it has one, gave up); returns a new
            connected ``FrameChannel`` to the same host (which may still hold the session
            in its cache) or to another one (the consumer's re-match). It may raise
            ``OSError`` or a ``CumulusError`` to report that no host could be reached; that
            counts as a failed attempt. None (the default): a lost channel raises
            ``SessionClosedError`` at the next sync point, as without failover.
        checkpoint_interval: with ``reconnect``, take a checkpoint at the first sync point
            this many seconds after the previous one (0: at every sync point). None: only
            when the replay log reaches ``max_log_bytes``, or on ``checkpoint()``.
        checkpoint_store: where checkpoints are kept; default: this process's memory
            (``MemoryCheckpointStore``). ``DirectoryCheckpointStore`` keeps them on disk.
        max_log_bytes: replay log size that forces a checkpoint at the next batch.
        failover_attempts: ``reconnect()`` calls per failover before ``FailoverError``.
        private: the host keeps none of this session's uploads after it ends (they are
            not added to its blob store); uploads still skip bytes the host already holds.
        standby: a second host that keeps the checkpoints (``blobs/standby.py``): the host
            copies them there itself, and a failover pulls them from there, so neither
            crosses the consumer's link. Needs ``reconnect`` and a channel that knows its
            peer's address (``peer_address``).
        checkpoint_to: where checkpoints go (``CheckpointPlacement`` or its value):
            ``"standby"`` (the default with a standby), ``"consumer"`` (the default
            without one: ``checkpoint_store``) or ``"both"``.
        replace_standby: called with why when the standby is lost (or fails copy after
            copy, or the checkpoint outgrew its lease), at the next checkpoint, and the GiB
            the next one must lend (0: as many as the last): returns a channel to a new
            one (its ``peer_address`` set), which copies everything it lacks, or None:
            then the consumer's store takes the checkpoints from there on.
        fetch_elsewhere: called with the pieces of an upload the host lacks, before their
            bytes are sent: has the host fetch them from other hosts that hold them (a
            market host: ``node/blobshare.py``) and returns what it fetched. Never for a
            private session.
        group_failover: whether a collective group may take over this session's failover
            (``join_group_recovery``). False where ``reconnect`` cannot give a fresh
            session on a host that is alive without counting that host as lost.

    Raises:
        ValueError: a checkpoint option was given without ``reconnect``, or is invalid.
    """

    def __init__(
        self,
        channel: FrameChannel,
        *,
        quota_bytes: int | None = None,
        batch_ops: int = DEFAULT_BATCH_OPS,
        reconnect: Callable[[], FrameChannel] | None = None,
        checkpoint_interval: float | None = None,
        checkpoint_store: CheckpointStore | None = None,
        max_log_bytes: int = DEFAULT_MAX_LOG_BYTES,
        failover_attempts: int = DEFAULT_FAILOVER_ATTEMPTS,
        private: bool = False,
        standby: StandbyLink | None = None,
        checkpoint_to: CheckpointPlacement | str | None = None,
        replace_standby: Callable[[str, int], FrameChannel | None] | None = None,
        fetch_elsewhere: Callable[[list[str]], dict] | None = None,
        group_failover: bool = True,
    ) -> None:
        if reconnect is None and (checkpoint_interval, checkpoint_store, standby) != (None,) * 3:
            raise ValueError("checkpoints serve failover: pass reconnect= to use them")
        self._placement = _placement(checkpoint_to, standby)
        if failover_attempts < 1:
            raise ValueError("failover_attempts must be at least 1")
        self._channel = channel
        self._batch_ops = batch_ops
        self._ops: list[list] = []
        self._blobs: list[memoryview] = []
        self._blob_bytes = 0
        self._keepalive: list[torch.Tensor] = []
        self._named: list[_Named] = []  # the queued @blob records, settled at flush
        self._named_bytes = 0
        self._frees: list[int] = []
        #: ``@graph`` records by graph id: a failover defines them again on the new host.
        self._graphs: dict[int, list] = {}
        self._seq = 0
        # next() on a count is atomic under the GIL: no lock on the hot path.
        self._handles = itertools.count(1)
        self._dyn_blocks = itertools.count(0)
        self._lock = threading.RLock()
        self.closed = False
        #: Op records sent to executors so far (replays after a failover not counted).
        self.ops_sent = 0
        self.bytes_allocated = 0
        self.peak_bytes_allocated = 0
        self._grows = 0  # bytes of the storages the queued ops create
        self._options = {} if quota_bytes is None else {"quota": quota_bytes}
        if private:
            self._options["private"] = True
        #: ``have`` questions asked, and blob bytes the host had (so they were not sent).
        self.blob_questions = 0
        self._elsewhere = FetchElsewhere(None if private else fetch_elsewhere)
        self._group_failover = group_failover
        self.blob_bytes_skipped = 0
        self._reconnect = reconnect
        self._attempts = failover_attempts
        self._log = ReplayLog() if reconnect is not None else None
        self._policy = CheckpointPolicy(checkpoint_interval, max_log_bytes, time.monotonic())
        self._store = checkpoint_store if checkpoint_store is not None else MemoryCheckpointStore()
        #: Failovers survived, and the pause the last one caused (seconds).
        self.failovers = 0
        #: Why the executor was last lost (the ``reconnect`` callable may read it).
        self.lost_because: str | None = None
        #: True while the session goes back with its group, its host alive (``_go_back``).
        self.going_back = False
        #: Peer bytes counted for the ops queued since the last batch was logged.
        self._peer_queued = 0
        self.last_failover_s: float | None = None
        self._cache_resumes = 0
        self._checkpoints = 0
        self._checkpoint_bytes = 0
        self._checkpoint_read_bytes = 0
        self._last_checkpoint_s: float | None = None
        self._standby = standby
        self._replace_standby = replace_standby
        #: Copies made by standbys replaced since.
        self._replaced_copies: list = []
        #: The latest checkpoint the standby holds, once one is copied there.
        self._hosted: HostCheckpoint | None = None
        #: Bytes the new host pulled from other hosts at the last failover's restore.
        self._restore_pulled_bytes = 0
        self._restore_pull_s: float | None = None
        self._reconnect_s: float | None = None
        self._replay_s: float | None = None
        #: Where the last failover's state came from, for the line that reports it.
        self._restored_from = ""
        #: Set by a collective group that takes this session's checkpoints and rebuilds
        #: its group after a cold failover (``join_group_recovery``).
        self._rejoin: Rejoin | None = None
        #: A checkpoint taken in group mode, not yet the one failover restores.
        self._held: Checkpoint | None = None
        self._streaming = 0
        #: Called with a ``TransferProgress`` every few seconds of a long transfer (upload,
        #: read, checkpoint, restore); None prints a status line (``print_progress``).
        self.on_progress: Callable[[TransferProgress], None] | None = None
        #: Seconds between two progress reports of one transfer.
        self.progress_interval = PROGRESS_INTERVAL
        #: The transfer under way, once it has reported progress (for the node's status).
        self.transfer: TransferProgress | None = None
        #: The device its tensors are on: ``cumulus:i`` for the i-th attached session
        #: (``attach`` sets it).
        self.device = torch.device("privateuseone", 0)
        self.info = self._handshake(channel, self._options)

    def _handshake(self, channel: FrameChannel, options: dict) -> dict:
        channel.send_frame(encode_frame(["hello", PROTOCOL_VERSION, options]))
        header, _ = decode_frame(channel.recv_frame())
        if header[0] == "fatal":
            raise SessionClosedError(f"executor refused the session: {header[1]}")
        return _welcome_info(header)

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
        self._grows += nbytes
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

    @property
    def names_blobs(self) -> bool:
        """Whether large uploads go by digest: the host keeps a blob store."""
        return bool(self.info.get("blob_store"))

    def upload(
        self, target: TensorRef, src: torch.Tensor, *, name: str | None = None, here=None
    ) -> None:
        """Queue copying CPU ``src`` into ``target`` (same shape) as an ``@blob`` record.

        Args:
            target: the remote view to fill.
            src: its bytes, read when the batch leaves (as ``add_blob``'s large tensors).
            name: ``src``'s digest, when the caller computed it already.
            here: whether the host holds the blob, when the caller asked it already
                (``have``); None: asked with the rest of the batch when it leaves.
        """
        with self._lock:
            flat = src.detach().contiguous().reshape(-1)
            view = memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")
            record = ["@blob", [target, name, src.dtype, list(src.shape), None], {}, None]
            self._ops.append(record)
            self._named.append(_Named(record, view, here))
            self._keepalive.append(flat)
            if here is None:
                self._named_bytes += len(view)
            elif not here:
                self._blob_bytes += len(view)
            if (
                len(self._ops) >= self._batch_ops
                or self._blob_bytes >= DEFAULT_BATCH_BYTES
                or self._named_bytes >= NAMED_WINDOW
                or len(self._named) >= MAX_HAVE
            ):
                self.flush()

    def have(self, names: list[str]) -> list[bool]:
        """Ask the host which of these blobs it holds (after sending what is queued). It
        keeps those pinned for this session until the next question: ``upload`` them with
        ``here=True`` before asking again. At most ``MAX_HAVE`` names."""
        with self._lock:
            self.flush()
            return self._ask_have_or_fetch(names)

    def _ask_have_or_fetch(
        self, names: list[str], sizes: dict[str, int] | None = None
    ) -> list[bool]:
        """``have``, and for what the host lacks, worth a fetch (``FETCH_MIN`` bytes or
        more; ``sizes`` None: whole pieces), the host fetches from other hosts first."""
        held = self._ask_have(names)
        missing = [name for name, here in zip(names, held, strict=True) if not here]
        worth = sizes is None or sum(sizes[n] for n in missing) >= FETCH_MIN
        if missing and worth and self._elsewhere(missing):
            held = self._ask_have(names)  # the question pins all it names: ask whole
        return held

    @property
    def fetched_elsewhere_bytes(self) -> int:
        """Bytes of uploads the host fetched from other hosts instead."""
        return self._elsewhere.bytes

    def _ask_have(self, names: list[str]) -> list[bool]:
        """One ``have`` round trip. A host lost meanwhile holds nothing (failover on: the
        session moved; its new host is asked nothing and gets every byte)."""
        self.blob_questions += 1
        try:
            self._channel.send_frame(encode_frame(["have", names]))
            frame = self._channel.recv_frame()
        except SessionClosedError as exc:
            self._fail_over(exc, None)
            return [False] * len(names)
        lost_here = self._lost(frame)
        if lost_here is not None:
            self._fail_over(lost_here, None)
            return [False] * len(names)
        header, _ = decode_frame(frame)
        if header[0] == "fatal":
            self.closed = True
            raise SessionClosedError(f"executor ended the session: {header[1]}")
        return _have_answer(header, names)

    def _settle_named(
        self, ops: list, named: list[_Named], blobs: list
    ) -> tuple[list, list] | None:
        """Name each queued ``@blob`` record's bytes and attach them where the host lacks
        them (one ``have`` for the batch). Returns the records and blobs the replay log
        keeps instead (every record with its bytes), or None without a log."""
        for item in named:
            if item.record[1][1] is None:
                item.record[1][1] = digest(item.view)
        sizes = {n.record[1][1]: len(n.view) for n in named if n.here is None}
        unknown = list(sizes)
        held = self._ask_have_or_fetch(unknown, sizes) if unknown else []
        answers = dict(zip(unknown, held, strict=True))
        attached: dict[str, CpuTensorRef] = {}
        full: dict[int, list] = {}
        full_blobs = list(blobs) if self._log is not None else []
        for item in named:
            args = item.record[1]
            here = answers[args[1]] if item.here is None else item.here
            if here:
                self.blob_bytes_skipped += len(item.view)
            else:
                ref = attached.get(args[1])
                if ref is None:
                    blobs.append(item.view)
                    ref = attached[args[1]] = _bytes_ref(item.view, len(blobs) - 1)
                args[4] = ref
            if self._log is not None:
                full_blobs.append(item.view)
                ref = _bytes_ref(item.view, len(full_blobs) - 1)
                full[id(item.record)] = ["@blob", [*args[:4], ref], {}, None]
        if self._log is None:
            return None
        return [full.get(id(r), r) for r in ops], full_blobs

    def submit(self, record: list) -> None:
        """Queue one op record (tensors in it by wire reference); send a full batch."""
        with self._lock:
            self._ops.append(record)
            if len(self._ops) >= self._batch_ops or self._blob_bytes >= DEFAULT_BATCH_BYTES:
                self.flush()

    def define_graph(self, definition: list) -> int:
        """Queue a compiled graph's definition (``graphs.py``); return its id here."""
        with self._lock:
            graph_id = len(self._graphs) + 1
            record = ["@graph", [graph_id, definition], {}, None]
            self._graphs[graph_id] = record
            self.submit(record)
            return graph_id

    @property
    def graphs_defined(self) -> int:
        """Compiled graphs this session has sent (each once)."""
        return len(self._graphs)

    def flush(self, query: list | None = None) -> tuple[Any, list[memoryview]]:
        """Send everything queued; with a ``query``, wait for and return its answer."""
        with self._lock:
            if self.closed:
                raise SessionClosedError("the cumulus session is closed; attach a new one")
            frees, self._frees = self._frees, []
            if not self._ops and not frees and query is None:
                return None, []
            ops, blobs, keepalive, named = self._ops, self._blobs, self._keepalive, self._named
            self._ops, self._blobs, self._keepalive, self._blob_bytes = [], [], [], 0
            self._named, self._named_bytes = [], 0
            grows, self._grows = self._grows, 0
            logged = self._settle_named(ops, named, blobs) if named else None
            seq, parts = self._encode(ops, frees, query, blobs, logged, grows)
            frame = self._exchange(parts, seq if query is not None else None)
            del keepalive
            answer = (None, []) if frame is None else self._read_group_reply(frame, seq)
            if self._log is not None:
                self._maybe_checkpoint(at_sync_point=query is not None)
            return answer

    def _encode(
        self, ops: list, frees: list, query: list | None, blobs: list, logged=None, grows=0
    ) -> tuple[int, list]:
        """Number a batch and encode it; with failover on, log it too (``logged``: the
        ops and blobs to log instead, when they differ from those sent). ``grows``: the
        bytes of the storages its ops create, for the executor to make room first."""
        self._seq += 1
        self.ops_sent += len(ops)
        seq = self._seq
        parts = encode_frame(_batch_header(seq, ops, frees, query, blobs, grows), blobs)
        if self._log is not None:
            if logged is None:
                parts = [self._log.record(seq, parts, query is not None, self._take_peer())]
            else:
                full_ops, full_blobs = logged
                header = _batch_header(seq, full_ops, frees, query, full_blobs, grows)
                full = encode_frame(header, full_blobs)
                self._log.record(seq, full, query is not None, self._take_peer())
        return seq, parts

    def _take_peer(self) -> int:
        """The peer bytes counted for the batch being logged (``count_peer_bytes``)."""
        taken, self._peer_queued = self._peer_queued, 0
        return taken

    def _exchange(self, parts: list, awaiting: int | None) -> bytearray | None:
        """Send a frame and, when ``awaiting`` names its batch, receive the reply to it."""
        try:
            self._channel.send_frame(parts)
            if awaiting is None:
                return None
            frame = self._channel.recv_frame()
        except SessionClosedError as exc:
            return self._fail_over(exc, awaiting)
        lost_here = self._lost(frame)
        return frame if lost_here is None else self._fail_over(lost_here, awaiting)

    def _lost(self, frame: bytearray) -> SessionClosedError | None:
        """What a host's ``lost`` message means for this session (None for any other frame).

        Raises:
            SessionClosedError: the session's own op ended it; failing over would not help.
        """
        lost = lost_reason(frame)
        if lost is None:
            return None
        reason, fault = lost
        if fault == "session":
            self.closed = True
            raise SessionClosedError(f"the host ended this session: {reason}")
        return SessionClosedError(f"the host lost this session: {reason}")

    def _read_group_reply(self, frame: bytearray, seq: int) -> tuple[Any, list[memoryview]]:
        """``_read_reply``; in a group that outlives its hosts, a collective that failed
        because a peer is lost sends the whole group back, and the reply is the replay's."""
        try:
            return self._read_reply(frame, seq)
        except RemoteExecutionError as exc:
            if self._rejoin is None or not group_broke(exc):
                raise
            frame = self._go_back(str(exc), seq)
        return self._read_reply(frame, seq)

    def _read_reply(self, frame: bytearray, seq: int) -> tuple[Any, list[memoryview]]:
        header, area = decode_frame(frame)
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

    # --- long transfers -----------------------------------------------------------------

    @contextlib.contextmanager
    def streaming(self) -> Iterator[None]:
        """Hold the session (and its checkpoints) for the pieces of one streamed transfer.

        A checkpoint taken between two pieces would read back a half-written storage, and
        one per piece would read the whole session back per piece. The policy is asked as
        soon as the transfer ends, as at a sync point: after an upload, the checkpoint
        holds what the consumer just sent and reads none of it back, where at the next
        batch a training step may already have changed it all.
        """
        with self._lock:
            self._streaming += 1
            try:
                yield
            finally:
                self._streaming -= 1
            if not self._streaming and self._log is not None:
                self.flush()
                self._maybe_checkpoint(at_sync_point=True)

    def progress(self, what: str, total: int) -> TransferProgress:
        """Start counting a transfer of ``total`` bytes for ``advance``."""
        return TransferProgress(what, total, time.monotonic(), self.progress_interval)

    def advance(self, progress: TransferProgress, nbytes: int) -> None:
        """Count ``nbytes`` of ``progress`` moved; report it when a line is due."""
        now = time.monotonic()
        if progress.advance(nbytes, now=now):
            (self.on_progress or print_progress)(progress)
            self.transfer = progress if progress.done < progress.total else None

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

    def count_peer_bytes(self, n: int) -> None:
        """The records just submitted have the host carry ``n`` bytes to the job's other
        hosts (collectives): counted under the lease of the channel they go on, and
        logged with their batch, to count again if it is replayed on a fresh session."""
        with self._lock:
            if self._log is not None:
                self._peer_queued += n
            self._count_peer_bytes_on(self._channel, n)

    @staticmethod
    def _count_peer_bytes_on(channel: FrameChannel, n: int) -> None:
        count = getattr(channel, "count_peer_bytes", None)
        if count is not None and n:
            count(n)

    def peer_links(self, links: str) -> None:
        """Say (to a consumer node, through the channel) how the job's hosts link to
        each other: "tls" or "plain" (``regroup.peer_links``)."""
        say = getattr(self._channel, "peer_links", None)
        if say is not None:
            say(links)

    def collectives_through_consumer(self) -> None:
        """Say (to a consumer node, through the channel) that the job's collectives run
        through this machine rather than between its hosts."""
        say = getattr(self._channel, "collectives_through_consumer", None)
        if say is not None:
            say()

    def synchronize(self) -> None:
        """Wait until every queued op has run; raise the first error among them."""
        self.flush(["sync"])

    def stats(self) -> dict:
        """The executor's view of this session: ops run, bytes in use, quota."""
        result, _ = self.flush(["stats"])
        return result

    def rng_state(self) -> torch.Tensor:
        """The executor's generator state for this session (a uint8 CPU tensor)."""
        _, blobs = self.flush(["rng"])
        return torch.frombuffer(bytearray(blobs[0]), dtype=torch.uint8)

    def set_rng_state(self, state: torch.Tensor) -> None:
        """Restore a state ``rng_state`` returned; a wrong one fails at the next sync."""
        state = state.detach().to("cpu", torch.uint8).contiguous()
        self.submit(["@rng", [self.add_blob(state)], {}, None])

    def seed(self, seed: int) -> None:
        self.submit(["@seed", [int(seed) & (2**64 - 1)], {}, None])

    # --- checkpoints --------------------------------------------------------------------

    def offer_checkpoint_bytes(self, data: memoryview) -> None:
        """``data`` is now a whole remote storage's bytes (an upload that filled it): hand
        its pieces to the checkpoint store, so the next checkpoint does not read back
        what the consumer just sent. Nothing to do without failover, or when checkpoints
        stay on the host side (a standby)."""
        if self._reconnect is None or not self._placement.on_consumer:
            return
        try:
            for start in range(0, len(data), PIECE):
                piece = data[start : start + PIECE]
                self._store.offer(digest(piece), piece)
        except OSError as exc:  # the store's disk: the checkpoint reads them instead
            log.warning("cumulus: could not keep an upload for checkpoints: %s", exc)

    def checkpoint(self) -> Checkpoint | HostCheckpoint:
        """Take a checkpoint now (a sync point), keep it where the placement says and
        return it: a ``Checkpoint`` of the consumer's store, or with a standby only, the
        ``HostCheckpoint`` once the standby holds it.

        The replay log restarts empty. Needs failover on (``reconnect=``).

        Raises:
            RemoteExecutionError: a queued op failed (raised as at any sync point).
            FailoverError: the host was lost and failover gave up.
        """
        if self._log is None:
            raise ValueError("checkpoints serve failover: create the session with reconnect=")
        with self._lock:
            self.synchronize()
            self.wait_for_standby()
            checkpoint = None
            while checkpoint is None:  # a host lost mid-way: the next one is checkpointed
                checkpoint = self._take_checkpoint()
            if isinstance(checkpoint, HostCheckpoint):
                kept = self.wait_for_standby()
                if kept is None or kept.seq != checkpoint.seq:
                    checkpoint = None  # the standby could not keep it: the consumer does
                    while checkpoint is None:
                        checkpoint = self._take_checkpoint(to_standby=False)
            return checkpoint

    def wait_for_standby(self) -> HostCheckpoint | None:
        """Wait until the standby holds the latest checkpoint taken; return the latest it
        holds (None: none yet, or no standby)."""
        with self._lock:
            if self._standby is not None:
                self._standby.wait()
                self._take_hosted()
            return self._hosted

    def _maybe_checkpoint(self, *, at_sync_point: bool) -> None:
        if self._streaming or self._rejoin is not None:  # a group takes them together
            return
        self._take_hosted()
        if self._standby is not None and self._standby.busy:
            # The next checkpoint waits for the standby to hold this one, and the log
            # cannot be cut before: it grows by what the stream sends during one copy.
            return
        now = time.monotonic()
        if self._policy.due(now=now, log_bytes=self._log.nbytes, at_sync_point=at_sync_point):
            try:
                self._take_checkpoint()
            except OSError as exc:  # the store's disk: keep the previous checkpoint and log
                log.warning("cumulus: could not store a checkpoint: %s", exc)
                self._policy.taken(now=now)

    def _take_hosted(self) -> None:
        """Count the checkpoint the standby finished copying: the log restarts from it."""
        finished = None if self._standby is None else self._standby.take_finished()
        if finished is None:
            return
        self._hosted = finished
        if finished.seq > self._log.after_seq:
            self._log.reset(finished.seq)

    def _take_checkpoint(
        self, *, to_standby: bool | None = None
    ) -> Checkpoint | HostCheckpoint | None:
        """Take a checkpoint where the placement says (``to_standby=False``: the consumer's
        store only); None if the host was lost meanwhile.

        One ``checkpoint`` query names the pieces for both places: the host keeps them
        for the standby to copy in the background, and the consumer reads those its store
        lacks. The log is cut at once by the consumer's copy, by the standby's only once
        it holds every piece (``_take_hosted``).
        """
        started = time.perf_counter()
        source = self._standby_source() if to_standby is not False else None
        frees, self._frees = self._frees, []
        query = ["checkpoint", {"keep": True}] if source is not None else ["checkpoint"]
        seq, parts = self._encode([], frees, query, [])
        manifest = parse_manifest(*self._read_reply(self._exchange(parts, seq), seq))
        taken: Checkpoint | HostCheckpoint | None = None
        if source is not None:
            taken = HostCheckpoint(seq, manifest, (source,))
            self._standby.replicate(taken)
            self._checkpoint_read_bytes = 0
        if source is None or self._placement.on_consumer:
            taken = self._read_pieces(seq, manifest)
            if taken is None:
                return None
        self._policy.taken(now=time.monotonic())
        self._checkpoints += 1
        self._checkpoint_bytes = sum(entry.nbytes for entry in manifest.storages)
        self._last_checkpoint_s = time.perf_counter() - started
        return taken

    def _standby_source(self) -> Source | None:
        """This host as the standby's source of the next checkpoint; None when checkpoints
        go to the consumer only: by choice, with no standby left usable (gone, or failing
        copy after copy), or on a channel that cannot name its host."""
        if not self._placement.on_standby:
            return None
        standby = self._usable_standby()
        if standby is None:
            return None
        address = getattr(self._channel, "peer_address", None)
        token = self.info.get("token")
        if address is None or not isinstance(token, str):
            log.warning("cumulus: this channel cannot name its host to a standby")
            return None
        return Source(address, grant_of(token))

    def _usable_standby(self) -> StandbyLink | None:
        """The standby for the next checkpoint; one that is lost or failing is replaced
        when ``replace_standby`` can find another, else dropped."""
        standby = self._standby
        if standby is None or standby.usable:
            return standby
        why, replace = standby.why_unusable, self._replace_standby
        self._replace_standby = None  # one replacement in flight at a time
        standby.close()
        self._replaced_copies += standby.replications
        self._standby = None
        # Outgrown: room for the checkpoint and half as much again, as state grows.
        gib = math.ceil(standby.outgrown_bytes * 1.5 / 2**30)
        try:
            channel = None if replace is None else replace(why, gib)
            if channel is not None:
                self._standby = StandbyLink(channel, address=channel.peer_address)
                self._replace_standby = replace
                log.warning("cumulus: %s; a new standby takes the checkpoints", why)
        except (OSError, CumulusError) as exc:
            log.warning("cumulus: %s, and no new standby could be had: %s", why, exc)
        if self._standby is None:
            log.warning("cumulus: checkpoints go to the consumer's store from now on")
        return self._standby

    def _read_pieces(self, seq: int, manifest: Manifest) -> Checkpoint | None:
        """Read the pieces of ``manifest`` the consumer's store lacks, and keep the whole
        checkpoint there; the log restarts after it. None if the host was lost meanwhile.

        Runs right after a reply, when no op is queued (the frees still pending went with
        the checkpoint's query, so it leaves out tensors that died during the last batch).
        That batch changes state, so it is logged; the reads after it change nothing.
        """
        images = ImageAssembler(manifest, self._store.piece)
        reads = plan_reads(manifest, images.holds, budget=_chunk(self._channel))
        read_bytes = sum(length for query in reads for _, _, length in query)
        progress = self.progress("checkpoint", read_bytes)
        try:
            for query in reads:
                images.add(query, self._ask(["read", query])[1][1])
                self.advance(progress, sum(length for _, _, length in query))
        except _ChannelLost as lost:
            self._fail_over(lost.cause, None)
            return None
        checkpoint = images.checkpoint(seq)
        self._checkpoint_read_bytes = read_bytes
        if self._rejoin is not None:
            self._held = checkpoint  # the group commits it once every rank holds one
            return checkpoint
        self._store.save(checkpoint)
        self._log.reset(seq)
        return checkpoint

    def _ask(self, query: list) -> tuple[int, tuple[Any, list[memoryview]]]:
        """One empty batch asking ``query``; raises ``_ChannelLost`` instead of failing over."""
        self._seq += 1
        seq = self._seq
        try:
            self._channel.send_frame(encode_frame(["batch", seq, [], [], query, []]))
            frame = self._channel.recv_frame()
        except SessionClosedError as exc:
            raise _ChannelLost(exc) from exc
        lost_here = self._lost(frame)  # a worker that died while its storages were read
        if lost_here is not None:
            raise _ChannelLost(lost_here)
        return seq, self._read_reply(frame, seq)

    # --- a collective group's recovery (``regroup.py``) ----------------------------------

    def join_group_recovery(self, rejoin: Rejoin, gave_up: Callable[[], None]) -> None:
        """Hand this session's checkpoints and cold failovers to its collective group.

        From now on a checkpoint is taken only when the group asks (``checkpoint``), and
        is held until the group commits it (``commit_checkpoint``); a collective that fails
        because a peer is lost, or a failover that cannot resume the session from its
        host's cache, rebuilds the session from the last committed checkpoint and calls
        ``rejoin(ask, channel, info)`` before replaying the log, to re-form the group on the
        fresh session (``ask(records, query)`` runs records there, outside the log).
        ``gave_up()`` is called when failover gives up, before ``FailoverError``.

        Raises:
            ValueError: failover is off or not the group's (``group_failover``), or
                checkpoints go to a standby (a standby's copy cuts the log on its own
                time, not the group's).
        """
        if self._log is None or not self._group_failover:
            raise ValueError("a group can outlive its hosts only with failover (reconnect=)")
        if self._standby is not None:
            raise ValueError("a group's checkpoints go to this machine, not to a standby")
        self._rejoin, self._gave_up = rejoin, gave_up

    def checkpoint_due(self) -> bool:
        """Whether the checkpoint policy asks for one now (the interval, the log's size)."""
        log_bytes = 0 if self._log is None else self._log.nbytes
        return self._policy.due(now=time.monotonic(), log_bytes=log_bytes, at_sync_point=True)

    def commit_checkpoint(self) -> None:
        """Make the held checkpoint the one failover restores; the log restarts after it."""
        with self._lock:
            held, self._held = self._held, None
            if held is None:
                raise ValueError("no checkpoint is held: take one first")
            self._store.save(held)
            self._log.reset(held.seq)

    def unlogged(self, records: list, query: list) -> Any:
        """Send what is queued, then run ``records`` and answer ``query`` outside the
        replay log: a group's join, which a cold failover redoes for itself."""
        with self._lock:
            self.flush()
            return self._ask_on(self._channel, self._seq, records, query)

    def roll_back(self, why: str) -> None:
        """Rebuild the session from its last committed checkpoint and replay the log
        (the group re-forms on the way): another rank's host was lost."""
        with self._lock:
            self.flush()
            self._go_back(why, None)

    def _go_back(self, why: str, awaiting: int | None) -> bytearray | None:
        """``_fail_over`` from the group's checkpoint, this session's host being alive
        (another's was lost). Meanwhile ``going_back`` is True, so that ``reconnect`` may
        return to that host (a leased one, under the same lease)."""
        self.going_back = True
        try:
            return self._fail_over(SessionClosedError(why), awaiting, cold=True)
        finally:
            self.going_back = False

    @property
    def regroups(self) -> bool:
        """Whether a collective group took over this session's failover: a move to
        another host takes the whole group back with it (``join_group_recovery``)."""
        return self._rejoin is not None

    def _ask_on(self, channel: FrameChannel, seq: int, records: list, query: list) -> Any:
        channel.send_frame(encode_frame(["batch", seq, records, [], query, []]))
        return self._read_reply(channel.recv_frame(), seq)[0]

    # --- failover -----------------------------------------------------------------------

    def _fail_over(
        self, cause: SessionClosedError, awaiting: int | None, *, cold: bool = False
    ) -> bytearray | None:
        """Move the session to a new channel; return the reply to batch ``awaiting``.
        ``cold``: rebuild it from the checkpoint, never resume it from a host's cache.

        Raises:
            SessionClosedError: ``cause`` itself when failover is off.
            FailoverError: every attempt failed.
        """
        if self._reconnect is None:
            self.closed = True
            raise cause
        started = time.perf_counter()
        self.lost_because = str(cause)
        log.info("cumulus: lost the executor (%s); failing over", cause)
        last: BaseException = cause
        attempts = 0
        for attempts in range(1, self._attempts + 1):
            try:
                reply = self._recover(awaiting, cold=cold)
            except (OSError, CumulusError) as exc:
                log.warning("cumulus: failover attempt %d failed: %s", attempts, exc)
                last = exc
                if isinstance(exc, FailoverError):
                    break  # no state to restore, or a group that cannot re-form: final
                continue
            self.failovers += 1
            self.last_failover_s = time.perf_counter() - started
            # A host lost is news to whoever runs the script: said whatever the log level.
            log.warning(
                "cumulus: session moved to %s in %.3f s; its state came from %s; it left "
                "its host because: %s",
                self.info.get("device"),
                self.last_failover_s,
                self._restored_from,
                cause,
            )
            return reply
        self.closed = True
        if self._rejoin is not None:
            self._gave_up()  # the other ranks stop waiting for this one
        tries = f"{attempts} failover attempts" if attempts > 1 else "the failover attempt"
        raise FailoverError(
            f"lost the executor ({cause}) and {tries} failed; the last one: {last}"
        ) from last

    def _recover(self, awaiting: int | None, *, cold: bool = False) -> bytearray | None:
        self._held = None  # a checkpoint the group had not committed: every rank drops it
        started = time.perf_counter()
        # Connected before the old session is left: a leased host ends a lease whose
        # last session ended, and a session going back returns under the same lease.
        channel = self._reconnect()
        self._reconnect_s = time.perf_counter() - started
        if cold:
            self._leave_host()
        try:
            info = None if cold else self._resume(channel)
            if info is not None:
                reply = self._replay(channel, info["last_seq"], awaiting, resumed=True)
                self._cache_resumes += 1
            else:
                info = self._handshake(channel, self._options)
                self._restore(channel, info)
                if self._rejoin is not None:
                    ask = functools.partial(self._ask_on, channel, self._log.after_seq)
                    self._rejoin(ask, channel, info)
                replaying = time.perf_counter()
                reply = self._replay(channel, self._log.after_seq, awaiting, resumed=False)
                # The new session runs the log's collectives again, and its host counts
                # the bytes they carry again: so does this side.
                replayed = self._log.peer_bytes_since(self._log.after_seq)
                self._count_peer_bytes_on(channel, replayed)
                self._replay_s = time.perf_counter() - replaying
                # The checkpoint and the log just rebuilt the session, as they would again:
                # a checkpoint now would protect nothing more, so the interval starts over.
                self._policy.taken(now=time.monotonic())
        except BaseException:
            channel.close()
            raise
        old, self._channel, self.info = self._channel, channel, info
        old.close()
        return reply

    def _leave_host(self) -> None:
        """End the session on its host before it is rebuilt (on that host, often: one
        that is alive but whose group broke), so that the host does not hold it twice."""
        with contextlib.suppress(SessionClosedError, OSError):
            self._channel.send_frame(encode_frame(["bye"]))
        self._forget_token()

    def _resume(self, channel: FrameChannel) -> dict | None:
        """Ask for the session by its token; its welcome info, or None if refused."""
        token = self.info.get("token")
        if not isinstance(token, str):
            return None
        channel.send_frame(encode_frame(["resume", PROTOCOL_VERSION, {"token": token}]))
        try:
            header, _ = decode_frame(channel.recv_frame())
        except SessionClosedError:
            # Closed on the resume: whatever held the session is gone (a supervisor that
            # has not yet reaped a killed worker closes the resumes that reach it). The
            # next attempt says hello and restores from the checkpoint.
            self._forget_token()
            raise
        if header[0] == "refused":
            return None
        info = _welcome_info(header)
        if type(info.get("last_seq")) is not int or info["last_seq"] < self._log.after_seq:
            # Not the state this log continues: never reuse it (a bye releases it there).
            self._forget_token()
            channel.send_frame(encode_frame(["bye"]))
            raise RemoteProtocolError("the host resumed the session from before its checkpoint")
        return info

    def _forget_token(self) -> None:
        """Never present this session's token again: the next failover says hello."""
        self.info = {**self.info, "token": None}

    def _restore(self, channel: FrameChannel, info: dict) -> None:
        """Rebuild the latest checkpoint in the fresh session on ``channel``: from the
        hosts that keep it when the standby holds it, else uploaded from the store."""
        # A copy the standby finished since the last batch counts: the host may have died
        # before any batch could take it, and the copy before it may have been on a
        # standby since lost.
        self._take_hosted()
        if self._log.after_seq == 0:
            self._restored_from = "a replay from the session's start (no checkpoint yet)"
            return
        hosted = self._hosted
        if hosted is not None and hosted.seq == self._log.after_seq:
            try:
                self._pull_hosted(channel, hosted)
            except FailoverError as exc:
                if not self._placement.on_consumer:
                    raise
                log.warning("cumulus: %s; restoring the consumer's copy instead", exc)
            else:
                rng = hosted.manifest.rng_state
                fits = _rng_fits(info, hosted.manifest.device)
                batches = [([rng_record(rng, 0)], [rng])] if fits else []
                self._send_restore(channel, hosted.seq, batches, total=0)
                where = ", ".join(s.address.rpartition("@")[2] for s in hosted.sources)
                self._restored_from = f"the hosts that keep its checkpoint ({where})"
                return
        checkpoint = self._store.load()
        if checkpoint is None or checkpoint.seq != self._log.after_seq:
            raise FailoverError("the checkpoint store no longer holds the latest checkpoint")
        with_rng = _rng_fits(info, checkpoint.device)
        held = _held_by(channel, info, checkpoint)
        batches = restore_batches(checkpoint, with_rng=with_rng, budget=_chunk(channel), held=held)
        skipped = sum(
            len(p)
            for image in checkpoint.storages
            for p, name in zip(image.pieces, image.digests, strict=True)
            if name in held
        )
        self.blob_bytes_skipped += skipped
        self._send_restore(channel, checkpoint.seq, batches, total=checkpoint.nbytes - skipped)
        self._restored_from = "this machine's checkpoint"
        if skipped:
            self._restored_from += f" ({skipped / 2**20:.0f} MiB of it already on that host)"

    def _pull_hosted(self, channel: FrameChannel, hosted: HostCheckpoint) -> None:
        """Have the fresh host make ``hosted``'s storages and pull their pieces into them
        from the hosts that keep it (``restoring.py``)."""
        started = time.perf_counter()
        sources = [[s.address, s.grant] for s in hosted.sources]
        log.info(
            "cumulus: the new host pulls the checkpoint (%.1f MB) from %s",
            hosted.nbytes / 1e6,
            ", ".join(s.address for s in hosted.sources),
        )
        storages = [
            [e.handle, e.dtype, e.nbytes, list(e.digests)] for e in hosted.manifest.storages
        ]
        channel.send_frame(encode_frame(["restore", {"sources": sources, "storages": storages}]))
        header, _ = decode_frame(channel.recv_frame())
        result = header[1] if header[0] == "restored" and len(header) == 2 else None
        if not isinstance(result, dict) or result.get("error") is not None:
            why = result.get("error") if isinstance(result, dict) else header
            raise FailoverError(f"the new host could not pull the checkpoint: {why}")
        self._restore_pulled_bytes = result.get("fetched_bytes", 0)
        self._restore_pull_s = time.perf_counter() - started
        log.info(
            "cumulus: the new host pulled %.1f MB of the checkpoint from %s in %.2f s",
            self._restore_pulled_bytes / 1e6,
            ", ".join(s.address for s in hosted.sources),
            self._restore_pull_s,
        )

    def _send_restore(
        self, channel: FrameChannel, seq: int, batches: Iterable, *, total: int
    ) -> None:
        progress = self.progress("restore", total)
        for ops, blobs in batches:
            header = ["batch", seq, ops, [], None, [len(b) for b in blobs]]
            channel.send_frame(encode_frame(header, blobs))
            self.advance(progress, sum(len(b) for b in blobs))
        # Graphs live outside the checkpoint: the replay's @run records need them again.
        graphs = list(self._graphs.values())
        channel.send_frame(encode_frame(["batch", seq, graphs, [], ["sync"], []]))
        self._read_reply(channel.recv_frame(), seq)

    def _replay(
        self, channel: FrameChannel, after_seq: int, awaiting: int | None, *, resumed: bool
    ) -> bytearray | None:
        """Send the logged frames after ``after_seq``; return the reply to ``awaiting``.

        Replies to other logged queries were seen before the failure: they are read (the
        same, since the stream is deterministic) and dropped.
        """
        if resumed and awaiting is not None and awaiting <= after_seq:
            channel.send_frame(encode_frame(["resend", awaiting]))
            return channel.recv_frame()
        answer = None
        for entry in self._log.since(after_seq):
            channel.send_frame([entry.frame])
            if entry.has_query:
                frame = channel.recv_frame()
                if entry.seq == awaiting:
                    answer = frame
                else:
                    _check_replayed(frame, entry.seq)
        if awaiting is not None and answer is None:
            raise RemoteProtocolError(f"batch {awaiting} is missing from the replay log")
        return answer

    def failover_statistics(self) -> FailoverStatistics:
        """Failovers and checkpoints so far, and the replay log's size now."""
        log_ = self._log
        copies = self._replaced_copies + (
            [] if self._standby is None else self._standby.replications
        )
        return FailoverStatistics(
            failovers=self.failovers,
            cache_resumes=self._cache_resumes,
            cold_restores=self.failovers - self._cache_resumes,
            last_failover_s=self.last_failover_s,
            checkpoints=self._checkpoints,
            last_checkpoint_s=self._last_checkpoint_s,
            checkpoint_bytes=self._checkpoint_bytes,
            checkpoint_read_bytes=self._checkpoint_read_bytes,
            log_frames=0 if log_ is None else len(log_),
            log_bytes=0 if log_ is None else log_.nbytes,
            replicated_checkpoints=len(copies),
            last_replication_bytes=copies[-1].fetched_bytes if copies else 0,
            last_replication_s=copies[-1].seconds if copies else None,
            restore_pulled_bytes=self._restore_pulled_bytes,
            restore_pull_s=self._restore_pull_s,
            reconnect_s=self._reconnect_s,
            replay_s=self._replay_s,
        )

    def close(self) -> None:
        """End the session; the executor releases all of its memory. With a standby, a
        checkpoint still being copied is copied first. Idempotent."""
        with self._lock:
            if self.closed:
                return
            self._reconnect = None  # leaving: a lost host just ends the session now
            try:
                self.flush()
                if self._standby is not None:
                    # The copy under way reads from this session: let it finish first.
                    self._standby.close()
                self._channel.send_frame(encode_frame(["bye"]))
            except SessionClosedError:
                pass
            finally:
                self.closed = True
                self._channel.close()


class _Named:
    """A queued ``@blob`` record, its bytes, and whether the host holds them (None: ask)."""

    __slots__ = ("record", "view", "here")

    def __init__(self, record: list, view: memoryview, here: bool | None) -> None:
        self.record = record
        self.view = view
        self.here = here


def _bytes_ref(view: memoryview, blob: int) -> CpuTensorRef:
    return CpuTensorRef(torch.uint8, (len(view),), blob)


class _ChannelLost(Exception):
    """The channel broke while taking a checkpoint (carries the transport's error)."""

    def __init__(self, cause: SessionClosedError) -> None:
        super().__init__(str(cause))
        self.cause = cause


def print_progress(progress: TransferProgress) -> None:
    """The default progress report: an INFO log line, also on stderr when nothing
    configured logging (a plain script, or one run under the shim)."""
    line = progress.line(now=time.monotonic())
    log.info("%s", line)
    if not log.hasHandlers():
        print(line, file=sys.stderr, flush=True)


def stream_chunk(channel: FrameChannel) -> int:
    """Bytes per piece of a streamed upload or read over ``channel``."""
    return max(1, min(STREAM_CHUNK, channel.max_frame // 4))


def _held_by(channel: FrameChannel, info: dict, checkpoint: Checkpoint) -> frozenset[str]:
    """The checkpoint's pieces the fresh session's host holds already (one ``have``, for
    the first ``MAX_HAVE``): the same host after its worker died, with the session's
    memory evicted to its disk, or any host that kept the same bytes."""
    if not info.get("blob_store"):
        return frozenset()
    names = list(dict.fromkeys(n for image in checkpoint.storages for n in image.digests))
    names = names[:MAX_HAVE]
    if not names:
        return frozenset()
    channel.send_frame(encode_frame(["have", names]))
    header, _ = decode_frame(channel.recv_frame())
    held = _have_answer(header, names)
    return frozenset(n for n, here in zip(names, held, strict=True) if here)


def _have_answer(header: list, names: list[str]) -> list[bool]:
    """The host's answer to ``["have", names]``, checked: which of them it holds."""
    answer = header[1] if header[0] == "have" and len(header) == 2 else None
    if not (isinstance(answer, list) and len(answer) == len(names)):
        raise RemoteProtocolError(f"unexpected answer to have: {header[0]!r}")
    return [a is True for a in answer]


def _chunk(channel: FrameChannel) -> int:
    """Tensor bytes per frame while moving a checkpoint: well inside the frame limit."""
    return max(1, min(TRANSFER_CHUNK, channel.max_frame // 2))


def _rng_fits(info: dict, device: str) -> bool:
    """Whether a checkpoint's RNG state, from ``device``, fits the executor of ``info``."""
    if info.get("device") == device:
        return True
    why = "cumulus: a %s executor cannot take a %s RNG state; random draws will differ"
    log.warning(why, info.get("device"), device)
    return False


def _placement(
    choice: CheckpointPlacement | str | None, standby: StandbyLink | None
) -> CheckpointPlacement:
    if choice is None:
        return CheckpointPlacement.CONSUMER if standby is None else CheckpointPlacement.STANDBY
    placement = CheckpointPlacement(choice)
    if placement.on_standby and standby is None:
        raise ValueError(f"checkpoint_to={placement.value!r} needs a standby=")
    return placement


def _welcome_info(header: list) -> dict:
    if header[0] != "welcome" or len(header) != 3 or not isinstance(header[2], dict):
        raise RemoteProtocolError(f"expected welcome from the executor, got {header[0]!r}")
    return header[2]


def _check_replayed(frame: bytearray, seq: int) -> None:
    """A replayed query's reply: its errors were raised the first time; its kind must fit."""
    header, _ = decode_frame(frame)
    if header[0] != "reply" or len(header) != 5 or header[1] != seq:
        raise RemoteProtocolError(f"replay of batch {seq} got {header[0]!r} instead of a reply")


class _Current:
    """The sessions this process's ``cumulus`` devices talk to: ``cumulus:i`` is
    ``sessions[i]``, each on its own host; ``index`` is the current device
    (``torch.cumulus.set_device``), which ``device="cumulus"`` without an index names."""

    def __init__(self) -> None:
        self.sessions: list[RemoteSession] = []
        self.index = 0
        #: The groups between two devices' hosts, by their indexes (``moves.py``).
        self.pairs: dict[tuple[int, int], Any] = {}

    @property
    def session(self) -> RemoteSession | None:
        """The current device's session; None when nothing is attached."""
        return self.sessions[self.index] if self.index < len(self.sessions) else None


#: The sessions the ``cumulus`` devices currently talk to.
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


def device_index(device) -> int | None:
    """The index a device argument names (``1``, ``"cumulus:1"``, a ``torch.device``);
    None where it names none (``None``, ``"cumulus"``): the current device."""
    if device is None or isinstance(device, int):
        return device
    return torch.device(device).index


def device_session(device) -> RemoteSession:
    """The session of the ``cumulus`` device ``device`` names (``device_index``; the
    current device's for None or a bare ``"cumulus"``).

    Raises:
        SessionClosedError: nothing is attached.
        RuntimeError: this process has no such device (as torch says of a CUDA index).
    """
    index = device_index(device)
    if index is None or (index == CURRENT.index and CURRENT.sessions):
        return current_session()
    count = len(CURRENT.sessions)
    if not 0 <= index < count:
        current_session()  # nothing attached: say so, and what to do
        raise RuntimeError(
            f"cumulus:{index} does not exist: this process attached {count} cumulus "
            f"device(s), cumulus:0 to cumulus:{count - 1} (attach one address per device)"
        )
    session = CURRENT.sessions[index]
    if session.closed:
        raise SessionClosedError(f"the session of cumulus:{index} is closed; attach a new one")
    return session


def group_broke(error: RemoteExecutionError) -> bool:
    """Whether an op's error says its collective group broke (a peer lost:
    ``ErrorKind.GROUP``), rather than something the script must see."""
    return error.remote_type == GROUP_ERROR


def _batch_header(seq: int, ops: list, frees: list, query, blobs: list, grows: int) -> list:
    """A ``batch`` header; its growth only when it has some, so that a batch creating no
    storage reads as it did before the field existed."""
    header = ["batch", seq, ops, frees, query, [len(b) for b in blobs]]
    return [*header, grows] if grows else header
