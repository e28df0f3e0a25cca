"""The supervisor: a worker process per session, device turns across them, a healthy device.

Theory of operation
-------------------
The provider's node runs every consumer's secure-channel handshake itself, so the node
key stays in this process. For each session it takes a pre-started worker
(``worker.py``) from a small pool and *hands the session over*: it sends the worker the
consumer's connection itself (``SCM_RIGHTS``), the bytes already read from it, and for a
secure session the session's derived keys and record counters
(``SecureServerChannel.hand_over``). From then on the worker reads and writes the
consumer's connection: no frame passes through this process, so a round trip costs what
it costs with an in-process executor. The worker runs the session in a device context of
its own: its faults, a poisoned CUDA context included, end its own process and nothing
else.

- **Routing.** A ``hello`` goes to a pooled worker. A ``resume`` goes to the worker that
  welcomed that session token (the worker reports each token it welcomes); an unknown
  token goes to a pooled worker, which refuses it as an executor would, and the consumer
  says ``hello`` on the same connection. A blob connection (``blobs/service.py``: another
  host pulling a session's checkpoint) goes to the worker of the session its grant
  names, which keeps the pieces.
- **What the supervisor still answers for** (``_Handed``). A secure-channel resume that
  reaches the node is passed to the session's worker with its new connection, and a
  provider's close (a paused lease) is passed on as a message. The worker reports the
  bytes it carried every second (the provider meters the lease with them) and when the
  session ends. A stream that has no socket to pass (a libp2p stream, for consumers
  behind NAT) is bridged: the worker gets one end of a socket pair, and this process
  copies bytes between the other end and the stream.
- **Sharing the device** (``scheduler.Sharing``). By default workers run concurrently, on
  a CPU and on a GPU, and never ask for turns: the supervisor sets each worker's threads'
  nice value and scheduling policy from its lease (``scheduler.cpu_nice``, ``cpu_idle``),
  so an interruptible tenant gets the CPU that on-demand tenants leave idle, and a GPU's
  driver time-slices the workers' contexts. A supervisor configured for exclusive turns
  has workers ask for the device before a batch; it grants turns with the same sans-IO
  ``DeviceQueue`` an in-process executor uses, ranked by each worker's lease. A worker
  keeps its turn until another one asks. Then the queue says when it hands back: after its
  batch (the supervisor sends ``yield``), or at its next op (the supervisor also sets the
  worker's ``TurnFlag``, which the worker reads between ops): at once for a better-ranked
  waiter, after its quantum for an equal one. A tenant alone pays nothing per batch.
- **Memory past the device** (``eviction.py``). With ``device_bytes`` set, each worker's
  report says what its session holds and where (device, host memory, disk). When those
  on the device add up past the bound, the workers ``eviction.choose`` names are sent
  ``evict`` with where to (``eviction.destination``: host memory on a GPU while the
  sessions there fit ``ram_bytes`` together, else disk): they move their storages off
  between two batches and bring them back at the next. A worker whose session comes
  back, or whose batch will grow it past what it last asked for (the client says by how
  much), asks for its room first (``room``); the supervisor evicts others and answers
  once they reported it done. Growth the client could not foresee (a data-dependent
  op's outputs) is asked for after the batch, before its reply.
- **A worker dies.** Its consumer's connection closes with it (only the worker held
  it). A secure consumer resumes, and the node refuses the resume with what happened:
  "the worker process running it was killed by SIGKILL (a host failure)". With failover
  on, the client then moves the session from its checkpoint as if the host had vanished;
  without, it raises with that reason. A plain-TCP consumer sees the connection close.
  When the session's own op poisoned the device context, the worker tells its consumer
  first (``["lost", why, "session"]``): the client raises instead of failing over, as
  replaying the same ops elsewhere would poison the next host too. Any exit but a clean
  one or a tenant's poisoned context then runs a device check (``health.py``) in a fresh
  process; sessions wait for its verdict, and while the device is unhealthy no worker
  starts and ``health`` says why, so the provider withdraws its offer.
- **Secrets.** A worker holds nothing of this process's memory: it is forked from the
  zygote (``zygote.py``: exec'd fresh, it imported torch once and only forks), or exec'd
  fresh where no zygote runs. It inherits only its link, and gets only its own sessions'
  connections and keys. Where the kernel allows unprivileged user namespaces it runs (the
  zygote with it) in a mount namespace where the node's data directory is an empty,
  unmountable tmpfs.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path

import trio

from .._errors import FrameTooLargeError, RemoteProtocolError, SessionClosedError
from ..blobs import service as blobservice
from ..channel.transport import AsyncFrameChannel, Handover, HandoverError, frame_header
from ..wire.protocol import decode_frame
from .eviction import Candidate, Tier, plan
from .executor import ExecutorConfig, PlainTcpServing, pick_device, send_last
from .health import CHECK_TIMEOUT_S, DeviceHealth
from .scheduler import (
    DEFAULT_QUANTUM_S,
    DEFAULT_RANK,
    DEFAULT_SHARING,
    DeviceQueue,
    Handback,
    Sharing,
    cpu_idle,
    cpu_nice,
    on_demand,
)
from .session import SessionStats
from .worker import EXIT_POISONED, ROOM_WAIT_S, WorkerSpec
from .workerlink import LinkClosedError, TurnFlag, WorkerLink
from .zygote import ForkedWorker, Zygote

log = logging.getLogger(__name__)

#: Workers kept started and waiting for a session.
DEFAULT_POOL = 1
#: How long a worker may take from exec to ``ready`` (importing torch, a CUDA context).
START_TIMEOUT_S = 120.0
#: What a worker process runs (``python -m``).
WORKER_MODULE = "cumulus_p2p.host.worker"
#: How long a resume for a dying worker's session waits to learn how the worker ended.
EXIT_WAIT_S = 5.0
#: Turns one worker may wait for at once (a session and a resume taking it over need 2).
MAX_WAITING_TURNS = 4
#: How often an unhealthy device is checked again.
RECHECK_S = 30.0
#: Largest first frame of a session (a hello or a resume); it crosses to the worker.
MAX_FIRST_FRAME = 16 * 1024
#: Longest session token and end reason a worker may report.
MAX_TOKEN = 256
MAX_REASON = 1024
#: Bytes per read when bridging a stream that has no socket to hand over.
BRIDGE_CHUNK = 65536

_SANDBOX_SCRIPT = (
    'set -e; u=$1; g=$2; shift 2; while [ "$1" != -- ]; do '
    'mount -t tmpfs -o ro,size=4k,mode=000 cumulus-hidden "$1"; shift; done; shift; '
    'exec unshare --user --mount --map-user="$u" --map-group="$g" -- "$@"'
)


@dataclass
class SupervisorConfig:
    """How workers run: their executor's settings, how many wait pre-started, which
    directories (the node's data directory: its key) they must not see, and how they
    share the device (``scheduler.Sharing``; ``quantum``: an exclusive turn's length while
    an equal-ranked tenant waits)."""

    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    pool: int = DEFAULT_POOL
    hidden: tuple[Path, ...] = ()
    sharing: Sharing = DEFAULT_SHARING
    quantum: float = DEFAULT_QUANTUM_S


@dataclass
class _Worker:
    """One worker process as the supervisor tracks it."""

    process: subprocess.Popen | ForkedWorker
    link: WorkerLink
    rank: tuple = DEFAULT_RANK
    ready: trio.Event = field(default_factory=trio.Event)
    exited: trio.Event = field(default_factory=trio.Event)
    assigned: bool = False
    tokens: set[str] = field(default_factory=set)
    waiting: set[tuple] = field(default_factory=set)
    #: Sessions handed to it that have not ended, by number.
    handed: dict[int, _Handed] = field(default_factory=dict)
    #: Its session's ops and memory in use, as it last reported them.
    stats: SessionStats | None = None
    #: When its reported op count last moved (the eviction policy's recency).
    last_op_at: float = 0.0
    #: Where it was asked to ``evict`` to (None: not asked), until a report shows its
    #: device bytes down to ``evict_down_to`` (then ``evicted`` is set) or a batch ran.
    evicting: Tier | None = None
    evict_down_to: int = 0
    evicted: trio.Event = field(default_factory=trio.Event)
    #: Set to end its exclusive turn at its next op (None: it never takes turns).
    flag: TurnFlag | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def describe_exit(self) -> str:
        """How the worker ended, to finish the sentence "the worker ..."."""
        code = self.process.returncode
        if code is None:
            return "is still running"
        if code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        if code == EXIT_POISONED:
            return "stopped: the session's own op left its device context unusable"
        return f"exited with status {code}"


@dataclass
class SessionView:
    """A session handed to a worker, as status shows it."""

    worker_pid: int
    #: The consumer's key: whose session it is.
    owner: bytes | None = None
    #: Frame bytes the worker reports it carried, both ways.
    bytes_carried: int = 0


class _Handed:
    """A session handed over to a worker, as the supervisor still answers for it.

    It is the secure channel's ``Successor``: resumes that reach the supervisor's secure
    server are passed to the worker with their connection, and a provider's close is
    passed on as a message. ``done`` is set when the session ended in the worker, or the
    worker died (``ended`` then says how, and a resume is refused with that reason).
    """

    def __init__(
        self, supervisor: WorkerSupervisor, worker: _Worker, number: int, view: SessionView
    ) -> None:
        self.supervisor = supervisor
        self.worker = worker
        self.number = number
        self.view = view
        self.ended: str | None = None
        self.done = trio.Event()
        self._on_bytes = None
        self._on_peer_bytes = None

    async def start(self, handover: Handover, first: bytearray, options: dict) -> None:
        """Send the worker the session: its connection, and everything read from it."""
        self._on_bytes = handover.on_bytes
        self._on_peer_bytes = handover.on_peer_bytes
        self.worker.handed[self.number] = self
        buffered = handover.buffered
        if handover.secure is None:
            buffered = frame_header([first], MAX_FIRST_FRAME) + first + buffered
        else:
            handover.secure["inbox"].insert(0, bytes(first))  # the worker takes it again
        message = ["session", self.number, options, handover.secure, buffered]
        try:
            passed = await self._pass(handover.stream, message)
        except ValueError as exc:
            passed = False
            self.finish(f"the consumer sent more before its welcome than a session may: {exc}")
        if not passed:
            await trio.aclose_forcefully(handover.stream)
            self.finish(self.ended or "the worker picked for it died at once (a host failure)")

    async def resume(self, stream: trio.abc.Stream, hello: bytes, buffered: bytes) -> str | None:
        if self.ended is None and await self._pass(
            stream, ["resume", self.number, hello, buffered]
        ):
            return None
        with trio.move_on_after(EXIT_WAIT_S):
            await self.done.wait()  # the worker is dying: learn how
        return self.ended or "the worker running it is gone (a host failure)"

    async def close(self, reason: str) -> None:
        try:
            await self.worker.link.send(["close", self.number, reason])
        except LinkClosedError:
            pass  # it died: its consumer learns why when it resumes

    def carried(self, nbytes: int, peer_bytes: int = 0) -> None:
        """The worker carried ``nbytes`` more of the session's frames, and its collectives
        ``peer_bytes`` between the job's hosts."""
        self.view.bytes_carried += nbytes
        if self._on_bytes is not None:
            self._on_bytes(nbytes)
        if peer_bytes and self._on_peer_bytes is not None:
            self._on_peer_bytes(peer_bytes)

    def finish(self, reason: str) -> None:
        if self.ended is None:
            self.ended = reason
        self.worker.handed.pop(self.number, None)
        self.done.set()

    async def _pass(self, stream: trio.abc.Stream, message: list) -> bool:
        """Send ``message`` and ``stream``'s connection to the worker: True once the worker
        holds it (this process's copy is closed), False if the worker is gone.

        A stream without a socket (a libp2p stream) is bridged: the worker gets one end
        of a socket pair, and a task here copies bytes between the other end and it.

        Raises:
            ValueError: the message is too large for the link.
        """
        sock = getattr(stream, "socket", None)
        if sock is not None:
            try:
                await self.worker.link.send(message, sock.fileno())
            except LinkClosedError:
                return False
            await trio.aclose_forcefully(stream)  # the kernel closes it when the worker does
            return True
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            await self.worker.link.send(message, theirs.fileno())
        except LinkClosedError:
            ours.close()
            return False
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.supervisor._nursery.start_soon(_bridge, stream, ours)
        return True


class WorkerSupervisor(PlainTcpServing):
    """Serves sessions, each in a worker process of its own; a drop-in for ``Executor``.

    Run ``run`` in a nursery first (``nursery.start(supervisor.run)``): it owns the
    workers. Then hand channels to ``run_session`` as to an executor.
    """

    def __init__(self, config: SupervisorConfig | None = None) -> None:
        self.config = config or SupervisorConfig()
        self.device = pick_device(self.config.executor.device)
        self.health = DeviceHealth()
        self.sessions: dict[int, SessionView] = {}
        self.sandboxed = False
        self.sharing = self.config.sharing
        self.queue = DeviceQueue(quantum=self.config.quantum)
        self._turn_changed = trio.Event()
        self._workers: dict[int, _Worker] = {}
        self._idle: deque[_Worker] = deque()
        self._tokens: dict[str, _Worker] = {}
        self._pool_wanted = trio.Event()
        self._pool_ready = trio.Event()
        self._checking = False
        self._takers = 0  # sessions waiting for a worker
        self._yield_asked = False
        self._nursery: trio.Nursery | None = None
        self._ids = itertools.count(1)
        self._blob_fd = _open_blob_dir(self.config.executor.blob_dir)
        self._zygote: Zygote | None = None
        self._spec = WorkerSpec.of(
            self.config.executor,
            device=str(self.device),
            blob_dir=None if self._blob_fd is None else f"/proc/self/fd/{self._blob_fd}",
            sharing=self.sharing,
        )

    @property
    def workers(self) -> int:
        """Worker processes alive, pooled or serving."""
        return len(self._workers)

    @property
    def ready_workers(self) -> int:
        """Workers started and waiting for a session."""
        return len(self._idle)

    # --- the pool ---------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep the pool full until cancelled; every worker is this task's child."""
        self.sandboxed = bool(self.config.hidden) and await _namespaces_work()
        if self.config.hidden and not self.sandboxed:
            log.warning(
                "workers can read %s: unprivileged user namespaces are not available here "
                "(the unshare command failed); session code runs with this user's file access",
                ", ".join(map(str, self.config.hidden)),
            )
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            nursery.start_soon(self._turn_clock)
            try:
                await self._keep_pool()
            finally:
                for worker in list(self._workers.values()):
                    worker.link.close()  # each worker exits when its link closes

    #: What ``serve_tcp`` runs beside its listeners: the pool.
    _upkeep = run

    async def _keep_pool(self) -> None:
        await self._start_zygote()
        while True:
            unassigned = sum(1 for w in self._workers.values() if not w.assigned)
            if self.health.healthy and unassigned < max(self.config.pool, self._takers):
                try:
                    await self._start_worker()
                except OSError as exc:
                    why = f"a worker could not be started ({exc}); retrying in {RECHECK_S:.0f} s"
                    self._set_health(DeviceHealth(False, why))
                    await self._retry_later()
            else:
                await self._pool_wanted.wait()

    async def _start_zygote(self) -> None:
        """Start the process workers are forked from (``zygote.py``); where it cannot
        start, workers are exec'd afresh, as they were before it."""
        try:
            self._zygote = await Zygote.start(
                self._sandbox_prefix(), _worker_environment(), START_TIMEOUT_S
            )
        except OSError as exc:
            log.warning("workers start as fresh processes: %s", exc)
            return
        self._nursery.start_soon(self._zygote.serve)

    async def _start_worker(self) -> None:
        link, theirs = WorkerLink.pair()
        flag, flag_fd = (None, None)
        passed = [theirs.fileno()] if self._blob_fd is None else [theirs.fileno(), self._blob_fd]
        zygote = self._zygote if self._zygote is not None and self._zygote.alive else None
        try:
            if self.sharing is Sharing.EXCLUSIVE:
                flag, flag_fd = TurnFlag.create()
                passed.append(flag_fd)
            if zygote is not None:
                args = self._worker_args(theirs.fileno(), flag_fd, zygote.process.pid)
                process: subprocess.Popen | ForkedWorker = await zygote.fork(args, passed)
            else:
                args = self._worker_args(theirs.fileno(), flag_fd, os.getpid())
                process = subprocess.Popen(
                    [*self._sandbox_prefix(), sys.executable, "-m", WORKER_MODULE, *args],
                    pass_fds=passed,
                    stdin=subprocess.DEVNULL,
                    env=_worker_environment(),
                )
        finally:
            theirs.close()
            if flag_fd is not None:
                os.close(flag_fd)
        worker = _Worker(process, link, flag=flag)
        self._workers[worker.pid] = worker
        self._nursery.start_soon(self._run_worker, worker)

    def _worker_args(self, fd: int, flag_fd: int | None, parent: int) -> list[str]:
        """``cumulus_p2p.host.worker``'s arguments; ``parent``: the pid it must be a
        child of (this process, or the zygote it is forked from)."""
        args = ["--link-fd", str(fd), "--spec", self._spec.to_json(), "--parent", str(parent)]
        if flag_fd is not None:
            args += ["--turn-fd", str(flag_fd)]
        return args

    def _sandbox_prefix(self) -> list[str]:
        """What a worker's (or the zygote's) command runs under: the mount namespace
        hiding ``config.hidden``, where there is one."""
        if not self.sandboxed:
            return []
        hidden = [str(p) for p in self.config.hidden]
        ids = [str(os.getuid()), str(os.getgid())]
        prefix = ["unshare", "--user", "--map-root-user", "--mount", "--", "sh", "-c"]
        return [*prefix, _SANDBOX_SCRIPT, "sh", *ids, *hidden, "--"]

    async def _run_worker(self, worker: _Worker) -> None:
        try:
            await self._serve_link(worker)
        finally:
            with trio.CancelScope(shield=True):
                await _reap(worker.process)
            self._forget(worker)

    async def _serve_link(self, worker: _Worker) -> None:
        """Read the worker's messages until its link closes (it exited, was killed or
        broke the rules: a worker runs tenant code, so its messages are not trusted)."""
        try:
            with trio.fail_after(START_TIMEOUT_S):
                message = await _receive(worker.link)
            if message[0] != "ready":
                raise LinkClosedError(f"it said {message[0]!r} before ready")
            worker.ready.set()
            self._idle.append(worker)
            log.info("worker %d ready: %d in the pool", worker.pid, len(self._idle))
            _wake(self, "_pool_ready")
            while True:
                self._on_message(worker, await _receive(worker.link))
        except trio.TooSlowError:
            log.warning("worker %d did not start within %.0f s", worker.pid, START_TIMEOUT_S)
        except LinkClosedError as exc:
            log.debug("worker %d: link closed: %s", worker.pid, exc)

    def _on_message(self, worker: _Worker, message: list) -> None:
        if message[0] == "stats":
            stats = _stats(message)
            ran = worker.stats is None or stats.ops != worker.stats.ops
            if ran:
                worker.last_op_at = _now()
            done = worker.evicting is not None and stats.bytes_on_device <= worker.evict_down_to
            # Asked once until it did, or ran a batch since (which brought it all back).
            if done or ran:
                worker.evicting = None
            worker.stats = stats
            if done or not _on_device(worker):
                worker.evicted.set()
            self._review_memory()
            return
        if message[0] == "room":
            number, nbytes = _room(message)
            # Its session is at work and holds, or brings back, ``nbytes``: a report of
            # its size, sooner than the next one (``Executor._after_growth``).
            worker.last_op_at = _now()
            sized = {"bytes_in_use": nbytes, "bytes_on_device": nbytes, "tier": Tier.DEVICE.value}
            worker.stats = replace(worker.stats or SessionStats(), **sized)
            self._nursery.start_soon(self._make_room_for, worker, number, nbytes)
            return
        if message[0] in ("traffic", "ended", "token"):
            self._on_session_message(worker, message)
            return
        kind, number = message[0], message[1] if len(message) == 2 else None
        if type(number) is not int and kind != "release":
            raise LinkClosedError(f"it sent a malformed {kind!r} message")
        ticket = (worker.pid, number)
        if kind == "acquire":
            if len(worker.waiting) >= MAX_WAITING_TURNS:
                raise LinkClosedError("it asked for more turns at once than it has sessions")
            if self.queue.request(ticket, worker.rank, now=_now()):
                self._grant(ticket)
            else:
                worker.waiting.add(ticket)
                self._review_turn()
        elif kind == "release" and len(message) == 1:
            if self.queue.holder is not None and self.queue.holder[0] == worker.pid:
                self._pass_turn()
        elif kind == "cancel":
            if self.queue.holder == ticket:
                self._pass_turn()
            elif ticket in worker.waiting:
                worker.waiting.discard(ticket)
                self.queue.withdraw(ticket)
        else:
            raise LinkClosedError(f"it sent an unknown message {kind!r}")

    def _review_memory(self) -> None:
        """Past ``device_bytes``, ask the workers ``eviction.choose`` names to evict.

        Each worker holds its own memory, so this runs as reports come (every
        ``STATS_EVERY_S``). A session coming back from eviction, or grown past what it
        last asked for, asks first (``_make_room_for``)."""
        self._evict_for(0, None)

    async def _make_room_for(self, asking: _Worker, number: int, nbytes: int) -> None:
        """A worker's session is coming back from eviction with ``nbytes``, or has grown
        to them: evict others until it fits, wait (up to ``ROOM_WAIT_S``) until they
        report their memory moved, then answer ``roomed``."""
        chosen = self._evict_for(nbytes, asking)
        with trio.move_on_after(ROOM_WAIT_S) as waited:
            for worker in chosen:
                await worker.evicted.wait()
        if waited.cancelled_caught:
            # A hung worker must not hold the others' batches; its memory stays put.
            late = [w.pid for w in chosen if not w.evicted.is_set()]
            log.warning(
                "workers %s did not move their sessions off the device within %.0f s; "
                "worker %d's batch runs anyway",
                late, ROOM_WAIT_S, asking.pid,
            )  # fmt: skip
        try:
            asking.link.send_nowait(["roomed", number])
        except LinkClosedError:
            pass  # it is gone; so is its question

    def _evict_for(self, incoming: int, asking: _Worker | None) -> list[_Worker]:
        """Send ``evict`` to the workers ``eviction.plan`` names, each with where to and
        how many bytes, so that what is on the device, and ``incoming`` more bytes for
        ``asking``, fit ``device_bytes``. A worker in its exclusive turn counts as in its
        turn. Returns those asked."""
        bound = self.config.executor.device_bytes
        if bound is None:
            return []
        held = [
            w
            for w in self._workers.values()
            if w is not asking and _on_device(w) and not w.evicting
        ]
        need = sum(w.stats.bytes_on_device for w in held) + incoming - bound  # type: ignore[union-attr]
        holder = self.queue.holder
        candidates = [
            Candidate(
                w,
                w.rank,
                on_demand(w.rank),
                w.stats.bytes_on_device,  # type: ignore[union-attr]
                w.last_op_at,
                in_turn=holder is not None and holder[0] == w.pid,
            )
            for w in held
        ]
        places = {
            "device_is_host": self.device.type == "cpu",
            "ram_free": self._ram_free(),
            "disk": self._blob_fd is not None,
        }
        asked = []
        for move in plan(candidates, need, now=_now(), **places):
            worker: _Worker = move.key  # type: ignore[assignment]
            worker.evicting, worker.evicted = move.tier, trio.Event()
            worker.evict_down_to = max(0, worker.stats.bytes_on_device - move.nbytes)  # type: ignore[union-attr]
            asked.append(worker)
            try:
                worker.link.send_nowait(["evict", move.tier.value, move.nbytes])
            except LinkClosedError:
                worker.evicted.set()  # it is gone: its memory goes with it
        return asked

    def _ram_free(self) -> int | None:
        """What the RAM tier may still take across the workers (None: no bound): their
        sessions in host memory, as reported, or on their way there."""
        bound = self.config.executor.ram_bytes
        if bound is None:
            return None
        return max(0, bound - sum(_ram_bytes(w) for w in self._workers.values()))

    def _on_session_message(self, worker: _Worker, message: list) -> None:
        kind, *args = message
        if kind == "token" and len(args) == 1 and isinstance(args[0], str):
            if len(args[0]) > MAX_TOKEN:
                raise LinkClosedError("it named an oversized session token")
            worker.tokens.add(args[0])
            self._tokens[args[0]] = worker
            return
        if len(args) not in (2, 3) or type(args[0]) is not int:
            raise LinkClosedError(f"it sent a malformed {kind!r} message")
        number, value, *peer = args
        handed = worker.handed.get(number)
        if kind == "traffic" and all(type(v) is int and v >= 0 for v in (value, *peer)):
            if handed is not None:
                handed.carried(value, *peer)
        elif kind == "ended" and isinstance(value, str) and not peer:
            if handed is not None:
                handed.finish(value[:MAX_REASON])
        else:
            raise LinkClosedError(f"it sent a malformed {kind!r} message")

    def _grant(self, ticket: tuple) -> None:
        worker = self._workers.get(ticket[0])
        try:
            if worker is None:
                raise LinkClosedError("gone")
            if worker.flag is not None:
                worker.flag.clear()  # before the grant: the worker reads it from then on
            worker.link.send_nowait(["grant", ticket[1]])
        except LinkClosedError:
            self._pass_turn()  # it died before its turn came: the next waiter goes
            return
        self._yield_asked = False
        self._review_turn()  # others wait: hand back after this batch, or sooner

    def _review_turn(self) -> None:
        """Tell the holder when to hand its turn back, as the queue decides it now: after
        its batch (``yield``), or at its next op (``yield``, and its flag set)."""
        _wake(self, "_turn_changed")  # the turn clock looks at the new review time
        holder = self.queue.holder
        owner = self._workers.get(holder[0]) if holder is not None else None
        if owner is None:
            return
        handback = self.queue.handback(_now())
        if handback is Handback.AT_NEXT_OP and owner.flag is not None:
            owner.flag.set()
        if handback is Handback.KEEP or self._yield_asked:
            return
        self._yield_asked = True
        try:
            owner.link.send_nowait(["yield"])
        except LinkClosedError:
            pass  # its link's reader buries it and passes the turn on

    async def _turn_clock(self) -> None:
        """Review the turn when the holder's quantum ends while an equal tenant waits."""
        reviewed = -math.inf
        while True:
            at = self.queue.review_at()
            if at is None or at <= reviewed:  # nothing due, or due and done
                at = math.inf
            with trio.move_on_after(max(0.0, at - _now())):
                await self._turn_changed.wait()
                continue
            reviewed = _now()
            self._review_turn()

    def _pass_turn(self) -> None:
        following = self.queue.release(now=_now())
        if following is not None:
            owner = self._workers.get(following[0])
            if owner is not None:
                owner.waiting.discard(following)
            self._grant(following)

    def _forget(self, worker: _Worker) -> None:
        """The worker is gone: give back its turns and tokens; check the device if need be."""
        worker.link.close()
        worker.exited.set()
        worker.evicted.set()  # nobody waits for its memory to move: it is freed
        del self._workers[worker.pid]
        if worker in self._idle:
            self._idle.remove(worker)
        for token in worker.tokens:
            self._tokens.pop(token, None)
        if worker.handed:
            own = worker.process.returncode == EXIT_POISONED
            blame = "caused by this session" if own else "a host failure"
            why = f"the worker process running it {worker.describe_exit()} ({blame})"
            for handed in list(worker.handed.values()):
                handed.finish(why)
        for ticket in worker.waiting:
            self.queue.withdraw(ticket)
        if self.queue.holder is not None and self.queue.holder[0] == worker.pid:
            self._pass_turn()
        code = worker.process.returncode
        if not worker.ready.is_set() and isinstance(worker.process, ForkedWorker):
            # The fork may be what failed (say, a driver that cannot start in a forked
            # process, or the zygote's namespace): later workers are exec'd, as before the
            # zygote, and the checks below apply to them. The zygote's workers serve on.
            self._zygote = None
            log.warning(
                "a worker forked from the zygote failed to start (it %s); workers are "
                "exec'd afresh from now on",
                worker.describe_exit(),
            )
        elif not worker.ready.is_set() and self.sandboxed:
            # The namespace may be what failed (a driver that wants the real mounts, a
            # hidden path that is gone): serving without it beats serving nothing.
            self.sandboxed = False
            log.warning(
                "a worker failed to start in its user namespace (it %s); starting workers "
                "without hiding %s from them",
                worker.describe_exit(),
                ", ".join(map(str, self.config.hidden)),
            )
        elif not worker.ready.is_set():
            why = f"a worker failed to start (it {worker.describe_exit()})"
            self._set_health(DeviceHealth(False, f"{why}; retrying in {RECHECK_S:.0f} s"))
            self._nursery.start_soon(self._retry_later)
        elif code not in (0, EXIT_POISONED) and not self._checking:
            why = f"worker {worker.pid} failed (it {worker.describe_exit()})"
            log.warning("%s; checking the device", why)
            # Unhealthy from now, not from when the check task first runs: the pool
            # keeper must not start a worker on a device that may be broken.
            self._checking = True
            self._set_health(DeviceHealth(False, f"checking the device after {why}"))
            self._nursery.start_soon(self._check_device, why)
        _wake(self, "_pool_wanted")

    async def _retry_later(self) -> None:
        await trio.sleep(RECHECK_S)
        self._set_health(DeviceHealth())

    async def _check_device(self, why: str) -> None:
        """Run the health check in a fresh process until the device passes it."""
        try:
            while True:
                self._set_health(DeviceHealth(False, f"checking the device after {why}"))
                problem = await _run_health_check(str(self.device))
                if problem is None:
                    self._set_health(DeviceHealth())
                    return
                reason = f"the device failed its check after {why}: {problem}"
                self._set_health(DeviceHealth(False, reason))
                log.error("%s; checking again in %.0f s", reason, RECHECK_S)
                await trio.sleep(RECHECK_S)
        finally:
            self._checking = False

    def _set_health(self, health: DeviceHealth) -> None:
        self.health = health
        _wake(self, "_pool_wanted")
        _wake(self, "_pool_ready")

    # --- sessions ---------------------------------------------------------------------

    def session_stats(self, owner: bytes) -> SessionStats | None:
        """The running session of the consumer with key ``owner``: ops and memory in use,
        as its worker last reported them (every ``STATS_EVERY_S``)."""
        views = [v for v in self.sessions.values() if v.owner == owner]
        worker = self._workers.get(views[-1].worker_pid) if views else None
        return worker.stats if worker is not None else None

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
        """Hand one session to a worker process and return when it ended there; the
        arguments are ``Executor.run_session``'s. ``channel`` must support ``hand_over``
        (plain TCP, a secure channel, a ``CountingChannel`` around either)."""
        try:
            first = await channel.receive_frame()
            if len(first) > MAX_FIRST_FRAME:
                raise RemoteProtocolError(
                    f"a session opens with a hello or a resume of at most {MAX_FIRST_FRAME} "
                    f"bytes, not {len(first)}"
                )
            worker = await self._route(first, rank, only_blobs=only_blobs)
        except (RemoteProtocolError, FrameTooLargeError, _Unavailable) as exc:
            await send_last(channel, ["fatal", str(exc)])
            await channel.aclose()
            return
        except SessionClosedError:
            await channel.aclose()
            return
        key = getattr(channel, "peer_public_key", None)
        options = {
            "quota": quota_bytes,
            "hold": hold_bytes,
            "rank": list(rank),
            "owner": key.hex() if key else None,
            "seconds": None if until == math.inf else max(0.0, until - trio.current_time()),
        }
        handed = _Handed(self, worker, next(self._ids), SessionView(worker.pid, owner=key))
        try:
            handover = channel.hand_over(handed)  # type: ignore[attr-defined]
        except HandoverError as exc:
            await send_last(channel, ["fatal", f"the session could not reach its worker: {exc}"])
            await channel.aclose()
            return
        self.sessions[handed.number] = handed.view
        try:
            await handed.start(handover, first, options)
            await handed.done.wait()
        finally:
            del self.sessions[handed.number]

    def holds_grant(self, grant: str) -> bool:
        """Whether a session here keeps pieces under ``grant``."""
        return self._granted(grant) is not None

    def _granted(self, grant: object) -> _Worker | None:
        return next((w for t, w in self._tokens.items() if blobservice.grant_of(t) == grant), None)

    async def _route(self, first: bytearray, rank: tuple, *, only_blobs: bool) -> _Worker:
        header, _ = decode_frame(first)
        if header[0] == blobservice.HELLO and len(header) == 3 and isinstance(header[2], dict):
            # Another host pulling a session's kept pieces: they live in its worker.
            owner = self._granted(header[2].get("grant"))
            if owner is None:
                raise RemoteProtocolError("no session here keeps pieces under that grant")
            return owner
        if only_blobs:
            raise RemoteProtocolError(blobservice.ONLY_BLOBS)
        if header[0] == "resume" and len(header) == 3 and isinstance(header[2], dict):
            owner = self._tokens.get(header[2].get("token"))
            if owner is not None:
                owner.rank = rank  # a renewed lease may rank differently
                self._weigh(owner)
                return owner
        return await self._take_worker(rank)

    async def _take_worker(self, rank: tuple) -> _Worker:
        self._takers += 1
        try:
            # While the device is being checked, sessions wait for the verdict.
            while not self._idle or self._checking:
                if not self.health.healthy and not self._checking:
                    raise _Unavailable(f"the device is not available: {self.health.reason}")
                _wake(self, "_pool_wanted")
                await self._pool_ready.wait()
        finally:
            self._takers -= 1
        worker = self._idle.popleft()
        worker.assigned = True
        worker.rank = rank
        self._weigh(worker)
        _wake(self, "_pool_wanted")  # start its replacement
        return worker

    def _weigh(self, worker: _Worker) -> None:
        """On a concurrently shared CPU, give the worker's threads its rank's share."""
        if self.sharing is Sharing.CONCURRENT:
            _weigh_threads(worker.pid, cpu_nice(worker.rank), idle=cpu_idle(worker.rank))

    def _max_frame(self) -> int:
        return self.config.executor.max_frame


def _open_blob_dir(path: str | None) -> int | None:
    """A descriptor on the host's blob store directory (created if missing), for workers
    to inherit: their sandbox hides the node's data directory, the store's home."""
    if path is None:
        return None
    Path(path).mkdir(parents=True, exist_ok=True)
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def _worker_environment() -> dict[str, str]:
    """This process's environment, with OpenMP's idle threads sleeping instead of spinning.

    Each worker has a thread pool of its own, and tenants share the machine's cores. With
    OpenMP's default spin-wait after each parallel op, one worker's idle threads starve
    the others: on 2 cores, four busy tenants made 47 steps/s together against 128, and
    an on-demand tenant's step beside three of them took 12.6 ms against 5.5
    (isolation_bench). What a tenant alone pays for it on the tiniest CPU steps is within
    this machine's noise (mlp_tiny, in-process executor: 2.14 ms spinning, 2.20 passive). Fewer
    threads would avoid that too, but a CPU worker then no longer computes bit for bit
    what a local CPU run does. A variable the user set wins.
    """
    return {"OMP_WAIT_POLICY": "PASSIVE"} | dict(os.environ)


def _now() -> float:
    """The clock the turn rules run on (``DeviceQueue``'s ``now``)."""
    return time.monotonic()


def _weigh_threads(pid: int, nice: int, *, idle: bool) -> None:
    """Set the nice value, and with ``idle`` the idle policy, of every thread of process
    ``pid`` (Linux: both are per thread; threads it starts later inherit their starter's).
    Lowering a nice value needs a privilege the supervisor may lack: then the thread keeps
    its value."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]  # not Linux, or the process is gone
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
            if idle and hasattr(os, "SCHED_IDLE"):
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except OSError as exc:
            log.debug("could not weigh thread %d (nice %d, idle %s): %s", tid, nice, idle, exc)


class _Unavailable(Exception):
    """No worker can be had: the device is unhealthy."""


def _stats(message: list) -> SessionStats:
    """A worker's ``["stats", ops, bytes_in_use, wait_p50_ms, wait_p99_ms, tier,
    bytes_on_device, held_bytes]``, checked: a worker runs tenant code. Without
    ``bytes_on_device``, all its bytes are on the device or none is, as ``tier`` says;
    without ``held_bytes``, it holds none."""
    if len(message) not in (6, 7, 8) or not all(type(v) is int and v >= 0 for v in message[1:3]):
        raise LinkClosedError("it sent malformed stats")
    waits = message[3:5]
    if not all(v is None or (type(v) is float and 0 <= v < math.inf) for v in waits):
        raise LinkClosedError("it sent malformed waits")
    if message[5] not in _TIERS:
        raise LinkClosedError("it named no tier its memory could be in")
    on_device = message[2] if message[5] == Tier.DEVICE.value else 0
    if len(message) >= 7:
        on_device = message[6]
        if type(on_device) is not int or not 0 <= on_device <= message[2]:
            raise LinkClosedError("it sent malformed stats: more on the device than it holds")
    held = message[7] if len(message) == 8 else 0
    if type(held) is not int or held < 0:
        raise LinkClosedError("it sent malformed stats: its held bytes are no count")
    return SessionStats(
        ops=message[1],
        bytes_in_use=message[2],
        wait_p50_ms=waits[0],
        wait_p99_ms=waits[1],
        tier=message[5],
        bytes_on_device=on_device,
        held_bytes=held,
    )


_TIERS = frozenset(t.value for t in Tier)


def _room(message: list) -> tuple[int, int]:
    """A worker's ``["room", n, nbytes]``, checked."""
    if len(message) != 3 or not all(type(v) is int and v >= 0 for v in message[1:]):
        raise LinkClosedError("it sent a malformed room request")
    return message[1], message[2]


def _ram_bytes(worker: _Worker) -> int:
    """What ``worker``'s session holds in host memory as an evicted one, or will: all it
    holds, at most, while on its way there."""
    stats = worker.stats
    if stats is None or worker.evicting is Tier.DISK:
        return 0
    if worker.evicting is Tier.RAM:
        return stats.bytes_in_use
    return stats.bytes_in_use - stats.bytes_on_device if stats.tier == Tier.RAM.value else 0


def _on_device(worker: _Worker) -> bool:
    """Whether ``worker``'s session holds memory on the device, as it last reported."""
    return worker.stats is not None and worker.stats.bytes_on_device > 0


def _wake(owner: object, name: str) -> None:
    """Wake whoever waits on the event ``owner.<name>`` and arm a fresh one."""
    event = getattr(owner, name)
    setattr(owner, name, trio.Event())
    event.set()


async def _receive(link: WorkerLink) -> list:
    message, fd = await link.receive()
    if fd is not None:
        os.close(fd)  # workers never send sockets
        raise LinkClosedError("it sent a file descriptor")
    return message


async def _bridge(stream: trio.abc.Stream, sock: socket.socket) -> None:
    """Copy bytes both ways between ``stream`` and ``sock`` until either side ends."""
    bridged = trio.SocketStream(trio.socket.from_stdlib_socket(sock))

    async def copy(source: trio.abc.ReceiveStream, sink: trio.abc.SendStream) -> None:
        while data := await source.receive_some(BRIDGE_CHUNK):
            await sink.send_all(data)

    async def one_way(source, sink, nursery: trio.Nursery) -> None:
        try:
            await copy(source, sink)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        nursery.cancel_scope.cancel()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(one_way, stream, bridged, nursery)
            nursery.start_soon(one_way, bridged, stream, nursery)
    finally:
        await trio.aclose_forcefully(bridged)
        await trio.aclose_forcefully(stream)


async def _reap(process: subprocess.Popen | ForkedWorker) -> None:
    """Wait for a worker whose link closed to exit; kill it if it lingers."""
    with trio.move_on_after(5):
        await _exited(process)
    if process.poll() is None:
        process.kill()
        await _exited(process)


async def _exited(process: subprocess.Popen | ForkedWorker) -> None:
    if isinstance(process, ForkedWorker):
        await process.exited.wait()  # its zygote reaps it and says so
    else:
        await trio.to_thread.run_sync(process.wait, abandon_on_cancel=True)


async def _namespaces_work() -> bool:
    """Whether this machine lets an unprivileged process hide directories from its workers."""
    if shutil.which("unshare") is None:
        return False
    cmd = ["unshare", "--user", "--map-root-user", "--mount", "--", "true"]
    try:
        done = await trio.run_process(cmd, check=False, capture_stderr=True)
    except OSError:
        return False
    return done.returncode == 0


async def _run_health_check(device: str) -> str | None:
    cmd = [sys.executable, "-m", "cumulus_p2p.host.health", "--device", device]
    with trio.move_on_after(CHECK_TIMEOUT_S):
        done = await trio.run_process(cmd, check=False, capture_stderr=True)
        if done.returncode == 0:
            return None
        return done.stderr.decode(errors="replace").strip()[-500:] or f"status {done.returncode}"
    return f"the check did not finish within {CHECK_TIMEOUT_S:.0f} s"
