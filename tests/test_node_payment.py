"""Specs for cumulus_p2p.node.payment: what the provider does with an unpaid lease.

The enforcer runs against stand-ins for the runtime (a settable clock, a report sink)
and for the session channels, so each spec is about one decision and what it does.
"""

from __future__ import annotations

from types import SimpleNamespace

from cumulus_p2p.identity import NodeIdentity
from cumulus_p2p.market import Meter
from cumulus_p2p.market.lease_state import LeaseState
from cumulus_p2p.node.payment import ActiveLease, PaymentEnforcer
from cumulus_p2p.reputation import NonPayment
from cumulus_p2p.reputation.testing import Minter

NOW = 1_700_000_000.0
GRACE = 10.0
HOST, CONSUMER = NodeIdentity.generate(), NodeIdentity.generate()


class StandInChannel:
    def __init__(self) -> None:
        self.closed_with: str | None = None

    async def aclose(self, reason: str) -> None:
        self.closed_with = reason


class StandInRuntime:
    """What the enforcer reads and calls: identity, clock, nonces, reports."""

    def __init__(self) -> None:
        self.now = NOW
        self.identity = HOST
        self.peer_id = HOST.peer_id.to_base58()
        self.data = SimpleNamespace(ledger=lambda: None)
        self.mesh = SimpleNamespace(next_nonce=self._next_nonce)
        self.reports: list = []
        self._nonce = 0

    def clock(self) -> float:
        return self.now

    def _next_nonce(self) -> int:
        self._nonce += 1
        return self._nonce

    async def report(self, about: str, evidence) -> bool:
        self.reports.append((about, evidence))
        return True


def enforcer_with_a_lease() -> tuple[PaymentEnforcer, StandInRuntime, ActiveLease, list]:
    runtime = StandInRuntime()
    ended: list[ActiveLease] = []
    enforcer = PaymentEnforcer(runtime, grace=GRACE, on_final=ended.append)
    lease = Minter().lease(CONSUMER, HOST, start=NOW)
    active = ActiveLease(lease, lease.proposal, Meter(HOST, lease.proposal, interval=1.0), NOW)
    return enforcer, runtime, active, ended


def enforcer_owed_a_receipt() -> tuple[PaymentEnforcer, StandInRuntime, ActiveLease, list]:
    """``enforcer_with_a_lease`` whose host issued a receipt a second into the lease,
    left unsettled."""
    enforcer, runtime, active, ended = enforcer_with_a_lease()
    runtime.now = NOW + 1
    enforcer.issue(active)
    return enforcer, runtime, active, ended


async def test_a_receipt_unsettled_past_the_grace_pauses_the_lease_and_hangs_up():
    enforcer, runtime, active, ended = enforcer_owed_a_receipt()
    channel = StandInChannel()
    active.channels.add(channel)
    runtime.now += GRACE
    await enforcer.enforce(active)
    assert active.state is LeaseState.RUNNING and channel.closed_with is None
    runtime.now += 1
    await enforcer.enforce(active)
    assert active.state is LeaseState.PAUSED
    assert channel.closed_with.startswith("unpaid: the lease is paused: 1 receipt(s)")
    assert ended == [] and not active.settled.is_set()


async def test_a_paused_lease_runs_again_once_its_receipts_are_settled():
    enforcer, runtime, active, _ = enforcer_owed_a_receipt()
    runtime.now += GRACE + 1
    await enforcer.enforce(active)
    assert active.state is LeaseState.PAUSED
    active.unsettled.clear()  # as a settlement does
    await enforcer.enforce(active)
    assert active.state is LeaseState.RUNNING


async def test_past_two_graces_the_lease_ends_unpaid_and_the_consumer_is_reported():
    enforcer, runtime, active, ended = enforcer_owed_a_receipt()
    runtime.now += GRACE + 1
    await enforcer.enforce(active)
    runtime.now += GRACE
    await enforcer.enforce(active)
    assert active.state is LeaseState.UNPAID
    assert ended == [active] and active.settled.is_set()
    ((about, evidence),) = runtime.reports
    assert about == CONSUMER.peer_id.to_base58() and isinstance(evidence, NonPayment)
    await enforcer.enforce(active)  # over: nothing more happens
    assert ended == [active] and len(runtime.reports) == 1


async def test_an_enforcer_held_up_past_two_graces_pauses_first_and_ends_a_grace_later():
    enforcer, runtime, active, ended = enforcer_owed_a_receipt()
    runtime.now += 3 * GRACE  # the metering loop waited on a settlement that hung
    await enforcer.enforce(active)
    assert active.state is LeaseState.PAUSED and runtime.reports == []
    runtime.now += GRACE - 1
    await enforcer.enforce(active)
    assert active.state is LeaseState.PAUSED
    runtime.now += 1
    await enforcer.enforce(active)
    assert active.state is LeaseState.UNPAID and ended == [active]


async def test_a_settling_lease_whose_enforcer_was_held_up_ends_a_grace_after_it_looked():
    enforcer, runtime, active, ended = enforcer_owed_a_receipt()
    active.session_over = True
    runtime.now += 3 * GRACE  # the metering loop waited on a settlement that hung
    await enforcer.enforce(active)
    assert ended == [] and runtime.reports == []
    runtime.now += GRACE
    await enforcer.enforce(active)
    assert active.state is LeaseState.UNPAID and ended == [active]


async def test_a_lease_late_again_after_paying_gets_a_fresh_grace():
    enforcer, runtime, active, ended = enforcer_owed_a_receipt()
    runtime.now += GRACE + 1
    await enforcer.enforce(active)
    active.unsettled.clear()  # paid: the lease runs again
    await enforcer.enforce(active)
    enforcer.issue(active)
    runtime.now += 3 * GRACE
    await enforcer.enforce(active)
    assert active.state is LeaseState.PAUSED and ended == []


async def test_a_lease_with_nothing_left_to_serve_ends_once_settled():
    enforcer, runtime, active, ended = enforcer_with_a_lease()
    active.session_over = True
    enforcer.settle_up(active)
    assert active.state is LeaseState.ENDED and ended == [active]
    enforcer.settle_up(active)
    assert ended == [active]
