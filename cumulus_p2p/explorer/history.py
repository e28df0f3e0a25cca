"""Each host's score, price and free shares over time, sampled from a node's state. Sans-IO."""

from __future__ import annotations

from collections import deque

from .hostoffers import by_host

#: Samples kept per host: an hour of the node's state, rewritten once a second.
MAX_SAMPLES = 3600
#: Hosts followed at most; the ones seen least recently are dropped first.
MAX_HOSTS = 5000


class History:
    """Samples per host: ``(t, score, price, shares_free)``; price and shares are None
    while the host has no live offer."""

    def __init__(self, *, max_samples: int = MAX_SAMPLES, max_hosts: int = MAX_HOSTS) -> None:
        self._max_samples = max_samples
        self._max_hosts = max_hosts
        self._series: dict[str, deque] = {}

    def record(self, state: dict, now: float) -> None:
        """Add one sample for every host in ``state`` (its offers and its scores)."""
        offers = by_host(state.get("offers", []))
        scores = {row["host"]: row["mean"] for row in state.get("scores", [])}
        for peer in offers.keys() | scores.keys():
            offer = offers.get(peer)
            sample = (
                now,
                scores.get(peer),
                None if offer is None else offer["price"],
                None if offer is None else offer["shares"],
            )
            series = self._series.pop(peer, None) or deque(maxlen=self._max_samples)
            series.append(sample)
            self._series[peer] = series  # most recently seen last
        while len(self._series) > self._max_hosts:
            del self._series[next(iter(self._series))]

    def series(self, peer: str) -> list[dict]:
        """The host's samples, oldest first."""
        return [
            {"t": t, "score": score, "price": price, "shares_free": shares}
            for t, score, price, shares in self._series.get(peer, ())
        ]

    def uptime(self, peer: str) -> float | None:
        """The share of samples in which the host had a live offer (None: never seen)."""
        series = self._series.get(peer)
        if not series:
            return None
        return round(sum(s[2] is not None for s in series) / len(series), 4)
