"""Whose memory leaves the device when room is needed, and where it goes. Sans-IO.

Theory of operation
-------------------
A session's storages live in one of three tiers (``Tier``): on the device, in the host's
memory, or on its disk. An evicted session keeps everything else (handles, graphs, its
generator's state, its token); its storages come back before its next op runs. So a host
can hold more sessions than its device has memory for, and a session that waits costs
the device nothing.

When the device needs ``need`` bytes, ``choose`` names the sessions to evict, in this
order, until their device bytes cover it (the executor then moves each one's storages
that no op named for longest, storage by storage, until ``need`` is off: the last one
named may keep the rest on the device):

1. sessions paused because their lease went unpaid;
2. preempted sessions (contending or interruptible leases whose shares an on-demand
   lease took);
3. idle sessions: no op for ``idle_after_s`` seconds, the longest idle first;
4. then the least recently used among the worst-ranked payers (``scheduler.lease_rank``:
   interruptible below on-demand, cheaper below dearer).

An on-demand session in the middle of its device turn is never chosen, whatever its
standing: its ops are running. Sessions holding nothing on the device are skipped.
When the candidates cannot cover ``need``, ``choose`` names none: evicting some would
cost their tenants a round trip and still not make the room.

Where the chosen go (``destination``): to host memory on a GPU, while the memory the
host lets evicted sessions hold (``--ram-tier``) has room for them; past it, and always
where the device is host memory already, to the disk (the host's blob store). So a GPU
host that sells twice its memory does not trade the device's limit for its RAM's.

Where the provider pauses an unpaid lease or preempts one, it hangs up the session, and
the executor parks it off the device at once (``Executor._park``: host memory, or disk
where the device is host memory): those sessions leave before any of the above is
weighed. The first two standings serve an executor that keeps such sessions attached.

Time is passed in; this module does no I/O (``session.py`` moves the bytes).
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

__all__ = [
    "IDLE_AFTER_S",
    "Candidate",
    "Move",
    "Tier",
    "choose",
    "destination",
    "enough",
    "plan",
]

K = TypeVar("K")

#: Seconds without an op after which a session counts as idle.
IDLE_AFTER_S = 60.0


class Tier(enum.Enum):
    """Where a session's storages are."""

    DEVICE = "device"
    RAM = "ram"
    DISK = "disk"


@dataclass(frozen=True, slots=True)
class Candidate:
    """A session as the policy sees it.

    Attributes:
        key: whatever names the session to the caller.
        rank: its lease's rank (``scheduler.lease_rank``): lower runs first.
        on_demand: its lease is on-demand.
        device_bytes: what it holds on the device now (0 once evicted).
        last_op_at: when its last op ran.
        unpaid: paused for non-payment.
        preempted: its shares went to an on-demand lease.
        in_turn: its ops are running on the device now.
    """

    key: Hashable
    rank: tuple
    on_demand: bool
    device_bytes: int
    last_op_at: float
    unpaid: bool = False
    preempted: bool = False
    in_turn: bool = False


def choose(
    candidates: Sequence[Candidate], need: int, *, now: float, idle_after_s: float = IDLE_AFTER_S
) -> list[Hashable]:
    """The keys of the sessions to evict so that ``need`` device bytes come free, in the
    order to evict them; empty when ``need`` is covered already (0 or less) or cannot be."""
    return [c.key for c in _chosen(candidates, need, now, idle_after_s)]


def _chosen(
    candidates: Sequence[Candidate], need: int, now: float, idle_after_s: float
) -> list[Candidate]:
    if need <= 0:
        return []
    movable = [c for c in candidates if c.device_bytes > 0 and not (c.on_demand and c.in_turn)]
    chosen, freed = [], 0
    for candidate in sorted(movable, key=lambda c: _order(c, now, idle_after_s)):
        chosen.append(candidate)
        freed += candidate.device_bytes
        if freed >= need:
            return chosen
    return []


def enough(sizes: Iterable[tuple[K, int]], need: int | None) -> list[K]:
    """Within one session: of ``(storage, bytes)`` pairs in the order to give them up
    (the longest unused first), the storages taken until their bytes add up to ``need``;
    all of them for None, or when together they fall short."""
    chosen: list[K] = []
    freed = 0
    for key, nbytes in sizes:
        if need is not None and freed >= need:
            break
        chosen.append(key)
        freed += nbytes
    return chosen


@dataclass(frozen=True, slots=True)
class Move:
    """One eviction ``plan`` asks for: of the session ``key`` names, its storages no op
    named for longest, ``nbytes`` of them (all it holds on the device, if fewer), to
    ``tier``."""

    key: Hashable
    tier: Tier
    nbytes: int


def plan(
    candidates: Sequence[Candidate],
    need: int,
    *,
    now: float,
    device_is_host: bool,
    ram_free: int | None,
    disk: bool,
    idle_after_s: float = IDLE_AFTER_S,
) -> list[Move]:
    """The evictions that free ``need`` device bytes: ``choose``'s sessions in its order,
    each asked for what is still needed, each to its ``destination`` (host memory filling
    up as they go). It stops at the first with nowhere to go: the rest stay, and quotas
    still hold."""
    moves = []
    for candidate in _chosen(candidates, need, now, idle_after_s):
        nbytes = min(need, candidate.device_bytes)
        tier = destination(nbytes, device_is_host=device_is_host, ram_free=ram_free, disk=disk)
        if tier is None:
            break
        if tier is Tier.RAM and ram_free is not None:
            ram_free -= nbytes
        moves.append(Move(candidate.key, tier, need))
        need -= candidate.device_bytes
    return moves


def _order(candidate: Candidate, now: float, idle_after_s: float) -> tuple:
    """Sort key: the standing's place in the order, then within it who goes first."""
    idle_s = now - candidate.last_op_at
    if candidate.unpaid:
        return (0, -idle_s)
    if candidate.preempted:
        return (1, -idle_s)
    if idle_s >= idle_after_s:
        return (2, -idle_s)
    # The worst rank first (ranks sort best first), and within it the least recent.
    return (3, tuple(-x for x in candidate.rank), candidate.last_op_at)


def destination(
    nbytes: int, *, device_is_host: bool, ram_free: int | None, disk: bool
) -> Tier | None:
    """Where a session's ``nbytes`` of storages go when they leave the device: host
    memory where the device is not host memory and ``ram_free`` (None: unbounded) has
    room for them, else the disk when there is one (``disk``); None where neither can
    take them, and then they stay."""
    if not device_is_host and (ram_free is None or nbytes <= ram_free):
        return Tier.RAM
    return Tier.DISK if disk else None
