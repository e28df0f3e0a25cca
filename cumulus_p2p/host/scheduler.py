"""Who runs on a shared device, and for how long: tenants served by the priority they paid for.

Theory of operation
-------------------
A rank is a tuple compared in the usual way, smaller first; the provider builds it from
the lease (``lease_rank``): on-demand leases before interruptible ones, and within a class
the higher price first. A device is shared in one of two ways (``Sharing``):

- **Concurrently** (``DEFAULT_SHARING``, on a CPU and on a GPU alike): every tenant runs
  at once, each in its worker process, and rank sets each one's *share* of the CPU: the
  supervisor gives an interruptible tenant's threads the OS's lowest scheduling weight
  (``cpu_nice``) and its idle policy (``cpu_idle``), so the kernel runs an on-demand
  tenant's op the moment it is ready, and the interruptible one on every cycle left over.
  On a GPU the worker processes' CUDA contexts are time-sliced by the driver, so a
  bystander's small kernel runs within a slice of a hog's large one instead of after it;
  rank weighs only the CPU threads that launch kernels (issue 35's contention_bench on an
  H200, beside an 8192x8192 hog: p99 2.6-3.1 ms concurrently against 2.2 ms alone, and
  24 ms in exclusive turns, with the hog keeping 99% of its throughput either way).
  Exclusive turns lose on both: a turn cannot end inside an op, and a GPU op that
  syncs holds its turn until its kernels finish, so a bystander beside a hog waits out
  the hog's kernel (on a CPU: a 4000x4000 matmul, a second; p99 0.2 s beside a 2000x2000
  hog with turns, a few ms without).
- **In exclusive turns** (``Sharing.EXCLUSIVE``, which a supervisor may be configured to
  take; an in-process executor's sessions always do, sharing one thread): one tenant
  holds the device at a time. When several
  want it, it goes to the best rank first, and among equal ranks in arrival order. A
  turn ends early, *at the holder's next op* (the shell checks between ops, not between
  batches), when a better-ranked tenant arrives, or when an equal-ranked one waits and the
  holder has had its quantum (``DEFAULT_QUANTUM_S`` of device time since its grant). A
  worse-ranked waiter never cuts a turn short: it gets the device when the holder's batch
  ends, that is when the device would otherwise idle. Ranks are strict: an interruptible
  tenant that always finds on-demand work queued waits for as long as it does; that is
  what interruptible means. ``HANDBACK`` is that rule, as a table. What strict ranks
  buy over concurrency is throughput between two tenants that both keep a GPU busy, which
  time-slicing splits evenly whatever their ranks; that is not measured yet.

``DeviceQueue`` is the state machine for turns (no I/O, no clock: time is passed in);
``DeviceScheduler`` is its trio shell inside one executor, and the supervisor
(``supervisor.py``) is its shell across worker processes.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import time
from dataclasses import dataclass, field

import trio

__all__ = [
    "DEFAULT_QUANTUM_S",
    "DEFAULT_RANK",
    "DEFAULT_SHARING",
    "HANDBACK",
    "DeviceQueue",
    "DeviceScheduler",
    "Handback",
    "Sharing",
    "cpu_idle",
    "cpu_nice",
    "lease_rank",
    "on_demand",
]

#: The rank of a session nobody priced (an executor attached directly): on-demand, free.
DEFAULT_RANK: tuple = (0, 0)
#: Device time an exclusive turn lasts while an equal-ranked tenant waits. A hand-over
#: costs a message each way (about 50 µs on loopback) and no device sync, so 20 ms keeps
#: that under 1% while an equal tenant's op waits at most one quantum (and one op).
DEFAULT_QUANTUM_S = 0.02
#: The CPU scheduling weight (nice) of an interruptible tenant's worker: the lowest, so
#: it runs on what on-demand tenants leave idle (weight 15 against 1024 at nice 0).
INTERRUPTIBLE_NICE = 19


def lease_rank(on_demand: bool, price: int) -> tuple:
    """The rank of a session leased at ``price`` per share-hour: lower runs first."""
    return (0 if on_demand else 1, -price)


class Sharing(enum.Enum):
    """How tenants share one device."""

    #: All at once, rank as an OS scheduling weight of the tenants' threads.
    CONCURRENT = "concurrent"
    #: One at a time, in turns preempted at op boundaries.
    EXCLUSIVE = "exclusive"


#: How a supervisor's workers share a device unless configured otherwise: concurrently on a
#: CPU and on a GPU (measured; see the module's docstring).
DEFAULT_SHARING = Sharing.CONCURRENT


def cpu_nice(rank: tuple) -> int:
    """The nice value for a tenant of ``rank`` on a concurrently shared CPU.

    Only the class counts: a nice value is absolute, and an unprivileged supervisor can
    raise one but never lower it back, so prices within a class share equally here (they
    still order exclusive turns).
    """
    return INTERRUPTIBLE_NICE if cpu_idle(rank) else 0


def cpu_idle(rank: tuple) -> bool:
    """Whether a tenant of ``rank`` runs under the OS's idle policy (Linux's
    ``SCHED_IDLE``) on a concurrently shared CPU: the classes below on-demand. An idle
    thread is preempted the moment an on-demand thread wakes, where a thread at nice 19
    still holds its core until the kernel's wakeup granularity runs out."""
    return not on_demand(rank)


def on_demand(rank: tuple) -> bool:
    """Whether ``rank`` is an on-demand lease's (``lease_rank``), or nobody's price
    (an executor attached directly, ``DEFAULT_RANK``)."""
    return not rank or rank[0] == 0


class Handback(enum.Enum):
    """When the holder of an exclusive turn must hand it back."""

    KEEP = "keep it"
    AFTER_BATCH = "after its batch"
    AT_NEXT_OP = "at its next op"


class _Best(enum.Enum):
    """The best waiter's rank against the holder's."""

    NONE = "nobody waits"
    WORSE = "worse"
    EQUAL = "equal"
    BETTER = "better"


#: When the holder hands its turn back, by the best waiter and whether its quantum is spent.
HANDBACK: dict[tuple[_Best, bool], Handback] = {
    (_Best.NONE, False): Handback.KEEP,
    (_Best.NONE, True): Handback.KEEP,
    (_Best.WORSE, False): Handback.AFTER_BATCH,
    (_Best.WORSE, True): Handback.AFTER_BATCH,
    (_Best.EQUAL, False): Handback.AFTER_BATCH,
    (_Best.EQUAL, True): Handback.AT_NEXT_OP,
    (_Best.BETTER, False): Handback.AT_NEXT_OP,
    (_Best.BETTER, True): Handback.AT_NEXT_OP,
}


@dataclass(order=True)
class _Waiter:
    rank: tuple
    seq: int
    ticket: object = field(compare=False)


class DeviceQueue:
    """The rules of exclusive turns: one holder at a time, waiters served best rank first,
    and when the holder must hand back (``handback``).

    Tickets are any hashable objects the caller uses to tell waiters apart. ``now`` is
    the caller's clock in seconds (any monotonic clock, the same one throughout).
    """

    def __init__(self, *, quantum: float = DEFAULT_QUANTUM_S) -> None:
        self.quantum = quantum
        self.holder: object | None = None
        self.holder_rank: tuple | None = None
        #: When the holder's turn began.
        self.granted_at = 0.0
        self._waiting: list[_Waiter] = []
        self._withdrawn: set[object] = set()
        self._seq = itertools.count()

    def request(self, ticket: object, rank: tuple, *, now: float = 0.0) -> bool:
        """Ask for the device; True if ``ticket`` holds it now, else it waits its turn."""
        if self.holder is None and not self.waiting:
            self._hold(ticket, rank, now)
            return True
        heapq.heappush(self._waiting, _Waiter(rank, next(self._seq), ticket))
        return False

    def withdraw(self, ticket: object) -> None:
        """A waiter gave up (its session ended) before its turn came."""
        self._withdrawn.add(ticket)

    def release(self, *, now: float = 0.0) -> object | None:
        """The holder is done; return the ticket that holds the device now, if any."""
        self.holder = self.holder_rank = None
        self._drop_withdrawn()
        if not self._waiting:
            return None
        waiter = heapq.heappop(self._waiting)
        self._hold(waiter.ticket, waiter.rank, now)
        return waiter.ticket

    def handback(self, now: float) -> Handback:
        """When the holder must hand its turn back, as things stand at ``now``."""
        return HANDBACK[self._best(), now >= self.granted_at + self.quantum]

    def review_at(self) -> float | None:
        """When ``handback`` next changes with no new request: the holder's quantum ends
        while an equal-ranked tenant waits. None when only a request can change it."""
        if self._best() is _Best.EQUAL:
            return self.granted_at + self.quantum
        return None

    @property
    def waiting(self) -> int:
        """How many requests wait for their turn."""
        return len(self._waiting) - len(self._withdrawn)

    def _hold(self, ticket: object, rank: tuple, now: float) -> None:
        self.holder, self.holder_rank, self.granted_at = ticket, rank, now

    def _drop_withdrawn(self) -> None:
        while self._waiting and self._waiting[0].ticket in self._withdrawn:
            self._withdrawn.discard(heapq.heappop(self._waiting).ticket)

    def _best(self) -> _Best:
        # A read that changes nothing: an executor's op thread asks while trio's pushes.
        if self.holder is None:
            return _Best.NONE
        ranks = [w.rank for w in self._waiting if w.ticket not in self._withdrawn]
        if not ranks:
            return _Best.NONE
        best = min(ranks)
        if best < self.holder_rank:
            return _Best.BETTER
        return _Best.EQUAL if best == self.holder_rank else _Best.WORSE


class DeviceScheduler:
    """An async lock over ``DeviceQueue``: ``await acquire(rank)``, ``preempted()`` between
    ops (from the thread that runs them), then ``release()``."""

    #: The executor checks ``preempted`` between a batch's ops.
    preemptive = True

    def __init__(self, *, quantum: float = DEFAULT_QUANTUM_S) -> None:
        self.queue = DeviceQueue(quantum=quantum)

    async def acquire(self, rank: tuple) -> None:
        """Wait for the device. A free device is taken without yielding to trio."""
        event = trio.Event()
        if self.queue.request(event, rank, now=time.monotonic()):
            return
        try:
            await event.wait()
        except BaseException:
            if event.is_set():  # the turn came as we were cancelled: pass it on
                self.release()
            else:
                self.queue.withdraw(event)
            raise

    def preempted(self) -> bool:
        """Whether the holder must hand the device back before its next op."""
        return self.queue.handback(time.monotonic()) is Handback.AT_NEXT_OP

    def release(self) -> None:
        """Give the device to the next waiter in rank order."""
        following = self.queue.release(now=time.monotonic())
        if following is not None:
            following.set()  # type: ignore[attr-defined]
