"""The consumer's choice of host (``market.hostchoice``): failure is evidence with a
half-life, not a ban. Sans-IO: time is passed in, nothing sleeps."""

from __future__ import annotations

import pytest

from cumulus_p2p._errors import LocalProtocolError
from cumulus_p2p.market.hostchoice import (
    EXCLUDE_FOR_THE_JOB,
    TRANSITIONS,
    BackoffPolicy,
    GiveUp,
    HostChoice,
    HostEvent,
    HostStanding,
    JobState,
    Propose,
    Wait,
)

POLICY = BackoffPolicy(base_s=10.0, factor=2.0, max_s=300.0, half_life_s=100.0)
A, B, C = "hostA", "hostB", "hostC"


def searching(now: float = 0.0, *, patience_s: float = 1800.0, policy=POLICY) -> HostChoice:
    choice = HostChoice(policy, patience_s)
    choice.search(now=now)
    return choice


def failed_after_offering() -> HostChoice:
    """A search in which host A offered (nonce 5) and then failed, both at time 0."""
    choice = searching()
    choice.see_offer(A, 5, now=0.0)
    choice.failed(A, now=0.0)
    return choice


def test_a_host_never_seen_failing_is_proposed_in_rank_order():
    choice = searching()
    assert choice.next_step([B, A, C], now=1.0) == Propose((B, A, C))


def test_a_failed_host_is_set_aside_for_the_base_backoff():
    choice = searching()
    choice.see_offer(A, 1, now=0.0)
    assert choice.failed(A, now=100.0) == 10.0
    choice.see_offer(A, 2, now=101.0)
    assert choice.next_step([A, B], now=109.9) == Propose((B,))
    assert choice.next_step([A, B], now=110.0) == Propose((A, B))


def test_the_backoff_grows_with_repeated_failures():
    choice = searching()
    backoffs = [choice.failed(A, now=t) for t in (0.0, 0.0, 0.0, 0.0)]
    assert backoffs == [10.0, 20.0, 40.0, 80.0]


def test_the_backoff_is_capped():
    choice = searching()
    backoffs = [choice.failed(A, now=0.0) for _ in range(12)]
    assert backoffs[-1] == 300.0


def test_evidence_decays_with_its_half_life():
    choice = searching()
    choice.failed(A, now=0.0)
    # One half-life later the first failure weighs 0.5: the second counts 1.5, not 2.
    assert choice.failed(A, now=100.0) == pytest.approx(10.0 * 2**0.5)
    # Long after, a failure weighs as a first one.
    assert choice.failed(A, now=10_000.0) == pytest.approx(10.0, abs=1e-6)


def test_a_host_whose_backoff_ended_waits_for_a_fresh_offer():
    choice = failed_after_offering()
    # The offer from before the failure still rests in the book: not a sign of life.
    choice.see_offer(A, 5, now=50.0)
    assert choice.standing(A, now=50.0) is HostStanding.SILENT
    assert choice.next_step([A, B], now=50.0) == Propose((B,))


def test_a_host_back_with_a_fresh_offer_is_readmitted_once_its_backoff_ends():
    choice = failed_after_offering()
    choice.see_offer(A, 6, now=3.0)
    assert choice.standing(A, now=3.0) is HostStanding.RETURNED
    held = choice.next_step([A], now=9.0)
    assert isinstance(held, Wait) and held.until == 10.0
    assert choice.next_step([A], now=10.0) == Propose((A,))


def test_a_fresh_offer_after_the_backoff_readmits_at_once():
    choice = failed_after_offering()
    assert choice.standing(A, now=60.0) is HostStanding.SILENT
    choice.see_offer(A, 9, now=60.0)
    assert choice.next_step([A], now=60.0) == Propose((A,))


def test_a_readmitted_host_that_fails_again_serves_a_longer_backoff():
    choice = searching()
    choice.see_offer(A, 1, now=0.0)
    first = choice.failed(A, now=0.0)
    choice.see_offer(A, 2, now=20.0)
    assert choice.usable(A, now=20.0)
    second = choice.failed(A, now=30.0)
    assert second > first
    assert choice.standing(A, now=30.0) is HostStanding.COOLING
    choice.see_offer(A, 3, now=31.0)
    assert not choice.usable(A, now=30.0 + first)
    assert choice.usable(A, now=30.0 + second)


def test_a_host_that_left_is_tried_again_when_it_announces_without_a_backoff():
    choice = searching()
    choice.see_offer(A, 1, now=0.0)
    choice.left(A, now=5.0)
    assert choice.next_step([A, B], now=5.0) == Propose((B,))
    choice.see_offer(A, 2, now=6.0)
    assert choice.next_step([A, B], now=6.0) == Propose((A, B))


def test_a_banned_host_stays_out_whatever_it_announces():
    choice = searching()
    choice.ban(A, "misrepresented its device")
    choice.see_offer(A, 99, now=1000.0)
    assert choice.standing(A, now=1000.0) is HostStanding.BANNED
    assert choice.next_step([A, B], now=1000.0) == Propose((B,))


def test_an_empty_pool_holds_the_job_until_a_host_returns():
    choice = searching(patience_s=600.0)
    for host in (A, B):
        choice.see_offer(host, 1, now=0.0)
        choice.failed(host, now=0.0)
    held = choice.next_step([A, B], now=1.0)
    assert isinstance(held, Wait) and held.deadline == 600.0 and held.until == 10.0
    assert "2 matching host(s) set aside" in held.reason and "fresh offer" in held.reason
    assert choice.state is JobState.WAITING
    # The backoffs end, but neither host has announced again: still held.
    assert isinstance(choice.next_step([A, B], now=200.0), Wait)
    choice.see_offer(B, 2, now=300.0)
    assert choice.next_step([A, B], now=300.0) == Propose((B,))
    assert choice.state is JobState.SEARCHING
    choice.leased(B, now=300.5)
    assert choice.state is JobState.RUNNING


def test_a_pool_with_no_offer_at_all_is_waited_for():
    choice = searching()
    held = choice.next_step([], now=5.0)
    assert isinstance(held, Wait) and held.until is None
    assert held.reason == "no offer meets the bid"


def test_a_job_gives_up_when_its_patience_runs_out():
    choice = searching(now=100.0, patience_s=60.0)
    choice.failed(A, now=100.0)
    assert isinstance(choice.next_step([A], now=159.0), Wait)
    gave_up = choice.next_step([A], now=160.0)
    assert isinstance(gave_up, GiveUp) and "no lease within 60s" in gave_up.reason
    assert choice.state is JobState.GAVE_UP


def test_a_job_whose_hosts_keep_refusing_gives_up_at_its_deadline_too():
    choice = searching(patience_s=60.0)
    assert choice.next_step([A], now=30.0) == Propose((A,))
    gave_up = choice.next_step([A], now=60.0)
    assert isinstance(gave_up, GiveUp) and "none of 1 usable host(s)" in gave_up.reason


def test_a_search_may_have_a_patience_of_its_own():
    choice = HostChoice(POLICY, patience_s=1800.0)
    choice.search(now=0.0, patience_s=60.0)
    assert choice.deadline == 60.0


def test_each_search_gets_its_own_patience():
    choice = searching(now=0.0, patience_s=60.0)
    choice.leased(A, now=1.0)
    choice.search(now=1000.0)
    assert choice.deadline == 1060.0
    assert isinstance(choice.next_step([], now=1059.0), Wait)


def test_asking_for_a_step_while_not_searching_is_a_local_error():
    choice = HostChoice(POLICY)
    with pytest.raises(LocalProtocolError):
        choice.next_step([A], now=0.0)


def test_exclusion_for_the_job_never_readmits_a_failed_host():
    choice = searching(policy=EXCLUDE_FOR_THE_JOB)
    choice.see_offer(A, 1, now=0.0)
    choice.failed(A, now=0.0)
    choice.see_offer(A, 2, now=1e9)
    assert not choice.usable(A, now=1e9)


def test_the_view_changes_nothing_and_lists_hosts_set_aside():
    choice = searching()
    choice.see_offer(A, 1, now=0.0)
    choice.see_offer(B, 1, now=0.0)
    choice.failed(A, now=0.0)
    first = choice.view(now=50.0)
    assert first == choice.view(now=50.0)
    (row,) = first
    assert row.host == A and row.standing is HostStanding.SILENT and row.evidence == 0.707
    assert choice._hosts[A].standing is HostStanding.COOLING  # the read applied nothing


def test_every_standing_has_a_row_and_banned_is_final():
    assert set(TRANSITIONS) == set(HostStanding)
    assert TRANSITIONS[HostStanding.BANNED] == {}
    for row in TRANSITIONS.values():
        if row:
            assert row.get(HostEvent.BANNED) is HostStanding.BANNED


def test_a_host_that_ignores_a_proposal_is_set_aside_after_one_try_with_all_its_offers():
    choice = searching()
    for nonce in range(1, 9):  # a flooder's eight offers
        choice.see_offer(A, nonce, now=0.0)
    choice.see_offer(B, 1, now=0.0)
    assert choice.next_step([A, B], now=0.0) == Propose((A, B))
    choice.failed(A, now=3.0, nonce=8, reason="ignored a proposal")
    assert choice.next_step([A, A, B], now=3.0) == Propose((B,))
    # Its old offers change nothing; only a fresh one after the backoff brings it back.
    choice.see_offer(A, 5, now=4.0)
    assert choice.next_step([A, B], now=20.0) == Propose((B,))
    (view,) = choice.view(now=4.0)
    assert view.reason == "ignored a proposal"
