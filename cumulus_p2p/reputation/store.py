"""The local evidence store: deduplicated, bounded, expiring. Sans-IO.

Theory of operation
-------------------
The store holds checked ``Finding`` objects keyed by evidence id, so the same fact
delivered twice (gossip echoes, a report re-signed by another relayer) is counted once.
A service record is the one fact that grows: a newer report of the same lease with
more receipted volume supersedes the older one; a smaller or equal one is a duplicate.

Memory is bounded three ways. ``max_per_reporter`` caps what one identity can make us
hold, ``max_per_host`` caps what is held about one host, and ``max_records`` caps the
total; when the total is full the oldest finding goes first (decay has made it count
least). The per-credited-peer cap uses the peer whose credibility weighs a finding,
so a host publishing its own service records spends its consumers' quota, not a
separate one. ``expire(now)`` drops findings older than ``max_age_s``: by then decay has
made them negligible.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Iterator
from dataclasses import dataclass

from .evidence import EvidenceKind, Finding

__all__ = ["AddStatus", "EvidenceStore", "StoreStatistics"]


class AddStatus(enum.Enum):
    """What ``EvidenceStore.add`` did."""

    ADDED = "added"
    SUPERSEDED = "superseded an older version"
    DUPLICATE = "duplicate"
    TOO_OLD = "older than the store keeps"
    QUOTA = "the credited peer or the host is over its quota"


@dataclass(frozen=True, slots=True)
class StoreStatistics:
    """A snapshot of the store's size."""

    findings: int
    hosts: int
    credited_peers: int


class EvidenceStore:
    """Findings by evidence id, with per-peer quotas, a global cap and age expiry.

    Args:
        max_records: Most findings held in all.
        max_per_reporter: Most findings credited to one peer.
        max_per_host: Most findings about one host.
        max_age_s: Findings older than this are dropped by ``expire`` and refused by
            ``add``.
    """

    def __init__(
        self,
        *,
        max_records: int = 100_000,
        max_per_reporter: int = 2_000,
        max_per_host: int = 10_000,
        max_age_s: float = 180 * 86_400.0,
    ) -> None:
        self._max = max_records
        self._per_reporter = max_per_reporter
        self._per_host = max_per_host
        self._max_age = max_age_s
        self._by_id: dict[bytes, Finding] = {}
        self._by_credited: dict[str, int] = {}
        self._by_host: dict[str, int] = {}
        # (at, id) min-heap; entries whose finding changed or left are skipped on pop.
        self._age_heap: list[tuple[float, bytes]] = []

    def add(self, finding: Finding, *, now: float) -> AddStatus:
        """Hold ``finding`` unless it is a duplicate, too old, or over a quota.

        Args:
            finding: A checked finding (from ``Report.check``).
            now: The current Unix time.

        Returns:
            What happened; only ``ADDED`` and ``SUPERSEDED`` change the store.
        """
        status = self.would_add(finding, now=now)
        if status is AddStatus.SUPERSEDED:
            self._replace(self._by_id[finding.evidence_id], finding)
        elif status is AddStatus.ADDED:
            while len(self._by_id) >= self._max:
                self._evict_oldest()
            self._insert(finding)
        return status

    def would_add(self, finding: Finding, *, now: float) -> AddStatus:
        """Return what ``add`` would do, without changing anything."""
        if finding.at < now - self._max_age:
            return AddStatus.TOO_OLD
        held = self._by_id.get(finding.evidence_id)
        if held is not None:
            if finding.kind is EvidenceKind.SERVICE and finding.served > held.served:
                return AddStatus.SUPERSEDED
            return AddStatus.DUPLICATE
        if (
            self._by_credited.get(finding.credited, 0) >= self._per_reporter
            or self._by_host.get(finding.host, 0) >= self._per_host
        ):
            return AddStatus.QUOTA
        return AddStatus.ADDED

    def expire(self, now: float) -> int:
        """Drop findings older than ``max_age_s``.

        Returns:
            How many were dropped.
        """
        dropped = 0
        cutoff = now - self._max_age
        while self._age_heap and self._age_heap[0][0] < cutoff:
            if self._pop_oldest():
                dropped += 1
        return dropped

    def findings(self) -> Iterator[Finding]:
        """Iterate over every held finding."""
        return iter(list(self._by_id.values()))

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, evidence_id: object) -> bool:
        return evidence_id in self._by_id

    def statistics(self) -> StoreStatistics:
        """Return how much is held."""
        return StoreStatistics(len(self._by_id), len(self._by_host), len(self._by_credited))

    def _insert(self, finding: Finding) -> None:
        self._by_id[finding.evidence_id] = finding
        _bump(self._by_credited, finding.credited, 1)
        _bump(self._by_host, finding.host, 1)
        heapq.heappush(self._age_heap, (finding.at, finding.evidence_id))

    def _replace(self, held: Finding, finding: Finding) -> None:
        self._remove(held)
        self._insert(finding)

    def _remove(self, finding: Finding) -> None:
        del self._by_id[finding.evidence_id]
        _bump(self._by_credited, finding.credited, -1)
        _bump(self._by_host, finding.host, -1)

    def _evict_oldest(self) -> None:
        while self._age_heap and not self._pop_oldest():
            pass

    def _pop_oldest(self) -> bool:
        at, evidence_id = heapq.heappop(self._age_heap)
        held = self._by_id.get(evidence_id)
        if held is None or held.at != at:
            return False  # stale heap entry: already removed or superseded
        self._remove(held)
        return True


def _bump(counts: dict[str, int], key: str, delta: int) -> None:
    value = counts.get(key, 0) + delta
    if value:
        counts[key] = value
    else:
        counts.pop(key, None)
