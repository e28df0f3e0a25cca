"""The executor's host-side session cache: sessions whose consumer vanished, kept a while.

Theory of operation
-------------------
When a connection drops without ``bye`` the consumer probably lost the network, not
interest: it will dial back and present the session token it got in ``welcome``. Rather
than tearing the session down, the executor *parks* it here (its tensors moved to host
memory when they lived on a GPU) and hands it back on ``resume``, so the consumer carries
on without uploading anything.

Two bounds keep parked state from crowding out live tenants: a grace period, after which
an entry is dropped, and a byte budget of host memory, within which the oldest entries are
dropped first to make room. A session bigger than the whole budget is not kept at all.
Where the host has a disk tier, the oldest entries need not be dropped: the caller moves
them to disk first (``crowding`` names them, ``demoted`` records that they hold no host
memory any more), and they stay resumable for the rest of their grace. The newest parked
session is the likeliest to be resumed soon, so it is the one kept in memory.

This module is sans-IO: it never reads the clock (callers pass ``now``) and never frees
anything itself. It returns the values it drops, and the caller releases them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class CacheStatistics:
    """What the cache holds right now."""

    entries: int
    bytes: int
    max_bytes: int
    grace: float


@dataclass
class _Entry(Generic[T]):
    value: T
    nbytes: int
    deadline: float
    owner: object


class HostCache(Generic[T]):
    """Parked sessions by token, bounded in time (``grace``) and size (``max_bytes``)."""

    def __init__(self, *, max_bytes: int, grace: float) -> None:
        if max_bytes < 0 or grace < 0:
            raise ValueError("max_bytes and grace must not be negative")
        self.max_bytes = max_bytes
        self.grace = grace
        self._entries: dict[str, _Entry[T]] = {}  # insertion order is parking order
        self._bytes = 0

    def park(
        self, token: str, value: T, nbytes: int, *, now: float, owner: object = None
    ) -> list[T]:
        """Keep ``value`` under ``token`` until ``now + grace``.

        ``owner`` (the consumer's key on an authenticated channel) must match on ``take``.

        Returns:
            The values dropped to stay within bounds: older entries evicted to make room,
            or ``value`` itself when caching is off or it alone exceeds the budget.
        """
        dropped = self.discard(token)
        if self.grace <= 0 or nbytes > self.max_bytes:
            return [*dropped, value]
        while self._entries and self._bytes + nbytes > self.max_bytes:
            oldest = next(iter(self._entries))
            dropped.extend(self.discard(oldest))
        self._entries[token] = _Entry(value, nbytes, now + self.grace, owner)
        self._bytes += nbytes
        return dropped

    def crowding(self, nbytes: int) -> list[tuple[str, T]]:
        """The entries, oldest first, whose host memory must go for ``nbytes`` more to fit
        the budget (entries holding none are passed by); none when it fits already, or
        when ``nbytes`` alone is past the budget."""
        excess = self._bytes + nbytes - self.max_bytes
        if excess <= 0 or nbytes > self.max_bytes:
            return []
        crowding = []
        for token, entry in self._entries.items():
            if excess <= 0:
                break
            if entry.nbytes:
                crowding.append((token, entry.value))
                excess -= entry.nbytes
        return crowding

    def demoted(self, token: str, value: T) -> None:
        """``value``, parked under ``token``, holds no host memory any more (it went to
        disk). Nothing changes if it was taken meanwhile."""
        entry = self._entries.get(token)
        if entry is not None and entry.value is value:
            self._bytes -= entry.nbytes
            entry.nbytes = 0

    def take(self, token: str, *, now: float, owner: object = None) -> T | None:
        """Remove and return the value parked under ``token``; None if absent or expired.

        An expired entry found here stays for ``expire`` to return, so its value is
        released in one place.
        """
        entry = self._entries.get(token)
        if entry is None or entry.deadline <= now or entry.owner != owner:
            return None
        del self._entries[token]
        self._bytes -= entry.nbytes
        return entry.value

    def discard(self, token: str) -> list[T]:
        """Drop ``token``'s entry if there is one; return its value to release."""
        entry = self._entries.pop(token, None)
        if entry is None:
            return []
        self._bytes -= entry.nbytes
        return [entry.value]

    def expire(self, *, now: float) -> list[T]:
        """Drop every entry whose grace period has ended; return their values to release."""
        stale = [token for token, entry in self._entries.items() if entry.deadline <= now]
        return [value for token in stale for value in self.discard(token)]

    def __contains__(self, token: str) -> bool:
        return token in self._entries

    def statistics(self) -> CacheStatistics:
        return CacheStatistics(len(self._entries), self._bytes, self.max_bytes, self.grace)
