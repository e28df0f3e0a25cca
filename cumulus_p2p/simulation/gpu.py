"""A simulated GPU whose tenants take turns through the executor's real ``DeviceQueue``.

Jobs compute in bursts (a batch of steps) and idle in between (data loading, the
client's own work, waiting on a user). A burst holds the device; bursts of tenants
that collide wait in the queue's rank order, exactly as ``DeviceScheduler`` orders
them on a real executor. Only the clock is simulated.

A burst here is seconds long, a real batch milliseconds. The fraction of time a tenant
waits depends on how often bursts collide, not on their length, so slowdowns carry
over; the length only sets how many events a run costs.

An overcommitted GPU (``cumulus-node --provide --overcommit``) sells more shares than its
memory holds. Its tenants' memory is then *resident* or paged out: a burst whose
tenant is paged out first makes room with the executor's real policy
(``host.eviction.choose``), then pays the copies, out and in, on the device. That
transfer is the overcommit's cost. Unlike waiting, it does depend on burst length: a
tenant is paged in at most once per burst, so the seconds-long bursts here make it
rarer than real millisecond batches separated by long idle gaps would (see the
simulations README).
"""

from __future__ import annotations

from collections.abc import Hashable

import simpy

from ..host.eviction import Candidate, choose
from ..host.scheduler import DeviceQueue, on_demand


class DeviceGone(Exception):
    """The GPU's host left while a job was using it."""


class SimGpu:
    """One GPU: a turn queue, the seconds it computed, and whether its host is still up."""

    def __init__(
        self,
        env: simpy.Environment,
        perf_units: int,
        *,
        memory_shares: int | None = None,
        page_s_per_share: float = 0.0,
    ) -> None:
        """``memory_shares``: the shares its memory holds (None: every tenant's, no
        paging); ``page_s_per_share``: seconds to copy one share's memory one way."""
        self.env = env
        self.perf_units = perf_units
        self.queue = DeviceQueue()
        self.busy_s = 0.0
        self.paging_s = 0.0
        self.page_ins = 0
        self.gone = False
        self.memory_shares = memory_shares
        self.page_s_per_share = page_s_per_share
        self._turns: dict[object, simpy.Event] = {}
        #: Tenants whose memory is on the device: (shares, rank, last burst's end).
        self._resident: dict[Hashable, tuple[int, tuple, float]] = {}
        self._seen: set[Hashable] = set()

    def compute(self, ticket: Hashable, rank: tuple, seconds: float, shares: int = 0):
        """Hold the device for ``seconds`` once ``ticket``'s turn comes, after paging in
        its ``shares`` of memory if need be (a generator).

        Raises:
            DeviceGone: the host left before or during the burst.
        """
        if self.gone:
            raise DeviceGone
        if not self.queue.request(ticket, rank):
            turn = self._turns[ticket] = self.env.event()
            yield turn
            if self.gone:
                raise DeviceGone
        paging = self._page_in(ticket, rank, shares)
        if paging:
            yield self.env.timeout(paging)
            self.paging_s += paging
        started = self.env.now
        try:
            yield self.env.timeout(seconds)
        finally:
            self.busy_s += self.env.now - started
            if ticket in self._resident:
                self._resident[ticket] = (shares, rank, self.env.now)
            if not self.gone:
                following = self.queue.release()
                if following is not None:
                    self._turns.pop(following).succeed()

    def forget(self, ticket: Hashable) -> None:
        """``ticket``'s lease ended: its memory is freed."""
        self._resident.pop(ticket, None)
        self._seen.discard(ticket)

    def _page_in(self, ticket: Hashable, rank: tuple, shares: int) -> float:
        """Make ``ticket`` resident; returns the seconds its copies take (0 if it was)."""
        if self.memory_shares is None or ticket in self._resident:
            return 0.0
        held = sum(entry[0] for entry in self._resident.values())
        candidates = [
            Candidate(key, held_rank, on_demand(held_rank), held_shares, last)
            for key, (held_shares, held_rank, last) in self._resident.items()
        ]
        need = held + shares - self.memory_shares
        out = choose(candidates, need, now=self.env.now)
        moved = sum(self._resident.pop(key)[0] for key in out)
        self._resident[ticket] = (shares, rank, self.env.now)
        if ticket not in self._seen:  # its first burst: its memory was never elsewhere
            self._seen.add(ticket)
            return moved * self.page_s_per_share
        self.page_ins += 1
        return (moved + shares) * self.page_s_per_share

    def fail(self) -> None:
        """The host left: every waiting tenant learns it at once."""
        self.gone = True
        for turn in self._turns.values():
            turn.succeed()
        self._turns.clear()
