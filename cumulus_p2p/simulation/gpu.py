"""A simulated GPU whose tenants take turns through the executor's real ``DeviceQueue``.

Jobs compute in bursts (a batch of steps) and idle in between (data loading, the
client's own work, waiting on a user). A burst holds the device; bursts of tenants
that collide wait in the queue's rank order, exactly as ``DeviceScheduler`` orders
them on a real executor. Only the clock is simulated.

A burst here is seconds long, a real batch milliseconds. The fraction of time a tenant
waits depends on how often bursts collide, not on their length, so slowdowns carry
over; the length only sets how many events a run costs.
"""

from __future__ import annotations

import simpy

from ..host.scheduler import DeviceQueue


class DeviceGone(Exception):
    """The GPU's host left while a job was using it."""


class SimGpu:
    """One GPU: a turn queue, the seconds it computed, and whether its host is still up."""

    def __init__(self, env: simpy.Environment, perf_units: int) -> None:
        self.env = env
        self.perf_units = perf_units
        self.queue = DeviceQueue()
        self.busy_s = 0.0
        self.gone = False
        self._turns: dict[object, simpy.Event] = {}

    def compute(self, ticket: object, rank: tuple, seconds: float):
        """Hold the device for ``seconds`` once ``ticket``'s turn comes (a generator).

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
        started = self.env.now
        try:
            yield self.env.timeout(seconds)
        finally:
            self.busy_s += self.env.now - started
            if not self.gone:
                following = self.queue.release()
                if following is not None:
                    self._turns.pop(following).succeed()

    def fail(self) -> None:
        """The host left: every waiting tenant learns it at once."""
        self.gone = True
        for turn in self._turns.values():
            turn.succeed()
        self._turns.clear()
