"""Whose batch runs next on a shared device: tenants served by the priority they paid for.

Theory of operation
-------------------
Tenants of one GPU take turns: each batch of ops holds the device while it runs. When
several sessions have a batch ready, the device goes to the best *rank* first, and among
equal ranks in arrival order. A rank is a tuple compared in the usual way, smaller first;
the provider builds it from the lease (``lease_rank``): on-demand leases before
interruptible ones, and within a class the higher price first. This is how a consumer
trades price against latency: a cheap interruptible session waits whenever a dearer one
has work queued, and runs at full speed whenever the device is otherwise idle.

A batch is never interrupted once it runs, so an on-demand session waits at most for
the batch in progress (at most ``DEFAULT_BATCH_OPS`` ops). Ranks are strict: an
interruptible session that always finds on-demand work queued waits for as long as it
does; that is what interruptible means.

``DeviceQueue`` is the state machine (no I/O, no trio); ``DeviceScheduler`` is its trio
shell, used by the executor.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import trio

__all__ = ["DEFAULT_RANK", "DeviceQueue", "DeviceScheduler", "lease_rank"]

#: The rank of a session nobody priced (an executor attached directly): on-demand, free.
DEFAULT_RANK: tuple = (0, 0)


def lease_rank(on_demand: bool, price: int) -> tuple:
    """The rank of a session leased at ``price`` per share-hour: lower runs first."""
    return (0 if on_demand else 1, -price)


@dataclass(order=True)
class _Waiter:
    rank: tuple
    seq: int
    ticket: object = field(compare=False)


class DeviceQueue:
    """The turn-taking rules: one holder at a time, waiters served best rank first.

    Tickets are any hashable objects the caller uses to tell waiters apart.
    """

    def __init__(self) -> None:
        self.holder: object | None = None
        self._waiting: list[_Waiter] = []
        self._withdrawn: set[object] = set()
        self._seq = itertools.count()

    def request(self, ticket: object, rank: tuple) -> bool:
        """Ask for the device; True if ``ticket`` holds it now, else it waits its turn."""
        if self.holder is None and not self._waiting:
            self.holder = ticket
            return True
        heapq.heappush(self._waiting, _Waiter(rank, next(self._seq), ticket))
        return False

    def withdraw(self, ticket: object) -> None:
        """A waiter gave up (its session ended) before its turn came."""
        self._withdrawn.add(ticket)

    def release(self) -> object | None:
        """The holder is done; return the ticket that holds the device now, if any."""
        self.holder = None
        while self._waiting:
            ticket = heapq.heappop(self._waiting).ticket
            if ticket in self._withdrawn:
                self._withdrawn.discard(ticket)
                continue
            self.holder = ticket
            return ticket
        return None

    @property
    def waiting(self) -> int:
        """How many requests wait for their turn."""
        return len(self._waiting) - len(self._withdrawn)


class DeviceScheduler:
    """An async lock over ``DeviceQueue``: ``await acquire(rank)``, then ``release()``."""

    def __init__(self) -> None:
        self.queue = DeviceQueue()

    async def acquire(self, rank: tuple) -> None:
        """Wait for the device. A free device is taken without yielding to trio."""
        event = trio.Event()
        if self.queue.request(event, rank):
            return
        try:
            await event.wait()
        except BaseException:
            if event.is_set():  # the turn came as we were cancelled: pass it on
                self.release()
            else:
                self.queue.withdraw(event)
            raise

    def release(self) -> None:
        """Give the device to the next waiter in rank order."""
        following = self.queue.release()
        if following is not None:
            following.set()  # type: ignore[attr-defined]
