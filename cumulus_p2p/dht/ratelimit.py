"""Token buckets per key, with a penalty box, for the gossip gate. Sans-IO.

Theory of operation
-------------------
Each key (a forwarding peer, or an envelope's author) has a bucket of ``burst`` tokens
that refills at ``rate`` tokens a second; a message takes one. A key whose bucket is
empty when a message comes has gone past its rate: that message and every other one it
sends for the next ``penalty_s`` seconds are refused, and its bucket does not refill
meanwhile. An honest node never meets the limit (an announcing host sends a handful of
envelopes per heartbeat), so the penalty only ever lands on a flood.

The table of buckets is bounded: past ``max_keys`` the least recently seen key is
forgotten. A forgotten key starts again with a full bucket, so ``max_keys`` must be well
above the number of peers (or authors) active at once; a flood of fresh keys is bounded
by the limit on the peer that forwards it, not by this table.

Nothing here reads a clock: every call takes ``now``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

__all__ = ["RateLimit", "RateLimiter"]


@dataclass(frozen=True, slots=True)
class RateLimit:
    """A sustained rate, a burst and a penalty.

    Attributes:
        rate: Messages a second, sustained.
        burst: Messages at once (the bucket's size).
        penalty_s: How long a key that went past its rate is refused everything.
    """

    rate: float
    burst: float
    penalty_s: float = 10.0

    def __post_init__(self) -> None:
        if not (self.rate > 0 and self.burst >= 1 and self.penalty_s >= 0):
            raise ValueError("need rate > 0, burst >= 1 and penalty_s >= 0")


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: float
    blocked_until: float = 0.0


class RateLimiter:
    """Token buckets for many keys under one ``RateLimit``.

    Args:
        limit: The rate, burst and penalty every key gets.
        max_keys: Buckets kept; the least recently seen key is forgotten past it.
    """

    def __init__(self, limit: RateLimit, *, max_keys: int = 8192) -> None:
        self.limit = limit
        self._max_keys = max_keys
        self._buckets: OrderedDict[Hashable, _Bucket] = OrderedDict()
        self.refused = 0
        self.penalties = 0

    def allow(self, key: Hashable, *, now: float) -> bool:
        """Take one token for ``key`` at ``now``; False (and a penalty) if none is left."""
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(self.limit.burst, now)
            while len(self._buckets) > self._max_keys:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
        if now < bucket.blocked_until:
            self.refused += 1
            return False
        elapsed = max(0.0, now - max(bucket.at, bucket.blocked_until))
        bucket.tokens = min(self.limit.burst, bucket.tokens + elapsed * self.limit.rate)
        bucket.at = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return True
        bucket.blocked_until = now + self.limit.penalty_s
        self.refused += 1
        self.penalties += 1
        return False

    def blocked(self, key: Hashable, *, now: float) -> bool:
        """Whether ``key`` is serving a penalty at ``now`` (changes nothing)."""
        bucket = self._buckets.get(key)
        return bucket is not None and now < bucket.blocked_until

    def __len__(self) -> int:
        return len(self._buckets)
