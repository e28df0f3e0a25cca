"""The executor: a trio service that runs consumers' op streams on this machine's device.

Each connection is one session (``session.py`` holds its state). The shell reads a frame,
decodes it, lets the session run the batch in a worker thread (torch ops block), and sends
the reply if the batch asked for one. Batches from all sessions take turns on the device,
best-ranked session first (``scheduler.py``): that is where compute isolation and
priority between tenants live.

A frame that cannot be decoded ends only its own session, with a ``fatal`` message saying
why; the executor and every other session carry on.

A connection that drops without ``bye`` does not end its session: the session is parked in
the host-side cache (``hostcache.py``) under the token ``welcome`` gave the client, and a
``resume`` with that token on a new connection picks it up where it stopped. A resume that
finds the session still attached to a connection the executor has not yet seen die takes
it over: the old connection's task is cancelled between two batches and parks it first.
The native device's sessions (``_serve_native``: a C++ replay loop each) are parked and
resumed the same way, and a failover's fresh host fills theirs from a standby's pieces.
Sessions of both devices leave the device for host memory or disk when quotas past
``device_bytes`` need the room, and when they are parked (``eviction.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import secrets
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import torch
import trio

from .._errors import FrameTooLargeError, RemoteProtocolError, SessionClosedError, StandbyFullError
from ..blobs import service as blobservice
from ..blobs.store import BlobStore
from ..channel.transport import DEFAULT_MAX_FRAME, AsyncFrameChannel, TrioFrameChannel
from ..native.executor import STORAGELESS, ReplayError, ReplaySession, new_replayer
from ..wire import native as native_wire
from ..wire.manifest import parse_storage_entries
from ..wire.protocol import PROTOCOL_VERSION, decode_frame, encode_frame
from .collectives import collective_runs, is_collective
from .eviction import Candidate, Tier, destination, plan
from .graph_compiler import GraphRunner
from .handles import OpFailed
from .health import DeviceHealth
from .hostcache import HostCache
from .keepalive import keeping_alive
from .options import DEFAULT_RAM_BYTES, GraphCompiler
from .scheduler import DEFAULT_RANK, DeviceScheduler, on_demand
from .session import Batch, DeviceContext, ExecutorSession, Reply, SessionStats, parse_batch
from .waits import WaitWindow

log = logging.getLogger(__name__)

DEFAULT_QUOTA = 8 * 1024**3
#: How long a session whose connection dropped is kept for its consumer to resume it.
DEFAULT_CACHE_GRACE = 60.0
#: Host memory that parked sessions may hold, all together.
DEFAULT_CACHE_BYTES = 4 * 1024**3
#: Disk the host's blob store may take (``blobs/store.py``).
DEFAULT_BLOB_CAP = 20 * 1024**3
#: How long a resume waits for the session's old connection to let go of it.
TAKEOVER_TIMEOUT = 30.0
#: Refused resumes one connection may try before it must say hello.
MAX_REFUSALS = 4


def pick_device(choice: str = "auto") -> torch.device:
    """``"auto"`` is CUDA when present, CPU otherwise; ``"cpu"``, ``"cuda"`` (GPU 0) and
    ``"cuda:N"`` force one.

    Raises:
        ValueError: CUDA (or GPU ``N``) was forced on a machine without it, or the choice
            is unknown.
    """
    if choice == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if choice == "cpu":
        return torch.device("cpu")
    kind, _, index = choice.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise ValueError(f"unknown device {choice!r}: use auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {choice} was forced but this machine has no usable CUDA GPU")
    n = int(index or 0)
    if n >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise ValueError(f"--device {choice}: this machine has GPUs cuda:0 to cuda:{count - 1}")
    return torch.device("cuda", n)


@dataclass
class ExecutorConfig:
    """How an executor runs: device, per-session memory quota, largest frame accepted, how
    long (``cache_grace``, seconds; 0 turns the cache off) and in how much host memory
    (``cache_bytes``) sessions whose consumer vanished are kept for it to resume, how
    it runs compiled graphs (``graph_compiler.py``), and where its blob store lives
    (``blob_dir``, None: no store, uploads carry their bytes every time) and how large it
    may grow (``blob_cap``, bytes). ``device_bytes`` is what its sessions' storages may
    hold on the device together (None: no bound): past it, sessions are evicted
    (``eviction.py``) so that quotas may add up to more than the device has: from a GPU to
    host memory, of which they may hold ``ram_bytes`` together (None: no bound), and past
    that to the blob store."""

    device: str = "auto"
    quota_bytes: int = DEFAULT_QUOTA
    max_frame: int = DEFAULT_MAX_FRAME
    cache_grace: float = DEFAULT_CACHE_GRACE
    cache_bytes: int = DEFAULT_CACHE_BYTES
    graph_compiler: GraphCompiler = GraphCompiler.LOOP
    blob_dir: str | None = None
    blob_cap: int = DEFAULT_BLOB_CAP
    device_bytes: int | None = None
    ram_bytes: int | None = DEFAULT_RAM_BYTES
    #: Whether other hosts can reach this one, so that a job's collectives can run
    #: between its hosts (``collectives.py``); its sessions' welcome says so.
    peer_links: bool = True


#: A session of either device: both page off the device and back (``eviction.py``).
AnySession = ExecutorSession | ReplaySession


@dataclass
class _Attached:
    """A session attached to a connection, as a resume from another connection sees it."""

    session: AnySession
    owner: object
    scope: trio.CancelScope
    released: trio.Event


class PlainTcpServing:
    """Accepting plain TCP sessions, which ``Executor`` and ``WorkerSupervisor`` (its
    drop-in) do alike: each names the task that must run beside its listeners
    (``_upkeep``) and the largest frame its sessions take (``_max_frame``)."""

    run_session: Callable[[AsyncFrameChannel], Awaitable[None]]
    _upkeep: Callable[..., Awaitable[None]]

    def _max_frame(self) -> int:
        raise NotImplementedError

    async def serve_tcp(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run the upkeep and accept plain TCP sessions forever; reports the bound port
        through ``task_status``."""
        listeners = await trio.open_tcp_listeners(port, host=host)
        bound = listeners[0].socket.getsockname()[1]
        max_frame = self._max_frame()

        async def handler(stream: trio.SocketStream) -> None:
            await self.run_session(TrioFrameChannel(stream, max_frame=max_frame))

        async with trio.open_nursery() as nursery:
            await nursery.start(self._upkeep)
            await nursery.start(trio.serve_listeners, handler, listeners)
            task_status.started(bound)


class Executor(PlainTcpServing):
    """Serves sessions on one device. Share one instance across listeners and channels.

    Parked sessions expire lazily whenever a session starts or ends; run
    ``expire_parked_forever`` beside the listeners to also release them on time when the
    executor is idle (``serve_tcp`` does).
    """

    def __init__(
        self,
        config: ExecutorConfig | None = None,
        *,
        scheduler: DeviceScheduler | None = None,
        welcome_extra: dict | None = None,
        context_lost: Callable[[], bool] | None = None,
        ask_room: Callable[[int], Awaitable[None]] | None = None,
    ) -> None:
        """``scheduler`` grants device turns (a worker process asks its supervisor's);
        ``welcome_extra`` is added to every session's welcome (a worker names its pid);
        ``context_lost`` is asked after an op failed whether the device context is now
        unusable (a CUDA device-side assert): then the session ends after that reply;
        ``ask_room(n)`` returns once a session may hold ``n`` bytes on the device (a
        worker asks its supervisor, which bounds the device across workers)."""
        self.config = config or ExecutorConfig()
        blob_dir = self.config.blob_dir
        self.ctx = DeviceContext(
            pick_device(self.config.device),
            graphs=GraphRunner(self.config.graph_compiler),
            blobs=None if blob_dir is None else BlobStore(blob_dir, self.config.blob_cap),
        )
        self.sessions: dict[int, AnySession] = {}
        self.cache: HostCache[AnySession] = HostCache(
            max_bytes=self.config.cache_bytes, grace=self.config.cache_grace
        )
        self._attached: dict[str, _Attached] = {}
        #: Each live or parked session by its grant (``blobservice.grant_of`` its token).
        self._grants: dict[str, AnySession] = {}
        self.scheduler = scheduler if scheduler is not None else DeviceScheduler()
        self._welcome_extra = welcome_extra or {}
        self._context_lost = context_lost
        self._ask_room = ask_room
        #: What each session last asked ``ask_room`` for.
        self._room_asked: weakref.WeakKeyDictionary[AnySession, int] = weakref.WeakKeyDictionary()
        self._next_id = 1
        #: Always healthy: a shared process has no fresh process to check the device with.
        self.health = DeviceHealth()

    def session_stats(self, owner: bytes) -> SessionStats | None:
        """The running session of the consumer with key ``owner``: ops, memory in use,
        and its waits for the device over the last minute (a copy, as of now)."""
        found = [a.session for a in self._attached.values() if a.owner == owner]
        if not found:
            return None
        session = found[-1]
        where = {"tier": session.tier.value, "bytes_on_device": session.bytes_on_device}
        stats = dataclasses.replace(session.stats, **where)
        waits = session.waits.percentiles(now=time.monotonic())
        if waits is None:
            return stats
        return dataclasses.replace(stats, wait_p50_ms=waits.p50_ms, wait_p99_ms=waits.p99_ms)

    @property
    def idle(self) -> bool:
        """No session is attached to a connection or parked for a resume."""
        return not self.sessions and not self._attached and self.cache.statistics().entries == 0

    async def run_session(
        self,
        channel: AsyncFrameChannel,
        *,
        quota_bytes: int | None = None,
        rank: tuple = DEFAULT_RANK,
        until: float = math.inf,
        only_blobs: bool = False,
        hold_bytes: int | None = None,
    ) -> None:
        """Serve one session until the client leaves or breaks the protocol.

        A client that vanishes without ``bye`` leaves its session parked for a resume.

        Args:
            channel: The session's frame channel.
            quota_bytes: This session's memory quota, when it differs from the
                executor's default (a lease of several shares gets more); capped at the
                executor's ``quota_bytes`` all the same.
            rank: This session's place in the queue for the device when tenants
                contend (``scheduler.lease_rank``); lower goes first.
            until: trio time at which this connection's time is up (its lease ends): the
                connection is dropped and the session parked, so that a renewed lease
                resumes it where it stopped.
            only_blobs: The connection may only read a session's kept pieces (another
                host's, admitted by a grant, not a lease).
            hold_bytes: Most bytes of the host's store a new session may keep pinned (a
                standby lease's disk); None: as many as the store holds.
        """
        session_id = self._next_id
        self._next_id += 1
        self._expire_parked()
        token: str | None = None
        session: ExecutorSession | None = None
        park = False
        try:
            header, _ = decode_frame(await channel.receive_frame())
            if header[0] == blobservice.HELLO:
                await blobservice.serve_blobs(channel, header, self._granted)
                return
            if only_blobs:
                raise RemoteProtocolError(blobservice.ONLY_BLOBS)
            limit = min(quota_bytes or self.config.quota_bytes, self.config.quota_bytes)
            # From the hello on: taking a parked session back from disk may take long too.
            async with keeping_alive(channel, owing=True) as kept:
                if _is_native(header):
                    await self._serve_native(kept, header, session_id, limit, rank, until)
                    return
                token, session = await self._open(kept, header, session_id, limit, hold_bytes)
                self.sessions[session_id] = session
                self._grants[blobservice.grant_of(token)] = session
                park = await self._serve_attached(kept, token, session, rank, until)
        except RemoteProtocolError as exc:
            log.info("session %d: protocol error: %s", session_id, exc)
            await _send_fatal(channel, str(exc))
        except SessionClosedError:
            log.info("session %d: client went away", session_id)
        except _ContextLost as exc:
            log.warning("session %d: op %s left the device context unusable", session_id, exc)
            why = f"its op {exc} left the device context unusable (caused by this session)"
            await send_last(channel, ["lost", why, "session"])
        except Exception as exc:  # whatever one session does, the others keep running
            log.exception("session %d: internal error", session_id)
            await _send_fatal(channel, f"executor internal error: {type(exc).__name__}: {exc}")
        finally:
            self.sessions.pop(session_id, None)
            with trio.CancelScope(shield=True):
                if session is not None:
                    await self._let_go(channel, token, session, park)
                await channel.aclose()

    # --- opening: hello or resume ---------------------------------------------------------

    async def _open(
        self,
        channel: AsyncFrameChannel,
        header: list,
        session_id: int,
        limit: int,
        hold_bytes: int | None,
    ) -> tuple[str, ExecutorSession]:
        for refused in range(MAX_REFUSALS + 1):
            if refused:
                header, _ = decode_frame(await channel.receive_frame())
            if header[0] == "resume":
                token = _resume_token(header)
                session = await self._take(token, _owner(channel))
                if isinstance(session, ReplaySession):  # a native session's token
                    self._forget(session)
                    session = None
                if session is None:
                    reason = "unknown or expired session token; send hello for a new session"
                    await channel.send_frame(encode_frame(["refused", reason]))
                    continue
                resumed = {"resumed": True, "last_seq": session.last_seq}
                info = self._info(session_id, session, token) | resumed
                await channel.send_frame(encode_frame(["welcome", PROTOCOL_VERSION, info]))
                return token, session
            options = _hello_options(header)
            quota = min(options.get("quota", limit), limit)
            private = options.get("private", False)
            session = ExecutorSession(
                self.ctx,
                quota_bytes=quota,
                private=private,
                hold_bytes=hold_bytes,
                peer_links=self.config.peer_links,
            )
            token = secrets.token_hex(16)
            info = self._info(session_id, session, token)
            await channel.send_frame(encode_frame(["welcome", PROTOCOL_VERSION, info]))
            return token, session
        raise RemoteProtocolError(f"more than {MAX_REFUSALS} refused resumes on one connection")

    def holds_grant(self, grant: str) -> bool:
        """Whether a session here keeps pieces under ``grant``."""
        return grant in self._grants

    def _granted(self, grant: str) -> Callable[[str], memoryview | None] | None:
        """The kept pieces of the session ``grant`` opens (``blobs/service.py``)."""
        session = self._grants.get(grant)
        return None if session is None else session.kept.piece

    def _forget(self, session: AnySession) -> None:
        """A session is gone for good: release it and close its grant."""
        session.close()
        self._grants = {g: s for g, s in self._grants.items() if s is not session}

    def _info(self, session_id: int, session: ExecutorSession, token: str) -> dict:
        return {
            "session": session_id,
            "token": token,
            "device": str(self.ctx.device),
            "device_name": _device_name(self.ctx.device),
            "torch": str(torch.__version__),
            "quota": session.quota_bytes,
            "blob_store": self.ctx.blobs is not None,
            "private": session.private,
            "peer_links": self.config.peer_links,
        } | self._welcome_extra

    async def _take(self, token: str, owner: object) -> AnySession | None:
        """The session parked under ``token``, taken over from its old connection if need be."""
        attached = self._attached.get(token)
        if attached is not None and attached.owner == owner:
            attached.scope.cancel()
            with trio.move_on_after(TAKEOVER_TIMEOUT):
                await attached.released.wait()
        session = self.cache.take(token, now=trio.current_time(), owner=owner)
        if session is not None:
            # In a thread where bytes move: from host memory to a GPU, or from disk.
            moves = self.ctx.device.type != "cpu" or session.tier is Tier.DISK
            await self._on_device(session.unpark, inline=not moves)
        return session

    # --- serving ------------------------------------------------------------------------

    async def _serve_attached(
        self,
        channel: AsyncFrameChannel,
        token: str,
        session: ExecutorSession,
        rank: tuple,
        until: float,
    ) -> bool:
        """Serve batches; True when the session should be parked (no ``bye`` came)."""
        scope = trio.CancelScope(deadline=until)
        attached = _Attached(session, _owner(channel), scope, trio.Event())
        self._attached[token] = attached
        with attached.scope:
            try:
                await self._serve_batches(channel, session, rank)
                return False
            except SessionClosedError:
                log.info("session %s...: connection lost; parking it", token[:8])
                return True
        if trio.current_time() >= until:
            log.info("session %s...: its time is up; parking it", token[:8])
        else:
            log.info("session %s...: taken over by a resume", token[:8])
        return True

    async def _serve_batches(
        self, channel: AsyncFrameChannel, session: ExecutorSession, rank: tuple
    ) -> None:
        while True:
            try:
                frame = await channel.receive_frame()
            except FrameTooLargeError as exc:
                raise RemoteProtocolError(str(exc)) from exc
            header, area = decode_frame(frame)
            if header[0] == "bye":
                return
            if header[0] == "resend":
                if len(header) != 2 or type(header[1]) is not int:
                    raise RemoteProtocolError("resend takes one batch number")
                reply = await self._on_device(session.resend, header[1], rank=rank)
            elif header[0] == "batch":
                batch = parse_batch(header, area)
                # A sync point's short tail: a thread hop would cost more than the ops.
                inline = batch.light
                reply = await self._run_batch(session, batch, inline=inline, rank=rank)
                _meter_peer_bytes(channel, session)
            elif header[0] == "pull":
                if len(header) != 2:
                    raise RemoteProtocolError("pull takes one map of sources and digests")
                await channel.send_frame(
                    encode_frame(["pulled", await self._pull(session, header[1])])
                )
                continue
            elif header[0] == "restore":
                if len(header) != 2:
                    raise RemoteProtocolError("restore takes one map of sources and storages")
                restored = await self._restore_pulled(session, header[1])
                await channel.send_frame(encode_frame(["restored", restored]))
                continue
            elif header[0] == "have":
                if len(header) != 2:
                    raise RemoteProtocolError("have takes one list of digests")
                # Opening and locking files: a thread, and no device turn.
                present = await trio.to_thread.run_sync(session.have, header[1])
                await channel.send_frame(encode_frame(["have", present]))
                continue
            else:
                raise RemoteProtocolError(f"unexpected {header[0]!r} message in a session")
            if reply is not None:
                await channel.send_frame(_encode_reply(reply))
                if reply.error is not None and self._context_lost and self._context_lost():
                    raise _ContextLost(reply.error[2])

    async def _pull(self, session: ExecutorSession, options: Any) -> dict:
        """Fetch pieces from other hosts into this host's store and hold them for the
        session (a standby's checkpoint; a failover's state); what it did, or why not."""
        sources, names = blobservice.parse_pull(options)
        store = self.ctx.blobs
        if store is None:
            return {"error": "this host keeps no blob store (start it with --blob-dir)"}
        try:
            pulled = await blobservice.pull(store, sources, names, max_frame=self.config.max_frame)
            error = None
        except blobservice.PullError as exc:
            pulled, error = exc.pulled, str(exc)
        # A failed pull keeps the pieces held before: they are the checkpoint that stands.
        held, needed = 0, None
        if error is None:
            try:
                held = await trio.to_thread.run_sync(session.hold, names)
            except StandbyFullError as exc:
                error, needed = str(exc), exc.needed_bytes
        result = {"fetched_bytes": pulled.fetched_bytes, "fetched": pulled.fetched, "held": held}
        return result | {"dropped": pulled.dropped, "error": error, "needed_bytes": needed}

    async def _restore_pulled(self, session: ExecutorSession, options: Any) -> dict:
        """A failover's restore (``restoring.py``): create the checkpoint's storages and
        pull their pieces straight into them, from this host's store first, then from the
        hosts that keep them; what it did, or why not (then no storage is left)."""
        sources = blobservice.parse_sources(options)
        entries = parse_storage_entries(options)
        try:
            targets = await self._on_device(session.open_pulled_restore, entries)
        except OpFailed as exc:
            return {"error": str(exc), "fetched_bytes": 0, "dropped": []}
        store = self.ctx.blobs
        local = 0 if store is None else await trio.to_thread.run_sync(targets.fill_from, store)
        try:
            missing = targets.missing()
            pulled = await blobservice.pull(
                targets, sources, missing, max_frame=self.config.max_frame
            )
            error = None
        except blobservice.PullError as exc:
            pulled, error = exc.pulled, str(exc)
            await trio.to_thread.run_sync(session.drop_storages, [e.handle for e in entries])
        result = {"fetched_bytes": pulled.fetched_bytes, "local_bytes": local}
        return result | {"dropped": pulled.dropped, "error": error}

    async def _on_device(
        self,
        fn,
        *args,
        inline: bool = False,
        rank: tuple = DEFAULT_RANK,
        waits: WaitWindow | None = None,
    ) -> Any:
        # A free device is taken without a checkpoint, which saves a trip through trio's
        # scheduler on every sync point; the batch's own I/O awaits are the fairness points.
        asked = time.monotonic()
        await self.scheduler.acquire(rank)
        if waits is not None:
            now = time.monotonic()
            waits.add(now - asked, now=now)
        try:
            if inline:
                return fn(*args)
            return await trio.to_thread.run_sync(fn, *args)
        finally:
            self.scheduler.release()

    async def _run_batch(
        self, session: ExecutorSession, batch: Batch, *, inline: bool, rank: tuple
    ) -> Reply | None:
        """Run ``batch`` in device turns that may end between any two of its ops.

        An evicted session is brought back first: ahead of its turn when it fits beside
        the sessions on the device (its disk reads overlap their compute), or in its
        turn after making room.

        A scheduler that preempts (``DeviceScheduler.preemptive``) is asked between ops
        whether a better-ranked tenant waits (a read of shared state, no message); then
        the turn is handed back there and the rest of the batch waits for the next one.
        The session runs the batch as pieces of one op each, then its frees and query:
        what it computes does not depend on where the batch was cut.
        """
        turn = {"inline": inline, "rank": rank, "waits": session.waits}
        session.rank = rank
        await self._room_for(session, rank, batch.grows)
        if session.tier is not Tier.DEVICE and not self._over_device_bytes(session):
            # It fits beside the others: back ahead of its turn, while they compute.
            await trio.to_thread.run_sync(session.bring_back)
        if any(is_collective(record) for record in batch.ops):
            # Begun, it runs whole, even past the lease's term: its collectives met the
            # other ranks', so a batch cut there could be neither answered nor run again.
            with trio.CancelScope(shield=True):
                reply = await self._run_collectives(session, batch, turn)
        elif not getattr(self.scheduler, "preemptive", False):
            reply = await self._on_device(session.run_batch, batch, **turn)
        else:
            start: int | None = 0
            while start is not None:  # None: the whole batch ran
                start, reply = await self._on_device(self._run_ops, session, batch, start, **turn)
        await self._after_growth(session)
        return reply

    async def _room_for(self, session: AnySession, rank: tuple, grows: int = 0) -> None:
        """Make room on the device for ``session``'s storages and the ``grows`` bytes its
        next batch creates, as its client counted them: an evicted session, or one about
        to hold more than it last asked room for, asks the supervisor first (tenants of
        other workers may have to leave), and this executor's other sessions leave past
        ``device_bytes``."""
        # The count is a hint: past its quota the ops fail on their own, so no more room
        # is made than the quota leaves it.
        grows = min(grows, max(0, session.quota_bytes - session.stats.bytes_in_use))
        held = session.stats.bytes_in_use + grows
        await self._ask_room_past(session, held, evicted=session.tier is not Tier.DEVICE)
        if self._over_device_bytes(session, grows):
            await self._on_device(self._make_room, session, grows, rank=rank)

    async def _after_growth(self, session: AnySession) -> None:
        """Under a supervisor, a session that now holds more than it last asked room for
        (its batch grew past what the client said: a data-dependent op's outputs, an old
        client) asks again before its reply leaves, so the supervisor hears of its growth
        at once, not at the next report of sizes, and others' sessions leave before its
        next batch (on a GPU, its growth and their memory would meet meanwhile)."""
        await self._ask_room_past(session, session.stats.bytes_in_use)

    async def _ask_room_past(self, session: AnySession, held: int, evicted: bool = False) -> None:
        """Under a supervisor, ask room for ``session`` to hold ``held`` bytes on the
        device when it comes back (``evicted``) or ``held`` is past what it last asked."""
        if self._ask_room is None:
            return
        if evicted or held > self._room_asked.get(session, 0):
            self._room_asked[session] = held
            await self._ask_room(held)

    def _over_device_bytes(self, session: AnySession, grows: int = 0) -> bool:
        """Whether ``session``'s storages on the device, and ``grows`` more bytes, would
        exceed ``device_bytes``."""
        if self.config.device_bytes is None:
            return False
        return self._device_bytes(session) + grows > self.config.device_bytes

    def _device_bytes(self, session: AnySession) -> int:
        """What the sessions on the device hold, ``session`` counted as if it were."""
        others = [s for s in self.sessions.values() if s is not session]
        held = sum(s.bytes_on_device for s in others)
        return held + session.stats.bytes_in_use

    def _make_room(self, session: AnySession, grows: int = 0) -> None:
        """Make the evictions ``eviction.plan`` names so that ``session``, grown by
        ``grows`` bytes, fits on the device. Without a place to put them nothing moves,
        and quotas still hold."""
        need = self._device_bytes(session) + grows - (self.config.device_bytes or 0)
        # Sessions evicted already hold nothing on the device: ``choose`` passes them by.
        candidates = [_candidate(s) for s in self.sessions.values() if s is not session]
        for move in plan(candidates, need, now=time.monotonic(), **self._places()):
            try:
                move.key.evict(move.tier, move.nbytes)
            except OSError as exc:  # the store is full: the others stay, quotas still hold
                log.warning("could not evict a session to make room: %s", exc)
                return

    def _evict_tier(self, nbytes: int) -> Tier | None:
        """Where ``nbytes`` of a session's storages go off the device
        (``eviction.destination``): host memory on a GPU while the RAM tier has room for
        them, else the blob store; None where there is no such place."""
        return destination(nbytes, **self._places())

    def _places(self) -> dict:
        """Where evicted storages may go here, as ``eviction.destination`` asks."""
        return {
            "device_is_host": self.ctx.device.type == "cpu",
            "ram_free": self._ram_free(),
            "disk": self.ctx.blobs is not None,
        }

    def _ram_free(self) -> int | None:
        """What the RAM tier may still take (None: no bound). Parked sessions count
        against the host cache's own bound (``cache_bytes``), not this one."""
        if self.config.ram_bytes is None:
            return None
        sessions = self.sessions.values()
        held = sum(s.stats.bytes_in_use - s.bytes_on_device for s in sessions if s.tier is Tier.RAM)
        return max(0, self.config.ram_bytes - held)

    async def evict_all(self, tier: Tier | None = None, need: int | None = None) -> int:
        """Move the live sessions' storages off the device, to ``tier`` (None: where
        ``_evict_tier`` says), each between two of its batches: all of them, or the
        coldest until ``need`` bytes are off (a supervisor makes room across its workers
        so, and says where to and how much). Returns the bytes moved; 0 where there is no
        place to put them or nothing is on the device."""
        moved = 0
        for session in list(self.sessions.values()):
            left = None if need is None else need - moved
            if left is not None and left <= 0:
                break
            where = tier or self._evict_tier(left or session.bytes_on_device)
            if where is None:
                continue
            try:
                moved += await self._on_device(
                    _evict_on_device, session, where, left, rank=session.rank
                )
            except OSError as exc:
                log.warning("could not evict a session: %s", exc)
        if moved and self.ctx.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the memory back for other processes
        return moved

    async def _run_collectives(self, session: ExecutorSession, batch: Batch, turn: dict) -> Reply:
        """Run a batch holding collectives: each outside any device turn, the ops between
        them in turns. A collective waits for the job's other ranks, and those may be
        sessions of this executor: holding the device while waiting would keep their
        turns, and so themselves, from ever coming."""
        blobs = batch.blobs
        for ops in collective_runs(batch.ops):
            piece = Batch(batch.seq, ops, [], None, blobs)
            if is_collective(ops[0]):
                await trio.to_thread.run_sync(session.run_batch, piece)
            else:
                await self._on_device(session.run_batch, piece, **turn)
        last = Batch(batch.seq, [], batch.frees, batch.query, blobs)
        return await self._on_device(session.run_batch, last, **turn)

    def _run_ops(
        self, session: ExecutorSession, batch: Batch, start: int
    ) -> tuple[int | None, Reply | None]:
        """Run ``batch``'s ops from ``start`` until the turn must end: ``(the op to resume
        at, None)``, or ``(None, the batch's reply)`` once all of it ran."""
        preempted = self.scheduler.preempted  # type: ignore[attr-defined]
        ops, blobs = batch.ops, batch.blobs
        for index in range(start, len(ops)):
            if index > start and preempted():
                return index, None
            session.run_batch(Batch(batch.seq, [ops[index]], [], None, blobs))
        return None, session.run_batch(Batch(batch.seq, [], batch.frees, batch.query, blobs))

    # --- native sessions ------------------------------------------------------------------

    async def _serve_native(
        self,
        channel: AsyncFrameChannel,
        header: list,
        session_id: int,
        limit: int,
        rank: tuple,
        until: float,
    ) -> None:
        """A native device's session (``cumulus_p2p.native``): each batch replayed in C++,
        whole, in one device turn. Its welcome carries a token: its grant opens the pieces
        a KEEP copied to a standby (``_granted``), and a ``resume`` naming it takes the
        session back after its connection dropped or its time was up (it waits parked in
        the host cache meanwhile, as the Python device's sessions do). A BYE, or a failed
        record, ends it for good."""
        token, replaying, info = await self._open_native(channel, header, session_id, limit)
        self._grants[blobservice.grant_of(token)] = replaying
        self.sessions[session_id] = replaying
        scope = trio.CancelScope(deadline=until)
        attached = _Attached(replaying, _owner(channel), scope, trio.Event())
        self._attached[token] = attached
        park, waits = False, replaying.waits
        try:
            await channel.send_frame(
                encode_frame(["welcome", PROTOCOL_VERSION, info | self._welcome_extra])
            )
            with scope:
                park = True  # its time is up, or a resume took it over, unless it says bye
                while await self._native_request(channel, replaying, rank, waits):
                    pass
                park = False
        except SessionClosedError:
            pass  # the connection dropped: parked, for its client to resume
        except BaseException:
            park = False
            raise
        finally:
            park = park and replaying.failure is None
            del self._grants[blobservice.grant_of(token)]
            self.sessions.pop(session_id, None)
            with trio.CancelScope(shield=True):
                await self._let_go_native(token, attached, park)
        done = "parked" if park else "ended"
        log.info("native session %d: %s after %d batches", session_id, done, replaying.batches)

    async def _let_go_native(self, token: str, attached: _Attached, park: bool) -> None:
        """Park a native session off the device (as ``_let_go`` does a Python one), for
        its client to resume, or close it."""
        replaying = attached.session
        if park:
            await self._park_in_cache(token, replaying, attached.owner)
        else:
            replaying.close()
        del self._attached[token]
        attached.released.set()

    async def _open_native(
        self, channel: AsyncFrameChannel, header: list, session_id: int, limit: int
    ) -> tuple[str, ReplaySession, dict]:
        """A native hello's new session, or the parked one a resume names: its token,
        the session and its welcome's info. A resume of a session not parked here is
        refused, and the client may send a hello next, on the same connection."""
        owner = _owner(channel)
        for refused in range(MAX_REFUSALS + 1):
            if refused:
                header, _ = decode_frame(await channel.receive_frame())
            options = _native_options(header)
            info = {"session": session_id, "native": native_wire.VERSION}
            info |= {"device": str(self.ctx.device), "device_name": _device_name(self.ctx.device)}
            if header[0] == "resume":
                token = _resume_token(header)
                parked = await self._take(token, owner)
                if not isinstance(parked, ReplaySession):
                    if parked is not None:  # a Python session's token: not this kind
                        self._forget(parked)
                    reason = "no native session parked here under that token; send hello"
                    await channel.send_frame(encode_frame(["refused", reason]))
                    continue
                resumed = {"resumed": True, "batches": parked.received, "token": token}
                return token, parked, info | {"quota": parked.quota_bytes} | resumed
            quota = min(options.get("quota", limit), limit)
            try:
                replayer = await trio.to_thread.run_sync(new_replayer, info["device"], quota)
            except RuntimeError as exc:  # no replay library here, and none can be built
                raise RemoteProtocolError(
                    f"this host cannot run native sessions ({exc}); run without the native device"
                ) from exc
            token = secrets.token_hex(16)
            replaying = ReplaySession(replayer, self.ctx.blobs, self.ctx.graphs)
            return token, replaying, info | {"quota": quota, "token": token}
        raise RemoteProtocolError(f"more than {MAX_REFUSALS} refused resumes on one connection")

    async def _native_request(
        self, channel: AsyncFrameChannel, replaying: ReplaySession, rank: tuple, waits: WaitWindow
    ) -> bool:
        """Serve one request of a native session; whether the session goes on."""
        frame = await channel.receive_frame()
        if frame[:1] == bytes((native_wire.RESTORE,)):
            await channel.send_frame(await self._restore_native(replaying, frame, rank))
            return True
        replaying.rank = rank
        if frame[:1] and frame[0] not in STORAGELESS:  # a malformed one is run's to refuse
            await self._room_for(replaying, rank, native_wire.growth(frame))
        # An evicted session's request brings its storages back first: not in the loop.
        inline = replaying.runs_inline(frame)
        going, reply = await self._on_device(
            replaying.run, frame, inline=inline, rank=rank, waits=waits
        )
        await self._after_growth(replaying)
        if reply is not None:
            await channel.send_frame(reply)
        return going

    async def _restore_native(
        self, replaying: ReplaySession, frame: bytearray, rank: tuple
    ) -> list[bytes]:
        """A native failover's RESTORE: make the storages and fill them with their pieces,
        from this host's store first, then pulled from the sources (``restoring.py``).
        The reply says what it fetched, or why not (then none of them is left)."""
        _, _, _, batch = native_wire.parse_request(frame)
        wanted, entries = native_wire.parse_restore(batch)
        sources = blobservice.parse_sources({"sources": wanted})
        if replaying.failure is not None:
            return native_wire.failed(-1, "restore", str(replaying.failure))
        try:
            targets = await self._on_device(replaying.open_restore, entries, rank=rank)
        except ReplayError as exc:
            return native_wire.failed(-1, "restore", f"its storages could not be made: {exc}")
        store = self.ctx.blobs
        local = 0 if store is None else await trio.to_thread.run_sync(targets.fill_from, store)
        try:
            pulled = await blobservice.pull(
                targets, sources, targets.missing(), max_frame=self.config.max_frame
            )
        except blobservice.PullError as exc:
            await self._on_device(replaying.drop, [handle for handle, _, _ in entries], rank=rank)
            return native_wire.failed(-1, "restore", str(exc))
        result = {"fetched_bytes": pulled.fetched_bytes, "local_bytes": local}
        return native_wire.ok([msgpack.packb(result)])

    # --- letting go: close or park --------------------------------------------------------

    async def _let_go(
        self, channel: AsyncFrameChannel, token: str | None, session: ExecutorSession, park: bool
    ) -> None:
        attached = self._attached.get(token) if token is not None else None
        if park and token is not None:
            await self._park_in_cache(token, session, _owner(channel))
        else:
            self._forget(session)
        if attached is not None and attached.session is session:
            del self._attached[token]
            attached.released.set()
        self._expire_parked()

    async def _park_in_cache(self, token: str, session: AnySession, owner: object) -> None:
        """Park ``session`` off the device (``_park``) and in the host cache under
        ``token``, for ``owner`` to resume; the sessions the cache lets go for it are
        forgotten."""
        nbytes = await self._on_device(self._park, session, inline=not self._parks_off_device())
        await self._demote_for(nbytes)
        for old in self.cache.park(token, session, nbytes, now=trio.current_time(), owner=owner):
            self._forget(old)

    async def _demote_for(self, nbytes: int) -> None:
        """Move the oldest sessions parked in host memory to disk until ``nbytes`` more
        fit the host cache's budget, rather than have the cache drop them (where there
        is a disk tier, and while it keeps the pieces)."""
        if self.ctx.blobs is None:
            return
        for token, old in self.cache.crowding(nbytes):
            try:  # from host memory: no device turn
                await trio.to_thread.run_sync(old.park, Tier.DISK)
            except OSError as exc:  # the store is full: the cache drops the rest
                log.warning("could not move a parked session to disk: %s", exc)
                return
            self.cache.demoted(token, old)

    def _parks_off_device(self) -> bool:
        """Whether parking moves bytes (a GPU's to host memory, a bounded CPU's to disk):
        then it runs in a thread, not in the event loop."""
        bounded = self.config.device_bytes is not None and self.ctx.blobs is not None
        return self.ctx.device.type != "cpu" or bounded

    def _park(self, session: AnySession) -> int:
        """Park ``session`` off the device (to ``_park_tier``). Returns its bytes in
        memory."""
        if self._park_tier(session) is Tier.DISK:
            try:
                return session.park(Tier.DISK)
            except OSError as exc:  # the store is full: it stays in memory, as unbounded
                log.warning("could not park a session on disk: %s", exc)
        return session.park(Tier.RAM)

    def _park_tier(self, session: AnySession) -> Tier:
        """Where a parked session goes: on disk where the device is host memory and its
        room is bounded (``device_bytes``), so a vanished tenant's memory goes to the
        tenants still here; off a GPU to host memory while the host cache's budget
        (``cache_bytes``) holds it, older parked sessions moving to disk to make way,
        else to disk (``eviction.destination``)."""
        if self.ctx.device.type == "cpu":
            return Tier.DISK if self._parks_off_device() else Tier.RAM
        cached = self.cache.statistics()
        disk = self.ctx.blobs is not None
        # With a disk, older parked sessions make way for it there (``_demote_for``).
        room = cached.max_bytes if disk else cached.max_bytes - cached.bytes
        spill = destination(session.bytes_on_device, device_is_host=False, ram_free=room, disk=disk)
        return spill or Tier.RAM

    def _expire_parked(self) -> None:
        for session in self.cache.expire(now=trio.current_time()):
            self._forget(session)

    async def expire_parked_forever(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Release parked sessions as their grace periods end, until cancelled."""
        task_status.started()
        if self.config.cache_grace <= 0:
            await trio.sleep_forever()  # nothing is ever parked
        tick = min(1.0, max(0.05, self.config.cache_grace / 4))
        while True:
            await trio.sleep(tick)
            self._expire_parked()

    #: What ``serve_tcp`` runs beside its listeners.
    _upkeep = expire_parked_forever

    def _max_frame(self) -> int:
        return self.config.max_frame


class _ContextLost(Exception):
    """A session's op left the device context unusable; the session cannot go on."""


def _encode_reply(reply: Reply) -> list:
    lengths = [len(b) for b in reply.blobs]
    header: list[Any] = ["reply", reply.seq, reply.error, reply.result, lengths]
    return encode_frame(header, reply.blobs)


async def _send_fatal(channel: AsyncFrameChannel, message: str) -> None:
    await send_last(channel, ["fatal", message])


async def send_last(channel: AsyncFrameChannel, header: list) -> None:
    """Send a session's last message, if its consumer is still there to read it."""
    try:
        with trio.move_on_after(5):
            await channel.send_frame(encode_frame(header))
    except SessionClosedError:
        pass


def _is_native(header: list) -> bool:
    """Whether a session's first message opens or resumes a native session."""
    options = header[2] if len(header) == 3 else None
    return header[0] in ("hello", "resume") and isinstance(options, dict) and "native" in options


def _native_options(header: list) -> dict:
    """A native hello's or resume's options, checked; the version must be this side's.

    Raises:
        RemoteProtocolError: they are not one, or of another version.
    """
    if header[0] not in ("hello", "resume") or len(header) != 3:
        raise RemoteProtocolError("expected a native hello (or resume) message")
    options = _hello_options(["hello", *header[1:]])
    if options.get("native") != native_wire.VERSION:
        raise RemoteProtocolError(
            f"client speaks native version {options.get('native')!r}; this executor speaks "
            f"{native_wire.VERSION}. Upgrade the older side."
        )
    return options


def _hello_options(header: list) -> dict:
    if header[0] != "hello" or len(header) != 3 or not isinstance(header[2], dict):
        raise RemoteProtocolError("expected a hello (or resume) message first")
    if header[1] != PROTOCOL_VERSION:
        raise RemoteProtocolError(
            f"client speaks op-stream version {header[1]!r}; this executor speaks "
            f"{PROTOCOL_VERSION}. Upgrade the older side."
        )
    options = header[2]
    if "quota" in options and (type(options["quota"]) is not int or options["quota"] <= 0):
        raise RemoteProtocolError("quota must be a positive integer")
    if type(options.get("private", False)) is not bool:
        raise RemoteProtocolError("private must be true or false")
    return options


def _resume_token(header: list) -> str:
    ok = len(header) == 3 and header[1] == PROTOCOL_VERSION and isinstance(header[2], dict)
    token = header[2].get("token") if ok else None
    if not (isinstance(token, str) and 0 < len(token) <= 64):
        raise RemoteProtocolError(
            f'resume must be ["resume", {PROTOCOL_VERSION}, {{"token": str}}] with the '
            "token from welcome"
        )
    return token


def _evict_on_device(session: AnySession, tier: Tier, need: int | None) -> int:
    """``session.evict(tier, need)`` if storages are still on the device when its turn
    comes: another ``evict`` from the supervisor may have moved them while this one
    waited for the turn."""
    return session.evict(tier, need) if session.bytes_on_device else 0


def _candidate(session: AnySession) -> Candidate:
    """A session on the device as the eviction policy weighs it (the in-process executor
    runs one session's batch at a time, so no other is in its turn)."""
    return Candidate(
        session,
        session.rank,
        on_demand(session.rank),
        session.bytes_on_device,
        session.last_op_at,
    )


def _owner(channel: AsyncFrameChannel) -> object:
    """Who may resume a session: the consumer's key on an authenticated channel."""
    return getattr(channel, "peer_public_key", None)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def _meter_peer_bytes(channel: AsyncFrameChannel, session: ExecutorSession) -> None:
    """Tell a metering channel (the provider's ``CountingChannel``, a worker's) the bytes
    the batch's collectives carried between hosts, for the lease's receipts."""
    peer = session.take_peer_bytes()
    count = getattr(channel, "count_peer_bytes", None)
    if peer and count is not None:
        count(peer)
