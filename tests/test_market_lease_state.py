"""Specs for cumulus_p2p.market.lease_state: a served lease's lifecycle and what its
payments call for (sans-IO)."""

from __future__ import annotations

import itertools

import pytest

from cumulus_p2p._errors import LocalProtocolError
from cumulus_p2p.market.lease_state import (
    FINAL_STATES,
    TRANSITIONS,
    LeaseEvent,
    LeaseLifecycle,
    LeaseState,
    overdue_since,
    payment_event,
    settled_event,
)

RUNNING, PAUSED, SETTLING = LeaseState.RUNNING, LeaseState.PAUSED, LeaseState.SETTLING
ENDED, UNPAID = LeaseState.ENDED, LeaseState.UNPAID

LEGAL = [(state, event, to) for state, moves in TRANSITIONS.items() for event, to in moves.items()]
ILLEGAL = [
    (state, event)
    for state, event in itertools.product(LeaseState, LeaseEvent)
    if event not in TRANSITIONS[state]
]


def test_the_table_lists_the_lifecycle():
    assert {(s, e, t) for s, e, t in LEGAL} == {
        (RUNNING, LeaseEvent.RECEIPT_OVERDUE, PAUSED),
        (RUNNING, LeaseEvent.SESSION_OVER, SETTLING),
        (RUNNING, LeaseEvent.SETTLED, ENDED),
        (RUNNING, LeaseEvent.DEFAULTED, UNPAID),
        (PAUSED, LeaseEvent.PAID_UP, RUNNING),
        (PAUSED, LeaseEvent.SETTLED, ENDED),
        (PAUSED, LeaseEvent.DEFAULTED, UNPAID),
        (SETTLING, LeaseEvent.SETTLED, ENDED),
        (SETTLING, LeaseEvent.DEFAULTED, UNPAID),
    }
    assert FINAL_STATES == {ENDED, UNPAID}


@pytest.mark.parametrize(("state", "event", "to"), LEGAL, ids=lambda v: v.name)
def test_every_legal_move_lands_where_the_table_says(state, event, to):
    lifecycle = LeaseLifecycle(state)
    assert lifecycle.process(event) is to
    assert lifecycle.state is to
    assert lifecycle.final == (to in FINAL_STATES)


@pytest.mark.parametrize(("state", "event"), ILLEGAL, ids=lambda v: v.name)
def test_an_illegal_move_raises_and_leaves_the_state(state, event):
    lifecycle = LeaseLifecycle(state)
    with pytest.raises(LocalProtocolError, match=f"{state.value} cannot take {event.name}"):
        lifecycle.process(event)
    assert lifecycle.state is state


def test_an_ended_lease_cannot_be_resumed():
    lifecycle = LeaseLifecycle(ENDED)
    with pytest.raises(LocalProtocolError, match=r"legal moves: none, it is final"):
        lifecycle.process(LeaseEvent.PAID_UP)


def test_a_late_payer_pauses_resumes_and_settles_at_the_end():
    lifecycle = LeaseLifecycle()
    assert lifecycle.state is RUNNING
    walk = ["RECEIPT_OVERDUE", "PAID_UP", "SESSION_OVER", "SETTLED"]
    states = [lifecycle.process(LeaseEvent[name]) for name in walk]
    assert states == [PAUSED, RUNNING, SETTLING, ENDED]
    assert lifecycle.final


# --- what the payments call for ------------------------------------------------------

GRACE = 10.0


def event_at(state, late: float | None, *, done_serving: bool = False):
    oldest = None if late is None else 100.0
    now = 100.0 + (late or 0.0)
    return payment_event(
        state, oldest_unsettled_at=oldest, done_serving=done_serving, now=now, grace=GRACE
    )


def test_a_receipt_late_within_the_grace_changes_nothing():
    assert [event_at(s, GRACE) for s in (RUNNING, PAUSED, SETTLING)] == [None, None, None]


def test_past_one_grace_a_running_lease_pauses_and_an_ending_one_waits():
    assert event_at(RUNNING, GRACE + 1) is LeaseEvent.RECEIPT_OVERDUE
    assert event_at(PAUSED, GRACE + 1) is None
    assert event_at(SETTLING, GRACE + 1) is None


@pytest.mark.parametrize("state", [PAUSED, SETTLING], ids=lambda s: s.name)
def test_past_two_graces_a_paused_or_settling_lease_defaults(state):
    assert event_at(state, 2 * GRACE + 1) is LeaseEvent.DEFAULTED
    assert TRANSITIONS[state][LeaseEvent.DEFAULTED] is UNPAID


def test_a_running_lease_pauses_before_it_can_default_however_late_the_receipt():
    assert event_at(RUNNING, 5 * GRACE) is LeaseEvent.RECEIPT_OVERDUE


@pytest.mark.parametrize("state", [PAUSED, SETTLING], ids=lambda s: s.name)
def test_a_lease_defaults_only_a_grace_after_the_host_found_it_overdue(state):
    def found_overdue(ago: float):
        now = 100.0 + 3 * GRACE
        return payment_event(
            state, oldest_unsettled_at=100.0, done_serving=False, now=now, grace=GRACE,
            overdue_at=now - ago,
        )  # fmt: skip

    assert found_overdue(GRACE - 1) is None
    assert found_overdue(GRACE) is LeaseEvent.DEFAULTED


def test_once_settled_a_paused_lease_runs_again_and_a_finished_one_ends():
    assert event_at(PAUSED, None) is LeaseEvent.PAID_UP
    assert event_at(RUNNING, None) is None
    for state in (RUNNING, PAUSED, SETTLING):
        assert event_at(state, None, done_serving=True) is LeaseEvent.SETTLED


def test_a_receipt_is_found_overdue_once_and_keeps_that_time_until_settled():
    def found(previous, late):
        oldest = None if late is None else 100.0
        return overdue_since(
            previous, oldest_unsettled_at=oldest, now=100.0 + (late or 0), grace=GRACE
        )

    assert found(None, GRACE) is None  # within its grace
    assert found(None, GRACE + 1) == 100.0 + GRACE + 1  # found now
    assert found(105.0, 3 * GRACE) == 105.0  # found before: that time stands
    assert found(105.0, None) is None  # settled since
    assert found(105.0, GRACE) is None  # a later receipt, still within its own grace


@pytest.mark.parametrize("state", sorted(FINAL_STATES, key=lambda s: s.value))
def test_a_final_lease_is_left_alone(state):
    assert event_at(state, 3 * GRACE) is None
    assert event_at(state, None, done_serving=True) is None
    assert settled_event(state, done_serving=True) is None
