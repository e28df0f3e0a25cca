"""Jobs of N GPUs: which offers one bid for N devices leases (sans-IO).

Theory of operation
-------------------
A job of N GPUs (``Bid.gpus``) leases N devices at once, one lease per device: a lease
takes its shares from one offer, and one offer is one device. Its ranks exchange
gradients or activations every step, so where the devices are weighs more than a few
percent of price. Devices on one rig talk over its own bus; devices on hosts far apart
pay the link between them on every collective, and the slowest pair sets the pace.

So ``plan_gang`` prefers, in this order:

1. **Hosts close to one another**: the smallest diameter, the longest round trip between
   two of the gang's hosts. A rig that has N matching devices free has none (0 ms) and
   takes the whole job.
2. **Fewer hosts**, among gangs as close.
3. **The lowest summed effective price** (``matcher.rank_offers``: price, reliability
   and latency to the consumer already folded in).

The search is greedy and small: from each host as a seed, add the host nearest to those
already chosen (its farthest round trip to them), taking its cheapest devices, until N
are chosen; keep the best gang of all seeds. With ``H`` hosts among the ranked offers
that is ``O(H^3)`` round-trip lookups, a few thousand for the tens of hosts a bid ranks.
A greedy gang is not always the closest possible (that is a minimum-diameter
selection, hard in general), but every seed is tried and a rig that fits always wins.

Round trips between hosts come from the caller (measured, or estimated from the
consumer's own round trips to each: ``rtt_via_consumer``); a pair with no figure counts
as ``unknown_rtt_ms``, farther than any measured one on the same continent.

Sans-IO: ranked offers and round trips in, a plan out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .matcher import RankedOffer
from .messages import MAX_GPUS

#: Round trip assumed between two hosts that no one measured, milliseconds.
UNKNOWN_RTT_MS = 150.0

RoundTrip = Callable[[str, str], float | None]


@dataclass(frozen=True, slots=True)
class Gang:
    """The offers one job of N GPUs leases, one device each.

    Attributes:
        members: The N offers, grouped by host in the order the hosts were chosen,
            cheapest first within a host. Rank ``i`` of the job runs on ``members[i]``:
            ranks on one host are neighbours, as ``torchrun`` numbers them.
        hosts: The hosts, in the order they were chosen.
        diameter_ms: The longest round trip between two of its hosts (0 on one host).
        price: The members' effective prices summed.
    """

    members: tuple[RankedOffer, ...]
    hosts: tuple[str, ...]
    diameter_ms: float
    price: float

    def preference(self) -> tuple:
        """Lower is better: closer, then fewer hosts, then cheaper, then a stable tie."""
        ids = tuple((m.offer.host, m.offer.offer_id) for m in self.members)
        return (self.diameter_ms, len(self.hosts), self.price, ids)


def plan_gang(
    ranked: Sequence[RankedOffer],
    gpus: int,
    *,
    rtt_ms: RoundTrip | None = None,
    unknown_rtt_ms: float = UNKNOWN_RTT_MS,
) -> Gang | None:
    """The gang of ``gpus`` devices to lease among ``ranked`` (each a device that meets
    the bid), or None when they are fewer than ``gpus``.

    Args:
        ranked: Offers that meet the bid, as ``matcher.rank_offers`` returns them.
        gpus: How many devices the job needs, 1 to ``MAX_GPUS``.
        rtt_ms: The round trip between two hosts in milliseconds, or None when unknown.
        unknown_rtt_ms: What an unknown round trip counts as.

    Raises:
        ValueError: ``gpus`` is out of range, or an offer appears twice.
    """
    if not 1 <= gpus <= MAX_GPUS:
        raise ValueError(f"a job leases 1 to {MAX_GPUS} GPUs, not {gpus}")
    by_host = _devices_by_host(ranked)
    if sum(len(devices) for devices in by_host.values()) < gpus:
        return None

    def distance(a: str, b: str) -> float:
        known = rtt_ms(a, b) if rtt_ms is not None else None
        return unknown_rtt_ms if known is None else known

    gangs = (_grow(seed, by_host, gpus, distance) for seed in by_host)
    return min(gangs, key=Gang.preference)


def rtt_via_consumer(latency_ms: Mapping[str, float]) -> RoundTrip:
    """Round trips between hosts estimated from the consumer's own round trips to each
    (``matcher.RankedOffer.latency_ms``): at most the path through the consumer, their
    sum (the triangle inequality), the figure to use until hosts measure each other."""

    def rtt(a: str, b: str) -> float | None:
        if a == b:
            return 0.0
        if a not in latency_ms or b not in latency_ms:
            return None
        return latency_ms[a] + latency_ms[b]

    return rtt


def _devices_by_host(ranked: Sequence[RankedOffer]) -> dict[str, list[RankedOffer]]:
    by_host: dict[str, list[RankedOffer]] = {}
    seen: set[tuple[str, str]] = set()
    for member in ranked:
        key = (member.offer.host, member.offer.offer_id)
        if key in seen:
            raise ValueError(f"offer {key[1]} of host {key[0]} is ranked twice")
        seen.add(key)
        by_host.setdefault(member.offer.host, []).append(member)
    for devices in by_host.values():
        devices.sort(key=lambda m: (m.effective_price, m.offer.offer_id))
    return by_host


def _grow(
    seed: str,
    by_host: Mapping[str, list[RankedOffer]],
    gpus: int,
    distance: Callable[[str, str], float],
) -> Gang:
    """The gang grown from ``seed``: nearest host next, the largest on a tie."""
    hosts = [seed]
    members = list(by_host[seed][:gpus])
    diameter = 0.0
    while len(members) < gpus:
        rest = [h for h in by_host if h not in hosts]
        reach = {h: max(distance(h, chosen) for chosen in hosts) for h in rest}
        nearest = min(
            rest, key=lambda h: (reach[h], -len(by_host[h]), by_host[h][0].effective_price, h)
        )
        hosts.append(nearest)
        members += by_host[nearest][: gpus - len(members)]
        diameter = max(diameter, reach[nearest])
    price = sum(m.effective_price for m in members)
    return Gang(tuple(members), tuple(hosts), diameter, price)
