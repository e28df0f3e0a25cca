"""A native session: the device's batches go to a host's executor, readbacks come back.

    ext = native.load()
    with NativeSession.connect(host, port):  # or NativeSession(any FrameChannel)
        model = model.to("cumulus")          # uploads: records in the batch
        loss = train_step(model)             # ops: records in the batch, no Python per op
        print(loss.item())                   # a sync point: the batch goes, bytes return

The executor is the host's own (``cumulus-executor``, or the one a provider's node
runs): a session opens with the op stream's ``hello`` naming the native frames'
version, and the executor replays each batch with the C++ loop (``ReplaySession``).
Any ``FrameChannel`` carries it: plain TCP to a trusted executor, or the secure
channel to a provider (``cumulus_p2p.channel.secure.connect_secure``).

Python runs once per flush. A flush takes the device's batch (``take_batch``) and the
op names interned since the last one, and sends them as one frame (``wire.native``).
Without a readback nothing waits: ``flush()`` sends and returns; the device also calls
it by itself once the batch holds ``flush_bytes``, so that the executor replays the
start of a step while the client records the rest. A readback (``.cpu()``, ``.item()``,
``print``) reaches the device's readback hook, which this session sets: it flushes,
waits for the executor's reply and copies the bytes into the host tensor torch handed
the hook.

A session starts afresh: tensors made before it (with no session, or with an earlier
one) have no storage on its executor, and using one fails there as an unknown handle.

Errors: the executor replays nothing after a record fails; the next reply carries the
failure and this session raises ``NativeSessionError`` from that readback and every
later one. An executor that ends the session raises ``SessionClosedError`` with its
reason.

Failover (with ``reconnect``): a lost executor is replaced by another, and the session
is rebuilt there from its last checkpoint (``checkpoint``: the storages' pieces, read
back only where they changed) and the batches sent since (``replaylog``, bounded in
size), or from its start while it has no checkpoint. A checkpoint is taken at a sync
point (a readback) every ``checkpoint_interval`` seconds, and whenever the log is half
full. Random ops draw from the executor session's generator, which ``torch.manual_seed``
seeds (a SEED record, in order with the ops around it); a checkpoint keeps its state.

With a ``standby`` (``blobs.standby.StandbyLink``, a second host), checkpoints stay on
the host side: the executor keeps a copy of the pieces (a KEEP request), the standby
pulls them from it while the session goes on, and the checkpoint counts once the
standby holds them all; a move has the fresh executor pull them from the standby (a
RESTORE request). The consumer's link carries the manifest of digests, not the state.
One copy runs at a time. A standby that is lost, or fails copy after copy, is let go,
and the checkpoints come to the client from then on, as without one.

A lost connection is first resumed where the session was: the host keeps a native
session parked (its storages, its generator, its kept pieces) when its connection drops
or its lease's time is up, as it keeps the Python device's. The client presents the
session's token on the channel ``reconnect`` gives; the executor says how many batches
it received, and the client sends only those after (or asks for the last reply again,
RESEND, when the batch in flight ran but its reply was lost). Nothing is restored. A
host that holds no such session refuses, and the session is rebuilt there as above.

Not in this slice: a standby replaced when lost, and device turns cut between the ops of
a batch.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
import torch

from .._errors import (
    CumulusError,
    FailoverError,
    MalformedMessageError,
    PeerUnreachableError,
    SessionClosedError,
    SessionRefusedError,
)
from ..blobs.elsewhere import FetchElsewhere
from ..blobs.service import Source, grant_of
from ..blobs.standby import StandbyLink
from ..channel.transport import FrameChannel, SocketFrameChannel, silence_limit
from ..wire import native as wire
from ..wire.protocol import PROTOCOL_VERSION, decode_frame, encode_frame
from . import load, named, records
from .checkpoint import (
    Checkpoint,
    PieceStore,
    StandbyCheckpoint,
    groups,
    host_checkpoint,
    pieces_of,
    readback_batch,
    rng_batch,
)
from .replaylog import DEFAULT_LIMIT_BYTES, ReplayLog

log = logging.getLogger(__name__)

#: A batch goes once it holds this much (about 150 records), so that the executor replays
#: the start of a step while the client records the rest: a seventh of a tiny
#: transformer's step, which such frames made 1.2-1.4x faster than sending only at sync
#: points (BENCHMARKS.md, "The native session on the host's own executor"). 0: only at
#: sync points.
DEFAULT_FLUSH_BYTES = 16 * 1024
#: A batch goes at the latest once it holds this much, whatever ``flush_bytes`` says, so
#: that a frame stays well under the channel's limit (256 MiB) when a large tensor's
#: upload pieces (16 MiB each) pile up between sync points.
MAX_BATCH_BYTES = 64 * 1024**2
#: Executors lost in a row while one batch is sent before the session gives up.
MAX_MOVES = 4


class NativeSessionError(CumulusError):
    """The executor could not run a record of this session's batches.

    Attributes:
        record: the failing record's index in its batch; ``kind``: the rule it broke
            (``errors.KINDS``).
    """

    def __init__(self, message: str, record: int = -1, kind: str = "") -> None:
        super().__init__(message)
        self.record = record
        self.kind = kind


class NativeSession:
    """One executor session for this process's native ``cumulus`` device."""

    def __init__(
        self,
        channel: FrameChannel,
        *,
        quota: int | None = None,
        flush_bytes: int = DEFAULT_FLUSH_BYTES,
        reconnect: Callable[[str], FrameChannel] | None = None,
        log_bytes: int = DEFAULT_LIMIT_BYTES,
        checkpoint_interval: float | None = None,
        checkpoint_dir: Path | None = None,
        standby: StandbyLink | None = None,
        replace_standby: Callable[[str, int], StandbyLink | None] | None = None,
        private: bool = False,
        fetch_elsewhere: Callable[[list[str]], dict] | None = None,
    ) -> None:
        """Open a session over ``channel``: at most ``quota`` bytes of storages (the
        executor caps it at its own), batches sent early once they hold ``flush_bytes``
        (0: only at sync points and once they hold ``MAX_BATCH_BYTES``).

        With ``reconnect``, a lost executor is replaced: ``reconnect(why)`` returns a
        channel to another one, and the session is rebuilt there from its last
        checkpoint and the batches sent since, kept while they fit in ``log_bytes``.
        A checkpoint is taken at a readback every ``checkpoint_interval`` seconds (0:
        at every one; None: only when the log is half full), its pieces kept in memory,
        or under ``checkpoint_dir`` (a directory the session then owns, removed when it
        closes), or on ``standby``'s host (the session then owns the link). A standby
        that is lost or fails is replaced by ``replace_standby(why, gib)`` (``gib``: the
        GiB the next must lend, 0 for as many as the last), or None: then the client
        keeps the checkpoints from then on. Uploads the host's blob store holds go by
        digest (``named.py``), and the host keeps the others there, unless ``private``;
        ``fetch_elsewhere(digests)`` (the node's ``fetch``) first has the host fetch the
        pieces it lacks from other hosts that announce them.

        Raises:
            SessionClosedError: the executor refused the session; the message says why.
        """
        self._ext = load()
        self._channel = channel
        self._quota = quota
        self.info = _hello(channel, quota)
        self._reconnect = reconnect
        self._log = ReplayLog(log_bytes) if reconnect is not None else None
        self._interval = checkpoint_interval
        self._checkpoint: Checkpoint | StandbyCheckpoint | None = None
        self._pieces = PieceStore(checkpoint_dir)
        self._standby = standby if reconnect is not None else None
        self._replace_standby = replace_standby
        self._private = private
        self._elsewhere = FetchElsewhere(None if private else fetch_elsewhere)
        #: Bytes of uploads sent by digest (the host's store held them).
        self.upload_bytes_named = 0
        #: The checkpoint the standby is copying, and where the log stood when it was taken.
        self._copying: tuple[StandbyCheckpoint, int] | None = None
        self._checkpointed_at = time.monotonic()
        #: Times the session moved to another executor, checkpoints it took, and the
        #: bytes those read back (only pieces that changed).
        self.failovers = 0
        #: Times the session was taken up again where it was parked (nothing restored),
        #: and the BATCH requests its executor counted.
        self.resumes = 0
        self._counted = 0
        self.checkpoints = 0
        self.checkpoint_bytes = 0
        #: Bytes fresh executors pulled from the standby to restore this session, and
        #: where the last move's state came from.
        self.restored_bytes = 0
        self._restored_from = ""
        # A new executor knows no names (the whole table goes with the first flush) and
        # no storages: records pending from before, and the deaths of tensors made
        # before, are not for it.
        self._names_sent = 0
        #: Compiled graphs defined on this session (``compile.py``): sent again to a
        #: host the session moves to, before the batches that call them.
        self.graphs: set[int] = set()
        self._ext.begin_session()
        self._failure: NativeSessionError | None = None
        self.flushes = 0
        #: Records sent, and a transfer under way (never: uploads are records too), as
        #: the node's job status shows a session (``node.dial.Counted``).
        self.ops_sent = 0
        self.transfer = None
        # Autograd's device thread may flush (early) while the main thread waits in
        # backward(); one lock keeps a frame whole and replies in order.
        self._lock = threading.Lock()
        self._ext.set_readback_hook(self._read_back)
        self._ext.set_sync_hook(self._sync)
        self._ext.set_flush_hook(self.flush, min(flush_bytes or MAX_BATCH_BYTES, MAX_BATCH_BYTES))
        self._ext.set_executor_device(_device_type(self.info))
        global _CURRENT
        _CURRENT = self

    @classmethod
    def connect(cls, host: str, port: int, **options) -> NativeSession:
        """A session with the plain-TCP executor at ``host:port`` (a trusted one: plain
        TCP is neither authenticated nor encrypted); ``options`` as the constructor's."""
        channel = SocketFrameChannel.connect(host, port, silence_s=silence_limit())
        try:
            return cls(channel, **options)
        except BaseException:
            channel.close()
            raise

    def __enter__(self) -> NativeSession:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def synchronize(self) -> None:
        """Wait until the executor ran every op sent or pending.

        Raises:
            NativeSessionError: the executor failed a record.
        """
        self.flush(wait=True)

    def flush(self, wait: bool = False) -> list[bytes]:
        """Send the pending records; with ``wait``, the batch's readbacks once it ran.

        Raises:
            NativeSessionError: (``wait`` only) the executor failed a record, in this
                batch or an earlier one.
        """
        with self._lock:
            batch, records = self._ext.take_batch()
            grows = self._ext.take_growth()
            names = self._ext.op_names(self._names_sent)
            self._names_sent += len(names)
            named_request = self._named(names, batch, wait, grows)  # before the log: it asks
            # Inline, a batch whose uploads could be named is still sent as NAMED: a host
            # that meets it on a resume or a move then keeps those uploads too.
            kind = wire.BATCH if named_request is None else wire.NAMED
            inline = wire.request(kind, names, batch, reply=wait, grows=grows)
            request = named_request or inline
            if self._log is not None:
                self._log.keep(names, batch, counted=self._counted, kind=kind)
            self.flushes += 1
            self.ops_sent += records
            frame = self._exchange(request, wait, inline=inline)
        if frame is None:
            return []
        reply = wire.parse_reply(frame)
        if isinstance(reply, tuple):
            record, kind, message = reply
            self._failure = NativeSessionError(f"the executor failed: {message}", record, kind)
        if self._failure is not None:
            raise self._failure
        return reply

    def _named(self, names: list[str], batch: bytes, wait: bool, grows: int) -> list | None:
        """``batch`` as a NAMED request whose uploads the host's store holds go by
        digest (``named.py``); None when it has no large upload, or the session is
        private."""
        if self._private or len(batch) < named.MIN_NAMED:  # the hot path: most batches
            return None
        uploads = named.large_uploads(batch)
        if not uploads:
            return None
        digests = named.digests(uploads)
        held = self._have(digests)
        missing = [name for name, here in zip(digests, held, strict=True) if not here]
        if missing and self._elsewhere(missing):
            held = self._have(digests)  # the question pins all it names: ask whole
        by_index = {i: d for (i, _), d, h in zip(uploads, digests, held, strict=True) if h}
        self.upload_bytes_named += sum(len(u) for (i, u) in uploads if i in by_index)
        named_batch = named.name_uploads(batch, by_index)
        return wire.request(wire.NAMED, names, named_batch, reply=wait, grows=grows)

    def _have(self, digests: list[str]) -> list[bool]:
        """Which of these pieces the host's store holds (it pins them for the next
        request)."""
        (answer,) = self._ask(wire.HAVE, msgpack.packb(digests))
        held = msgpack.unpackb(answer)
        if not isinstance(held, list) or len(held) != len(digests):
            raise MalformedMessageError("the executor's HAVE answer is not one per digest")
        return [here is True for here in held]

    @property
    def fetched_elsewhere_bytes(self) -> int:
        """Bytes of uploads the host fetched from other hosts instead."""
        return self._elsewhere.bytes

    def _exchange(
        self, request: list, wait: bool, *, logged: bool = True, inline: list | None = None
    ) -> bytearray | None:
        """Send ``request`` (the log's last batch, when ``logged``) and, with ``wait``,
        receive its reply; if the executor is lost, on the session resumed or moved
        (``_move``), ``MAX_MOVES`` times in a row at most, sending ``inline`` there
        instead, when given (the request with its uploads' bytes: another host may not
        hold what this one did)."""
        replay: list[list[bytes]] = []
        now: list | None = request
        lost = ""
        for _ in range(MAX_MOVES + 1):
            try:
                if lost:  # a host that refused or dropped the move is failed over too
                    replay, now = self._move(lost, inline or request, wait, logged)
                for frame in [*replay, *([now] if now is not None else [])]:
                    self._send(frame)
                return self._channel.recv_frame() if wait else None
            except FailoverError:
                raise
            except (OSError, SessionClosedError, SessionRefusedError, PeerUnreachableError) as exc:
                lost = f"lost the executor ({exc})"
        raise FailoverError(
            f"the session could not move: {MAX_MOVES} hosts in a row were lost; the last: {lost}"
        )

    def _send(self, frame: list) -> None:
        """Send one request, counting the BATCH requests as the executor counts them."""
        self._channel.send_frame(frame)
        if frame[0][0] in wire.BATCHES:
            self._counted += 1

    def _move(
        self, lost: str, request: list, wait: bool, logged: bool
    ) -> tuple[list[list[bytes]], list | None]:
        """Take the session up on the executor ``reconnect`` gives: resumed there if it
        kept it parked, else rebuilt. Returns what to send before the reply is read: the
        requests that catch the executor up, and the request in flight (or RESEND, when
        the executor ran it already; None when nothing is to come back).

        Raises:
            FailoverError: the session cannot move; the message says why.
        """
        if self._log is None:
            raise FailoverError(
                f"{lost}, and the session cannot move: it was opened with one executor and "
                "no other to move to, and its tensors are gone with that host (under "
                "cumulus-node --consume --native the node leases another)"
            )
        if self._log.lost_because is not None:
            raise FailoverError(
                f"{lost}, and the session cannot move to another host: "
                f"{self._log.lost_because}. Its tensors are gone with that host; take "
                "checkpoints more often (checkpoint_interval)"
            )
        channel = self._reconnect(lost)
        self._channel.close()
        self._channel = channel
        resumed = _resume(channel, self.info.get("token"))
        if resumed is not None:
            return self._caught_up(resumed, request, wait, logged)
        self.info = _hello(channel, self._quota)
        self._ext.set_executor_device(_device_type(self.info))
        self.failovers += 1
        self._counted = 0
        restore = self._restore() + self._graph_definitions()  # first: a copy may cut the log
        counted = sum(frame[0][0] in wire.BATCHES for frame in restore)
        frames = self._log.frames(first=counted)
        # A host lost is news to whoever runs the script: said whatever the log level.
        log.warning(
            "cumulus: session moved to another host; its state came from %s", self._restored_from
        )
        return restore + (frames[:-1] if logged else frames), request

    def _caught_up(
        self, info: dict, request: list, wait: bool, logged: bool
    ) -> tuple[list[list[bytes]], list | None]:
        """What a resumed session sends its executor: the logged batches it never
        received, then the request in flight, unless it received that one too."""
        self.info = info
        self.resumes += 1
        received = info["batches"]
        missing = self._log.unreceived(received)
        self._counted = received
        log.warning("cumulus: session resumed on its host, %d batches sent again", len(missing))
        in_flight = self._log.last_counted if logged else None
        if in_flight is None or in_flight >= received:
            return (missing[:-1] if logged else missing), request
        resend = wire.request(wire.RESEND, [], b"", reply=True)
        return missing, resend if wait else None

    def _restore(self) -> list[list[bytes]]:
        """The requests that rebuild the last checkpoint on a fresh executor (none
        without one): the op names interned by then go with the first. A standby's
        checkpoint is pulled there first, before this returns.

        Raises:
            FailoverError: the fresh executor could not pull the standby's pieces.
        """
        self._take_copied(wait=True)
        checkpoint = self._checkpoint
        if checkpoint is None:
            self._restored_from = "a replay from the session's start (no checkpoint yet)"
            return []
        names = self._ext.op_names(0)[: checkpoint.names]
        if isinstance(checkpoint, StandbyCheckpoint):
            self._pull_restore(checkpoint)
            return [wire.request(wire.BATCH, names, checkpoint.rng_batch(), reply=False)]
        self._restored_from = "this machine's checkpoint"
        out = []
        for batch in self._pieces.restore_batches(checkpoint):
            out.append(wire.request(wire.BATCH, names, batch, reply=False))
            names = []
        return out

    def _graph_definitions(self) -> list[list[bytes]]:
        """A request defining this session's compiled graphs on a fresh executor (none
        without any): the log's batches may call graphs defined before its checkpoint."""
        if not self.graphs:
            return []
        from .compile import DEFINITIONS

        graphs = [records.Graph(graph, DEFINITIONS[graph]) for graph in sorted(self.graphs)]
        return [wire.request(wire.BATCH, [], records.encode(graphs, []), reply=False)]

    def _pull_restore(self, checkpoint: StandbyCheckpoint) -> None:
        """Have the fresh executor make the checkpoint's storages and pull their pieces
        from the hosts that keep them."""
        request = wire.request(wire.RESTORE, [], checkpoint.restore_request(), reply=True)
        self._channel.send_frame(request)
        reply = wire.parse_reply(self._channel.recv_frame())
        if isinstance(reply, tuple):
            raise FailoverError(
                f"the new host could not restore the session from its standby: {reply[2]}"
            )
        fetched = msgpack.unpackb(reply[0]).get("fetched_bytes", 0)
        self.restored_bytes += fetched
        where = f"{fetched / 2**20:.1f} MiB pulled from the standby"
        self._restored_from = f"the hosts that keep its checkpoint ({where})"

    # --- checkpoints ----------------------------------------------------------------------

    def checkpoint(self) -> Checkpoint | StandbyCheckpoint:
        """Take a checkpoint now (see the module's docstring): afterwards a move
        replays only what is sent from here on.

        Raises:
            ValueError: the session has no failover (no ``reconnect``).
            NativeSessionError: the executor failed a record.
            MalformedMessageError: the executor's answer is not what it asked for.
        """
        if self._log is None:
            raise ValueError("a session without failover (reconnect) takes no checkpoints")
        self.flush(wait=True)
        with self._lock:
            taken = self._take_checkpoint()
            if isinstance(taken, StandbyCheckpoint):
                taken = self._copied(taken) or self._to_client()
            return taken

    def _take_checkpoint(self) -> Checkpoint | StandbyCheckpoint:
        """Take a checkpoint where it goes: to the standby while one is usable (after
        the copy under way), else to the client."""
        standby = self._usable_standby()
        if standby is None:
            return self._to_client()
        self._take_copied(wait=True)
        gap = self._log.lost_because is not None
        taken = self._to_standby(standby)
        if gap:  # no log to move with until the copy is done: wait for it
            return self._copied(taken) or self._to_client()
        return taken

    def _copied(self, taken: StandbyCheckpoint) -> StandbyCheckpoint | None:
        """Wait for the standby's copy of ``taken``: the checkpoint as it stands now, or
        None if the standby could not keep it."""
        self._take_copied(wait=True)
        now = self._checkpoint
        held = isinstance(now, StandbyCheckpoint) and now.held.seq == taken.held.seq
        return now if held else None

    def _to_standby(self, standby: StandbyLink) -> StandbyCheckpoint:
        """Have the executor keep the pieces, and the standby start copying them; the
        checkpoint counts once the copy is done (``_take_copied``)."""
        manifest = wire.parse_manifest(self._ask(wire.KEEP, b"")[0])
        (rng_state,) = self._ask(wire.BATCH, rng_batch())
        if self._log.lost_because is not None:
            self._log = ReplayLog(self._log.limit_bytes)
        source = Source(self._channel.peer_address, grant_of(self.info["token"]))
        held = host_checkpoint(self.checkpoints + 1, manifest, bytes(rng_state), source)
        taken = StandbyCheckpoint(held, self._names_sent)
        self._copying = (taken, self._log.mark())
        standby.replicate(held)
        self._checkpointed_at = time.monotonic()
        self.checkpoints += 1
        return taken

    def _take_copied(self, *, wait: bool = False) -> None:
        """Count the checkpoint the standby finished copying: the log is cut there. A
        copy that failed leaves the previous checkpoint standing."""
        if self._standby is None or self._copying is None:
            return
        if wait:
            self._standby.wait()
        elif self._standby.busy:
            return
        (taken, mark), self._copying = self._copying, None
        finished = self._standby.take_finished()
        if finished is None or finished.seq != taken.held.seq:
            return
        self._checkpoint = StandbyCheckpoint(finished, taken.names)
        self._log.cut(mark)
        self._pieces.keep_only([])

    def _usable_standby(self) -> StandbyLink | None:
        """The standby for the next checkpoint. One that is lost or failing copy after
        copy is replaced (``replace_standby``), or let go; so is every standby when this
        session's channel cannot name its host to one."""
        standby = self._standby
        if standby is None:
            return None
        if getattr(self._channel, "peer_address", None) is None:
            return self._let_standby_go("this session's channel cannot name its host to it")
        if not isinstance(self.info.get("token"), str):
            return self._let_standby_go("the executor gave no token to grant it the pieces")
        why = standby.why_unusable
        if not why:
            return standby
        self._take_copied(wait=True)
        standby.close()
        # Outgrown: room for the checkpoint and half as much again, as state grows.
        gib = math.ceil(standby.outgrown_bytes * 1.5 / 2**30)
        replace, self._replace_standby = self._replace_standby, None  # one at a time
        try:
            self._standby = None if replace is None else replace(why, gib)
        except (OSError, CumulusError) as exc:
            log.warning("cumulus: no new standby could be had: %s", exc)
            self._standby = None
        if self._standby is None:
            log.warning("cumulus: %s; checkpoints come to this machine from now on", why)
            return None
        self._replace_standby = replace
        log.warning("cumulus: %s; a new standby takes the checkpoints", why)
        return self._standby

    def _let_standby_go(self, why: str) -> None:
        log.warning("cumulus: no standby: %s; checkpoints come to this machine", why)
        self._take_copied(wait=True)
        if self._standby is not None:
            self._standby.close()
        self._standby = None

    def _to_client(self) -> Checkpoint:
        """Read back the pieces the client does not hold, and keep the checkpoint here;
        the log starts over."""
        manifest = wire.parse_manifest(self._ask(wire.DIGESTS, b"")[0])
        pieces = pieces_of(manifest)
        self._pieces.make_room(sum(nbytes for _, nbytes, _ in manifest))
        missing = self._pieces.missing(pieces)
        self.checkpoint_bytes += sum(piece.nbytes for piece in missing)
        for group in groups(missing):
            for piece, data in zip(
                group, self._ask(wire.BATCH, readback_batch(group)), strict=True
            ):
                self._pieces.add(piece, data)
        (rng_state,) = self._ask(wire.BATCH, rng_batch())
        storages = tuple((handle, nbytes) for handle, nbytes, _ in manifest)
        self._checkpoint = Checkpoint(storages, tuple(pieces), bytes(rng_state), self._names_sent)
        self._pieces.keep_only(pieces)
        self._log = ReplayLog(self._log.limit_bytes)
        self._checkpointed_at = time.monotonic()
        self.checkpoints += 1
        self._copying = None
        return self._checkpoint

    def _ask(self, kind: int, batch: bytes) -> list[memoryview]:
        """The readbacks of a request that reads only: it is not logged, since replaying
        it changes nothing."""
        reply = wire.parse_reply(
            self._exchange(wire.request(kind, [], batch, True), True, logged=False)
        )
        if isinstance(reply, tuple):
            record, kind_name, message = reply
            self._failure = NativeSessionError(f"the executor failed: {message}", record, kind_name)
            raise self._failure
        return reply

    def _checkpoint_due(self) -> bool:
        if self._log is None:
            return False
        if self._log.lost_because is not None or self._log.nbytes > self._log.limit_bytes // 2:
            return True
        if self._copying is not None:  # the next one waits for the standby's copy
            return False
        return (
            self._interval is not None
            and time.monotonic() - self._checkpointed_at >= self._interval
        )

    def _sync(self) -> bytes:
        # As a readback: the device appended a DYN record last, whose answer comes last.
        return bytes(self.flush(wait=True)[-1])

    def _read_back(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        # The device appended the READBACK record just before calling this hook, so it
        # is the batch's last and its bytes are the reply's last.
        data = self.flush(wait=True)[-1]
        host = torch.empty(src.shape, dtype=src.dtype)
        if host.nbytes:
            host.view(-1).view(torch.uint8).copy_(torch.frombuffer(data, dtype=torch.uint8))
        dst.copy_(host)
        self._take_copied()
        if self._checkpoint_due():
            with self._lock:
                self._take_checkpoint()

    def close(self) -> None:
        """Flush what is pending, end the session and detach the hooks. A session whose
        executor is gone by now just ends: moving it elsewhere to say bye is no use."""
        global _CURRENT
        if _CURRENT is self:
            _CURRENT = None
        self._ext.set_readback_hook(None)
        self._ext.set_sync_hook(None)
        self._ext.set_flush_hook(None)
        self._ext.set_executor_device("")
        self._reconnect = self._log = None
        try:
            self.flush()
            self._channel.send_frame(wire.request(wire.BYE, [], b"", reply=False))
        except CumulusError:
            pass
        finally:
            self._channel.close()
            self._pieces.close()
            if self._standby is not None:
                self._standby.close()


#: The open session, which ``torch.cumulus`` answers for (one per process, as the device's
#: hooks are).
_CURRENT: NativeSession | None = None


def current() -> NativeSession | None:
    """The process's open native session, if any."""
    return _CURRENT


def _device_type(info: dict) -> str:
    """The executor's device type from its welcome ``info`` ("cpu", "cuda"), whose
    kernels attention and dropout then take (``csrc/attention.cpp``, ``dropout.cpp``)."""
    return str(info.get("device", "cpu")).partition(":")[0]


def _resume(channel: FrameChannel, token: object) -> dict | None:
    """Ask the executor for the session parked under ``token``: its welcome info, or
    None when it has none (a fresh host; the session then says hello on this channel)."""
    if not isinstance(token, str):
        return None
    options = {"token": token, "native": wire.VERSION}
    channel.send_frame(encode_frame(["resume", PROTOCOL_VERSION, options]))
    header, _ = decode_frame(channel.recv_frame())
    match header:
        case ["welcome", _, dict(info)] if info.get("resumed") and type(info.get("batches")) is int:
            return info
        case ["refused", *_]:
            return None
        case ["fatal", str(why)]:
            raise SessionClosedError(f"the executor refused to resume the session: {why}")
    raise SessionClosedError(f"the executor answered the resume with {header[0]!r}")


def _hello(channel: FrameChannel, quota: int | None) -> dict:
    """Open the session: the executor's welcome info, or why it refused."""
    options: dict = {"native": wire.VERSION}
    if quota is not None:
        options["quota"] = quota
    channel.send_frame(encode_frame(["hello", PROTOCOL_VERSION, options]))
    header, _ = decode_frame(channel.recv_frame())
    match header:
        case ["welcome", _, dict(info)] if info.get("native") == wire.VERSION:
            return info
        case ["welcome", *_]:
            raise SessionClosedError(
                "the executor does not run native sessions (it is older than this client): "
                "upgrade it, or run without the native device"
            )
        case ["fatal", str(why)]:
            raise SessionClosedError(f"the executor refused the session: {why}")
    raise SessionClosedError(f"the executor answered the hello with {header[0]!r}")
