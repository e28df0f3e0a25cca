"""How long a session waited for the device: its queueing delay over the last minute. Sans-IO.

A tenant of a shared device pays for its place in the queue (``scheduler.lease_rank``);
this is what that place bought. Every device turn a session asks for adds one sample, the
seconds between asking and getting it (0 when the device was free). ``WaitWindow`` keeps
the samples of the last ``window_s`` seconds, at most ``max_samples`` of them (the newest),
and gives their median and 99th percentile. Times are passed in.

On a device shared concurrently (a CPU: ``scheduler.Sharing``) tenants take no turns, so
there is nothing to wait for and nothing is sampled: contention shows there as slower
ops, not as waits.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

__all__ = ["WINDOW_S", "WaitPercentiles", "WaitWindow"]

#: The window status reports waits over.
WINDOW_S = 60.0
#: The most samples kept: a session takes a turn per batch, thousands a minute at most.
MAX_SAMPLES = 8192


@dataclass(frozen=True)
class WaitPercentiles:
    """A session's waits for the device over the window, in milliseconds."""

    p50_ms: float
    p99_ms: float
    samples: int


class WaitWindow:
    """The waits of the last ``window_s`` seconds."""

    def __init__(self, *, window_s: float = WINDOW_S, max_samples: int = MAX_SAMPLES) -> None:
        self._window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)

    def add(self, waited_s: float, *, now: float) -> None:
        """One turn, asked for ``waited_s`` seconds before it came at ``now``."""
        self._samples.append((now, max(0.0, waited_s)))

    def percentiles(self, *, now: float) -> WaitPercentiles | None:
        """The median and 99th percentile of the waits in the window; None without any."""
        while self._samples and self._samples[0][0] < now - self._window_s:
            self._samples.popleft()
        if not self._samples:
            return None
        waits = sorted(waited for _, waited in self._samples)
        return WaitPercentiles(
            p50_ms=_rank(waits, 0.50) * 1e3,
            p99_ms=_rank(waits, 0.99) * 1e3,
            samples=len(waits),
        )


def _rank(ordered: list[float], fraction: float) -> float:
    """The nearest-rank percentile: the smallest value at least ``fraction`` of all are at
    or below (a wait that really happened, never an interpolation)."""
    return ordered[max(0, math.ceil(len(ordered) * fraction) - 1)]
