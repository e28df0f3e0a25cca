"""A served lease's life on the host, as data, and what its payments call for. Sans-IO.

Theory of operation
-------------------
A lease the host serves is in one of five states (``LeaseState``)::

    RUNNING --RECEIPT_OVERDUE--> PAUSED --PAID_UP--> RUNNING
    RUNNING --SESSION_OVER-----> SETTLING
    RUNNING, PAUSED, SETTLING --SETTLED----> ENDED
    RUNNING, PAUSED, SETTLING --DEFAULTED--> UNPAID

``RUNNING``: its sessions are served. ``PAUSED``: a receipt stayed unsettled past the
grace period, so the session was hung up on (parked, as at the end of a term) and the
consumer is refused until it settles. ``SETTLING``: the session is over and receipts
are still outstanding. ``ENDED`` and ``UNPAID`` are final: every receipt settled, or the
consumer defaulted.

The legal moves are ``TRANSITIONS``, a table in the manner of h11's ``_state.py``.
``LeaseLifecycle.process`` makes one and raises ``LocalProtocolError`` on any other: a
shell that would resume an ended lease, or pause one already over, has a bug, and it
fails at the move rather than serving a lease nobody pays for.

``payment_event`` decides which move a lease's payments call for now. Nothing runs
unpaid, but a slow consumer is not a defaulter: the decision rests on how long the
*oldest* unsettled receipt has waited (``metering.payment_standing``), since the consumer
countersigns in order and that receipt is the debt. Past one grace period the lease
pauses (only a running one: a session already over has nothing to pause); past two it
ends unpaid, whatever it was doing. Once every receipt is settled a paused lease runs
again, and a lease with nothing left to serve ends.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType

from .._errors import LocalProtocolError
from .metering import Standing, payment_standing

__all__ = [
    "FINAL_STATES",
    "TRANSITIONS",
    "LeaseEvent",
    "LeaseLifecycle",
    "LeaseState",
    "overdue_since",
    "payment_event",
    "settled_event",
]


class LeaseState(enum.Enum):
    """Where a lease the host serves stands; the value is what status shows."""

    RUNNING = "running"
    PAUSED = "paused"
    SETTLING = "settling"
    ENDED = "ended"
    UNPAID = "unpaid"


class LeaseEvent(enum.Enum):
    """What moves a lease from one state to the next."""

    #: A receipt stayed unsettled past the grace period.
    RECEIPT_OVERDUE = "receipt overdue"
    #: A paused lease's consumer settled every receipt.
    PAID_UP = "paid up"
    #: The lease's last session is over and receipts are outstanding.
    SESSION_OVER = "session over"
    #: Every receipt is settled and nothing is left to serve.
    SETTLED = "settled"
    #: A receipt stayed unsettled past twice the grace period.
    DEFAULTED = "defaulted"


_ENDINGS = {LeaseEvent.SETTLED: LeaseState.ENDED, LeaseEvent.DEFAULTED: LeaseState.UNPAID}

#: The legal moves: state -> event -> next state. A move not listed is illegal.
TRANSITIONS: Mapping[LeaseState, Mapping[LeaseEvent, LeaseState]] = MappingProxyType(
    {
        LeaseState.RUNNING: MappingProxyType(
            {
                LeaseEvent.RECEIPT_OVERDUE: LeaseState.PAUSED,
                LeaseEvent.SESSION_OVER: LeaseState.SETTLING,
                **_ENDINGS,
            }
        ),
        LeaseState.PAUSED: MappingProxyType({LeaseEvent.PAID_UP: LeaseState.RUNNING, **_ENDINGS}),
        LeaseState.SETTLING: MappingProxyType(dict(_ENDINGS)),
        LeaseState.ENDED: MappingProxyType({}),
        LeaseState.UNPAID: MappingProxyType({}),
    }
)

#: States a lease never leaves.
FINAL_STATES = frozenset(state for state, moves in TRANSITIONS.items() if not moves)


class LeaseLifecycle:
    """One lease's state, moved only along ``TRANSITIONS``.

    Args:
        state: Where the lease starts (a lease is served from ``RUNNING``).
    """

    __slots__ = ("_state",)

    def __init__(self, state: LeaseState = LeaseState.RUNNING) -> None:
        self._state = state

    @property
    def state(self) -> LeaseState:
        """The lease's current state."""
        return self._state

    @property
    def final(self) -> bool:
        """Whether the lease is over for good (``ENDED`` or ``UNPAID``)."""
        return self._state in FINAL_STATES

    def process(self, event: LeaseEvent) -> LeaseState:
        """Make the move ``event`` calls for.

        Returns:
            The new state.

        Raises:
            LocalProtocolError: The move is not in ``TRANSITIONS`` for the current
                state; the state is left as it was.
        """
        moves = TRANSITIONS[self._state]
        if event not in moves:
            legal = ", ".join(e.name for e in moves) or "none, it is final"
            raise LocalProtocolError(
                f"a lease that is {self._state.value} cannot take {event.name} "
                f"(legal moves: {legal})"
            )
        self._state = moves[event]
        return self._state

    def __repr__(self) -> str:
        return f"LeaseLifecycle({self._state})"


def settled_event(state: LeaseState, *, done_serving: bool) -> LeaseEvent | None:
    """The move a lease whose receipts are all settled calls for, if any.

    Args:
        state: The lease's state.
        done_serving: Whether nothing is left to serve: its last session is over, or
            the whole term is receipted and no session is attached.

    Returns:
        ``SETTLED`` when nothing is left to serve, ``PAID_UP`` for a paused lease
        that may run again, else ``None``.
    """
    if state in FINAL_STATES:
        return None
    if done_serving:
        return LeaseEvent.SETTLED
    if state is LeaseState.PAUSED:
        return LeaseEvent.PAID_UP
    return None


def overdue_since(
    overdue_at: float | None, *, oldest_unsettled_at: float | None, now: float, grace: float
) -> float | None:
    """When the host found the lease's oldest unsettled receipt overdue, as of ``now``
    (what ``payment_event`` takes as ``overdue_at``): ``overdue_at`` if it had already,
    ``now`` if it finds it so now, None while none is overdue (the one found overdue was
    settled since, and a later one gets a grace of its own)."""
    if payment_standing(oldest_unsettled_at, now=now, grace=grace) is Standing.CURRENT:
        return None
    return now if overdue_at is None else overdue_at


def payment_event(
    state: LeaseState,
    *,
    oldest_unsettled_at: float | None,
    done_serving: bool,
    now: float,
    grace: float,
    overdue_at: float | None = None,
) -> LeaseEvent | None:
    """The move a lease's payments call for now, if any.

    A running lease always pauses before it can end unpaid, and no lease ends unpaid
    sooner than a grace after the host found it overdue: the pause's hang-up warns the
    consumer, the host asks again meanwhile, and a host whose own loop was held up past
    both graces (a settlement that hung, a busy machine) must not end an honest
    consumer's lease on the strength of one unanswered request.

    Args:
        state: The lease's state.
        oldest_unsettled_at: When the oldest receipt still unsettled was issued;
            ``None`` when every receipt is settled.
        done_serving: As for ``settled_event``.
        now: The current time, on the clock ``oldest_unsettled_at`` was read from.
        grace: How long a receipt may stay unsettled before the lease pauses; it ends
            after twice that, and a grace after ``overdue_at`` at the earliest.
        overdue_at: When the host first found the receipt overdue (None: long ago).

    Returns:
        The event to ``LeaseLifecycle.process``, or ``None`` to leave the lease be.
    """
    if state in FINAL_STATES:
        return None
    if oldest_unsettled_at is None:
        return settled_event(state, done_serving=done_serving)
    standing = payment_standing(oldest_unsettled_at, now=now, grace=grace)
    if standing is Standing.CURRENT:
        return None
    if state is LeaseState.RUNNING:
        return LeaseEvent.RECEIPT_OVERDUE
    warned = overdue_at is None or now - overdue_at >= grace
    if standing is Standing.DEFAULTED and warned:
        return LeaseEvent.DEFAULTED
    return None
