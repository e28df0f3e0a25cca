"""A worker process: one tenant's session, in a device context of its own.

The supervisor (``supervisor.py``) starts workers before they are needed and hands each
one a single session: the consumer's connection itself, the bytes already read from it,
and, for a secure session, its derived keys and record counters (never the node key).
The worker serves it with an ordinary ``Executor``, so the op rules, quotas, parking and
resumes are the ones a shared executor has; a secure session continues in a
``SecureServer`` of its own (``SecureServer.adopt``). Later connections that resume the
same session come to the same worker.

Why a process per session: a CUDA context belongs to a process, and a device-side assert
poisons it for good. In its own process, one tenant's bug ends one session; the
supervisor sees the worker go, checks the device and carries on.

Messages on the link (``workerlink.py``), worker to supervisor:

- ``["ready", pid]``: started, the device is initialised.
- ``["acquire", n]`` / ``["release"]`` / ``["cancel", n]``: device turns
  (``SupervisorTurns``), granted across all workers by the supervisor's ``DeviceQueue``
  in the rank of each worker's lease. Only on an exclusively shared device: by default
  workers run at once (``scheduler.Sharing``) and never ask.
- ``["stats", ops, bytes_in_use, wait_p50_ms, wait_p99_ms, tier, bytes_on_device,
  held_bytes]``: its session at work, every ``STATS_EVERY_S`` while it serves one and at
  once after an ``evict`` (the provider's status shows it; the waits are nil while it
  took no device turn in the last minute; ``tier``: where its evicted storages are,
  ``eviction.Tier``'s value, ``bytes_on_device`` what stays on the device, and
  ``held_bytes`` what it keeps pinned in the host's store: a standby's checkpoint).
- ``["token", token]``: a session it welcomed (resumes naming it are routed here).
- ``["traffic", n, bytes, peer_bytes]``: frame bytes session ``n`` carried since the
  last report, and bytes its collectives carried between the job's hosts, every
  ``STATS_EVERY_S`` and at its end (the provider meters the lease with them).
- ``["ended", n, reason]``: session ``n`` ended here.

Supervisor to worker:

- ``["session", n, options, secure, buffered]`` with the consumer's connection: serve it
  as session ``n`` (``options``: ``quota``, ``rank``, ``seconds`` left in the lease,
  ``owner``: who may resume it, hex or None; ``secure``: the secure session's state, or
  None for plain frames; ``buffered``: bytes read from the connection, in order).
- ``["resume", n, hello, buffered]`` with a new connection: the consumer of secure session
  ``n`` resumes on it (its ``RESUME_HELLO`` was read by the supervisor).
- ``["close", n, reason]``: end secure session ``n`` (the provider paused its lease).
- ``["evict", tier, nbytes]``: move the sessions' coldest storages off the device to
  ``tier`` ("ram" or "disk", ``eviction.Tier``; ``Executor.evict_all``) until ``nbytes``
  are off: the supervisor makes room for another worker's tenant, and says where the
  host has room. They come back at their next batch.
- ``["roomed", n]``: the answer to the worker's ``["room", n, nbytes]`` (worker to
  supervisor: an evicted session is coming back with ``nbytes``): others were asked to
  evict, and reported it, or the supervisor's wait ran out.
- ``["grant", n]``: turn ``n`` is yours, until you are asked to ``["yield"]`` it (at the
  end of the running batch) or the ``TurnFlag`` the worker was started with is set (at its
  next op; the executor reads it between ops).

The worker exits 0 once it served a session and holds none (ended, or parked and
expired), ``EXIT_POISONED`` when its session left the device context unusable, and at
once if the supervisor goes (the link closes; ``PR_SET_PDEATHSIG`` is the backstop).
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import logging
import math
import os
import signal
import socket
import sys
from dataclasses import asdict, dataclass
from functools import partial

import torch
import trio

from ..channel.secure.server import SecureServer, SecureServerChannel
from ..channel.transport import AsyncFrameChannel, Handover, TrioFrameChannel, nbytes
from ..wire.protocol import decode_frame
from .eviction import Tier
from .executor import DEFAULT_BLOB_CAP, Executor, ExecutorConfig
from .options import GraphCompiler
from .scheduler import DEFAULT_SHARING, DeviceScheduler, Sharing
from .workerlink import LinkClosedError, TurnFlag, WorkerLink

log = logging.getLogger(__name__)

#: Exit status of a worker whose session poisoned its device context (not the host's fault).
EXIT_POISONED = 3
#: Room above the session quota for the CUDA allocator's cache, in its own cap.
ALLOCATOR_HEADROOM = 256 * 1024**2
#: How long the supervisor waits for other workers to evict before it answers a room
#: request (a worker waits twice that for the answer).
ROOM_WAIT_S = 10.0
#: How often an idle worker checks whether its parked session has expired.
IDLE_CHECK_S = 0.25
#: Seconds between a serving worker's reports of its session's ops and memory.
STATS_EVERY_S = 1.0
_PR_SET_PDEATHSIG = 1
#: A frame's length prefix, counted with its bytes as the provider meters them.
FRAME_PREFIX = 4
_WELCOME_START = b"\x93\xa7welcome"  # msgpack: a 3-element array whose first element is "welcome"


#: The fields of the host's ``ExecutorConfig`` that a worker's executor takes as they are
#: (``WorkerSpec`` carries the others as text, or leaves them to the supervisor: the
#: device memory bounds).
_AS_CONFIGURED = (
    "quota_bytes",
    "max_frame",
    "cache_grace",
    "cache_bytes",
    "blob_cap",
    "peer_links",
)


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker is started with: the executor's configuration, as argv-safe JSON."""

    device: str
    quota_bytes: int
    max_frame: int
    cache_grace: float
    cache_bytes: int
    graph_compiler: str = GraphCompiler.LOOP.value
    #: The host's blob store: ``/proc/self/fd/N``, a directory descriptor the worker
    #: inherits (its sandbox hides the data directory the store lives in).
    blob_dir: str | None = None
    blob_cap: int = DEFAULT_BLOB_CAP
    #: How tenants share the device (``scheduler.Sharing``): only exclusive turns are asked
    #: of the supervisor.
    sharing: str = DEFAULT_SHARING.value
    #: Whether the host bounds the memory its workers' sessions hold on the device
    #: together (``--device-memory``): only then does a worker ask the supervisor for room.
    memory_bounded: bool = False
    peer_links: bool = True

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        return cls(**json.loads(text))

    @classmethod
    def of(
        cls, config: ExecutorConfig, *, device: str, blob_dir: str | None, sharing: Sharing
    ) -> WorkerSpec:
        """The spec for workers of a host whose executors are configured by ``config``."""
        return cls(
            device=device,
            graph_compiler=config.graph_compiler.value,
            blob_dir=blob_dir,
            sharing=sharing.value,
            memory_bounded=config.device_bytes is not None,
            **{name: getattr(config, name) for name in _AS_CONFIGURED},
        )

    def executor_config(self) -> ExecutorConfig:
        return ExecutorConfig(
            device=self.device,
            graph_compiler=GraphCompiler(self.graph_compiler),
            blob_dir=self.blob_dir,
            **{name: getattr(self, name) for name in _AS_CONFIGURED},
        )


class SupervisorTurns:
    """``DeviceScheduler``'s interface, with the device turns granted by the supervisor.

    A granted turn is kept across batches until the supervisor asks for it back
    (``yield``: another worker waits), so a tenant alone on the device pays no message
    per batch. Under contention the turn passes at the end of the batch, or sooner, at the
    next op, when the supervisor sets this worker's ``flag`` (a better-ranked tenant
    waits, or an equal one and the turn had its quantum): the executor reads it between
    ops (``preempted``), without a message. This worker's own connections (a resume
    taking over) queue on a local scheduler first.

    With ``exclusive`` False (a CPU, shared concurrently) the supervisor is never asked:
    only the local scheduler orders this worker's connections.
    """

    def __init__(
        self, link: WorkerLink, flag: TurnFlag | None = None, *, exclusive: bool = True
    ) -> None:
        self._link = link
        self._flag = flag
        self._exclusive = exclusive
        self._local = DeviceScheduler()
        self._holding = False
        self._busy = False
        self._yield_asked = False
        self._waiting: dict[int, trio.Event] = {}
        self._next = 0

    async def acquire(self, rank: tuple) -> None:
        """Wait for the device. ``rank`` orders this worker's own connections only: the
        supervisor ranks a worker by its session's lease, not by what the worker claims."""
        await self._local.acquire(rank)
        if not self._exclusive:
            return
        try:
            if self._holding:
                self._busy = True
            else:
                await self._ask()  # granted() marks the turn held and in use
        except BaseException:
            self._local.release()
            raise

    async def _ask(self) -> None:
        self._next += 1
        number, granted = self._next, trio.Event()
        self._waiting[number] = granted
        await self._link.send(["acquire", number])
        try:
            await granted.wait()
        except BaseException:
            # Cancelled: the grant may be on its way; the supervisor sorts that out.
            self._waiting.pop(number, None)
            self._link.send_nowait(["cancel", number])
            raise

    def granted(self, number: int) -> None:
        """The supervisor's grant for turn ``number`` arrived.

        The turn is held and in use from this moment: a ``yield`` read right behind the
        grant, before the waiting batch has even resumed, must wait for that batch.
        """
        event = self._waiting.pop(number, None)
        if event is not None:
            self._holding = self._busy = True
            event.set()

    def yield_asked(self) -> None:
        """Another worker waits: hand the device back now, or after the running batch."""
        if self._holding and not self._busy:
            self._give_back()
        elif self._holding:
            self._yield_asked = True

    @property
    def preemptive(self) -> bool:
        """Whether the executor should ask ``preempted`` between a batch's ops."""
        return self._exclusive and self._flag is not None

    def preempted(self) -> bool:
        """Whether the supervisor wants the turn back before the next op (from any thread)."""
        return self._flag is not None and self._flag.is_set()

    def release(self) -> None:
        """This batch (or its part) is done; the turn stays unless the supervisor asked
        for it (its ``yield`` may still be on its way when the flag says so)."""
        self._busy = False
        if self._holding and (self._yield_asked or self.preempted()):
            self._give_back()
        self._local.release()

    def _give_back(self) -> None:
        self._holding = self._yield_asked = False
        self._link.send_nowait(["release"])


class _Carried:
    """A session's channel as the worker carries it: it counts the frame bytes (the
    supervisor meters the lease with them) and tells the supervisor the session token
    its welcome names (a resume on a new connection is then routed here)."""

    def __init__(self, inner: AsyncFrameChannel, number: int, link: WorkerLink) -> None:
        self._inner = inner
        self._link = link
        self.number = number
        self.max_frame = inner.max_frame
        self.peer_public_key = getattr(inner, "peer_public_key", None)
        self.unreported = 0
        self.unreported_peer = 0
        self._welcomed = False

    async def send_frame(self, parts) -> None:
        await self._inner.send_frame(parts)
        self.unreported += FRAME_PREFIX + nbytes(parts)
        if not self._welcomed:
            token = _welcome_token(parts)
            if token is not None:
                self._welcomed = True
                await self._link.send(["token", token])

    async def receive_frame(self) -> bytearray:
        frame = await self._inner.receive_frame()
        self.unreported += FRAME_PREFIX + len(frame)
        return frame

    async def aclose(self) -> None:
        await self._inner.aclose()

    def count_peer_bytes(self, n: int) -> None:
        """The executor's report of bytes the session's collectives carried."""
        self.unreported_peer += n

    def report(self) -> None:
        """Tell the supervisor the bytes carried since the last report."""
        if self.unreported or self.unreported_peer:
            message = ["traffic", self.number, self.unreported, self.unreported_peer]
            self._link.send_nowait(message)
            self.unreported = self.unreported_peer = 0


class Worker:
    """Serves the sessions the supervisor hands over, until it holds none."""

    def __init__(self, link: WorkerLink, spec: WorkerSpec, flag: TurnFlag | None = None) -> None:
        self.link = link
        exclusive = Sharing(spec.sharing) is Sharing.EXCLUSIVE
        self.turns = SupervisorTurns(link, flag, exclusive=exclusive)
        self.served = 0
        self.poisoned = False
        self.executor = Executor(
            spec.executor_config(),
            scheduler=self.turns,
            welcome_extra={"worker_pid": os.getpid()},
            context_lost=self._context_lost,
            # Without a bound there is never anyone to evict: no round trip to ask.
            ask_room=self._ask_room if spec.memory_bounded else None,
        )
        self._rooms: dict[int, trio.Event] = {}  # room requests awaiting an answer
        self._room_numbers = itertools.count(1)
        self._carried: dict[int, _Carried] = {}
        self._secure: SecureServer | None = None
        self._channels: dict[int, SecureServerChannel] = {}  # secure sessions, by number
        self._numbers: dict[bytes, int] = {}  # by session id
        self._owners: list[bytes | None] = []  # of the sessions whose stats are reported

    async def run(self) -> int:
        """Serve until done; return the process's exit status."""
        try:
            await self.link.send(["ready", os.getpid()])
        except LinkClosedError:
            return 0  # the supervisor stopped while this worker started
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.executor.expire_parked_forever)
            nursery.start_soon(self._exit_when_done, nursery.cancel_scope)
            nursery.start_soon(self._report_forever)
            try:
                await self._read_link(nursery)
            except LinkClosedError:
                log.info("worker %d: the supervisor is gone; exiting", os.getpid())
            nursery.cancel_scope.cancel()
        return EXIT_POISONED if self.poisoned else 0

    async def _read_link(self, nursery: trio.Nursery) -> None:
        while True:
            message, fd = await self.link.receive()
            kind, n = message[0], len(message)
            if kind == "grant" and n == 2:
                self.turns.granted(message[1])
            elif kind == "yield" and n == 1:
                self.turns.yield_asked()
            elif kind == "session" and fd is not None and n == 5:
                self._start(nursery, _stream(fd), *message[1:])
            elif kind == "resume" and fd is not None and n == 4:
                if message[1] in self._channels:
                    nursery.start_soon(self._secure.take_resume, _stream(fd), *message[2:])
                else:  # it ended here as the resume came: the consumer will retry, and learn why
                    os.close(fd)
            elif kind == "close" and n == 3:
                if message[1] in self._channels:
                    nursery.start_soon(self._channels[message[1]].aclose, message[2])
            elif kind == "evict" and n == 3 and fd is None and _evict_message(message):
                nursery.start_soon(self._evict, Tier(message[1]), message[2])
            elif kind == "roomed" and n == 2 and fd is None:
                answered = self._rooms.get(message[1])
                if answered is not None:
                    answered.set()
            else:
                if fd is not None:
                    os.close(fd)
                raise LinkClosedError(f"unexpected message from the supervisor: {kind!r}")

    def _start(
        self, nursery: trio.Nursery, stream, number: int, options: dict, secure, buffered: bytes
    ) -> None:
        """Serve a session the supervisor handed over: plain frames, or a secure session
        continued from its keys and counters."""
        if secure is None:
            max_frame = self.executor.config.max_frame
            channel = TrioFrameChannel(stream, max_frame=max_frame, buffered=buffered)
            owner = options.get("owner")
            channel.peer_public_key = bytes.fromhex(owner) if owner else None  # type: ignore[attr-defined]
            nursery.start_soon(self._serve_plain, number, channel, options)
            return
        if self._secure is None:
            self._secure = SecureServer.for_adopted(nursery, secure["settings"], self._ended)
        handler = partial(self._serve, number, options=options)
        self._channels[number] = self._secure.adopt(Handover(stream, buffered, secure), handler)
        self._numbers[secure["session_id"]] = number

    async def _serve_plain(self, number: int, channel: TrioFrameChannel, options: dict) -> None:
        try:
            await self._serve(number, channel, options=options)
        finally:
            self._report_end(number, "the connection closed")

    def _ended(self, session_id: bytes, reason: str) -> None:
        """A secure session ended here (the ``SecureServer``'s ``on_end``)."""
        number = self._numbers.pop(session_id, None)
        if number is not None:
            self._channels.pop(number, None)
            self._report_end(number, reason)

    def _report_end(self, number: int, reason: str) -> None:
        carried = self._carried.pop(number, None)
        try:
            if carried is not None:
                carried.report()
            self.link.send_nowait(["ended", number, reason])
        except LinkClosedError:
            pass  # the supervisor is gone; this worker is about to exit

    async def _serve(self, number: int, channel: AsyncFrameChannel, *, options: dict) -> None:
        carried = self._carried[number] = _Carried(channel, number, self.link)
        quota = options.get("quota")
        _cap_device_memory(self.executor.ctx.device, quota or self.executor.config.quota_bytes)
        seconds = options.get("seconds")
        until = math.inf if seconds is None else trio.current_time() + seconds
        rank = tuple(options.get("rank") or (0, 0))
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._report_stats, carried.peer_public_key)
                await self.executor.run_session(
                    carried,
                    quota_bytes=quota,
                    rank=rank,
                    until=until,
                    hold_bytes=options.get("hold"),
                )
                nursery.cancel_scope.cancel()
        except Exception:  # closing a session on a broken context can fail too
            log.exception("worker %d: the session's task failed", os.getpid())
        finally:
            self.served += 1
            self._context_lost()

    async def _report_stats(self, owner: bytes | None) -> None:
        self._owners.append(owner)
        try:
            while True:
                await trio.sleep(STATS_EVERY_S)
                await self._send_stats(owner)
        finally:
            self._owners.remove(owner)

    async def _send_stats(self, owner: bytes | None) -> None:
        stats = self.executor.session_stats(owner)
        if stats is not None:
            waits = [stats.wait_p50_ms, stats.wait_p99_ms]
            where = [stats.tier, stats.bytes_on_device, stats.held_bytes]
            await self.link.send(["stats", stats.ops, stats.bytes_in_use, *waits, *where])

    async def _ask_room(self, nbytes: int) -> None:
        """Before a session comes back from eviction, or after a batch left it holding
        more than it last asked room for: the supervisor makes its room."""
        number = next(self._room_numbers)
        answered = self._rooms[number] = trio.Event()
        try:
            await self.link.send(["room", number, nbytes])
            # The supervisor answers within its own wait; a lost answer must not hang.
            with trio.move_on_after(2 * ROOM_WAIT_S):
                await answered.wait()
        finally:
            del self._rooms[number]

    async def _evict(self, tier: Tier, need: int) -> None:
        """The supervisor's ``evict``: the coldest ``need`` bytes off the device to
        ``tier``, then say so at once."""
        await self.executor.evict_all(tier, need)
        try:
            for owner in list(self._owners):
                await self._send_stats(owner)
        except LinkClosedError:
            pass  # the supervisor is gone; the link's reader ends the worker

    async def _report_forever(self) -> None:
        """Report each session's traffic every ``STATS_EVERY_S``."""
        while True:
            await trio.sleep(STATS_EVERY_S)
            for carried in list(self._carried.values()):
                carried.report()

    def _context_lost(self) -> bool:
        self.poisoned = self.poisoned or _context_poisoned(self.executor.ctx.device)
        return self.poisoned

    async def _exit_when_done(self, scope: trio.CancelScope) -> None:
        while not (self.served and (self.executor.idle or self.poisoned)):
            await trio.sleep(IDLE_CHECK_S)
        scope.cancel()


def _stream(fd: int) -> trio.SocketStream:
    """The connection the supervisor passed as ``fd``."""
    return trio.SocketStream(trio.socket.from_stdlib_socket(socket.socket(fileno=fd)))


def _welcome_token(parts) -> str | None:
    """The session token of a ``welcome`` frame; None for any other frame."""
    # A frame opens with its header's u32 length, then the msgpack header.
    head = bytes(parts[0][4 : 4 + len(_WELCOME_START)]) if parts else b""
    if head != _WELCOME_START:
        return None
    header, _ = decode_frame(bytearray(b"".join(parts)))
    info = header[2] if len(header) == 3 else None
    token = info.get("token") if isinstance(info, dict) else None
    return token if isinstance(token, str) else None


def _cap_device_memory(device: torch.device, quota: int) -> None:
    """The CUDA allocator's own cap: a second wall a little above the session quota.

    The quota counts the session's tensors and fails with a clear error naming the op;
    the allocator also holds cached and fragmented blocks, so its cap leaves room for
    them and only stops what the quota's accounting would miss.
    """
    if device.type != "cuda":
        return
    total = torch.cuda.get_device_properties(device).total_memory
    cap = quota + max(quota // 8, ALLOCATOR_HEADROOM)
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)


def _context_poisoned(device: torch.device) -> bool:
    """True when the device context can no longer run anything (a device-side assert)."""
    if device.type != "cuda":
        return False
    try:
        torch.cuda.synchronize(device)
        torch.ones(1, device=device).add_(1).item()
    except RuntimeError:  # torch.AcceleratorError is a RuntimeError
        return True
    return False


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent (the supervisor) exits."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _evict_message(message: list) -> bool:
    """Whether ``["evict", tier, nbytes]`` names a tier off the device and a byte count."""
    _, tier, need = message
    return tier in (Tier.RAM.value, Tier.DISK.value) and type(need) is int and need > 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cumulus-worker", description=__doc__.splitlines()[0])
    parser.add_argument("--link-fd", type=int, required=True, help="the supervisor link's fd")
    parser.add_argument("--spec", required=True, help="the WorkerSpec, as JSON")
    parser.add_argument("--parent", type=int, required=True, help="the supervisor's pid")
    parser.add_argument("--turn-fd", type=int, help="the fd of this worker's TurnFlag")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    _die_with_parent()
    if os.getppid() != args.parent:
        return 1  # the supervisor died before the backstop was armed
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    flag = None if args.turn_fd is None else TurnFlag(args.turn_fd)
    worker = Worker(WorkerLink.from_fd(args.link_fd), WorkerSpec.from_json(args.spec), flag)
    return trio.run(worker.run)


if __name__ == "__main__":
    sys.exit(main())
