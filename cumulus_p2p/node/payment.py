"""Payment enforcement on the provider: nothing runs unpaid.

What it decides, and why
------------------------
A host serves first and is paid after: every ``receipt_interval`` it issues a signed
receipt for the use since the last one, and the consumer countersigns it over
``/cumulus/receipt/1.0.0``. A consumer that stops countersigning would otherwise get
the device for free, so ``PaymentEnforcer`` follows each lease's oldest unsettled
receipt and moves the lease along its lifecycle (``market.lease_state``):

- unsettled for ``grace`` seconds: the lease pauses. Its session is hung up on (the
  executor parks it, as at the end of a term) and ``Provider.authorize`` refuses the
  consumer until it settles; then the lease runs again and the session resumes where
  it stopped. A late consumer loses time, not work.
- unsettled for twice that: the lease ends unpaid. Its shares go back on offer and the
  host gossips signed ``NonPayment`` evidence (the lease and the unsettled receipt), so
  other hosts can refuse the consumer too (``ProviderOptions.min_consumer_score``).
- every receipt settled and nothing left to serve: the lease ends.

The decisions are the sans-IO ``market.lease_state.payment_event``; this module is its
shell. It performs what they call for (receipts issued and settled over libp2p,
sessions hung up on, evidence published), reads the node's clock, and tells the
provider through ``on_final`` when a lease is over, for its book and status.

Receipts settle in order, one settlement per lease at a time (``ActiveLease.settling``):
the consumer accepts receipt k+1 only after receipt k, and both the session's end and
the metering loop settle.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import trio
from libp2p.exceptions import BaseLibp2pError

from .._errors import CumulusError
from ..envelope import Envelope
from ..market import Lease, LeaseProposal, Meter
from ..market.lease_state import (
    LeaseEvent,
    LeaseLifecycle,
    LeaseState,
    overdue_since,
    payment_event,
    settled_event,
)
from ..market.settlement import HANGUP_PAUSED, settle_receipt
from ..reputation import NonPayment
from .runtime import Runtime, peer_of

__all__ = ["ActiveLease", "Issued", "PaymentEnforcer"]

#: The provider's logger: these lines were the provider's, and operators filter on its name.
log = logging.getLogger("cumulus_p2p.node.provider")


@dataclass(frozen=True, slots=True)
class Issued:
    """A receipt sent for countersigning, and when (the node's clock)."""

    at: float
    envelope: Envelope


@dataclass
class ActiveLease:
    """A lease being served, its meter and what it has earned so far.

    ``state`` follows ``market.lease_state.TRANSITIONS``: ``RUNNING``; ``PAUSED`` while
    a receipt is overdue; ``SETTLING`` once the session is over and receipts are
    outstanding; then ``ENDED`` (all settled) or ``UNPAID`` (the consumer defaulted).
    """

    lease: Lease
    proposal: LeaseProposal
    meter: Meter
    started: float
    unsettled: list[Issued] = field(default_factory=list)
    settled: trio.Event = field(default_factory=trio.Event)
    #: One settlement at a time: the session's end and the metering loop both settle.
    settling: trio.Lock = field(default_factory=trio.Lock)
    channels: set = field(default_factory=set)
    receipts: int = 0
    share_seconds: int = 0
    lifecycle: LeaseLifecycle = field(default_factory=LeaseLifecycle)
    session_over: bool = False
    #: When this host found its oldest unsettled receipt overdue (``payment_event``
    #: waits a grace from then before ending it unpaid); None while it is not.
    overdue_at: float | None = None
    #: Bytes its sessions moved so far (receipts carry them interval by interval).
    bytes_moved: int = 0
    #: Bytes its sessions' collectives carried between the job's hosts so far.
    peer_bytes: int = 0
    #: The last two ``(time, op count, bytes moved)`` samples of its session, for the
    #: op rate and the byte rate (a transfer under way shows as the latter).
    op_samples: tuple[tuple[float, int, int], ...] = ()

    @property
    def state(self) -> LeaseState:
        """Where the lease stands (moved only through ``lifecycle``)."""
        return self.lifecycle.state

    @property
    def done_serving(self) -> bool:
        """Nothing is left to serve: the last session is over, or the whole term is
        receipted and no session is attached."""
        return self.session_over or (self.meter.finished and not self.channels)

    def count_bytes(self, n: int) -> None:
        """Meter ``n`` bytes moved for the lease."""
        self.bytes_moved += n
        self.meter.record_bytes(n)

    def count_peer_bytes(self, n: int) -> None:
        """Meter ``n`` bytes its session's collectives carried between hosts."""
        self.peer_bytes += n
        self.meter.record_peer_bytes(n)

    def record_ops(self, now: float, ops: int) -> None:
        """Sample the session's op count and bytes moved (the serving path does, on a
        tick)."""
        self.op_samples = (*self.op_samples[-1:], (now, ops, self.bytes_moved))

    @property
    def ops_per_s(self) -> float:
        """Ops per second between the last two samples (0 before there are two)."""
        return self._rate(1)

    @property
    def bytes_per_s(self) -> float:
        """Bytes moved per second, both ways, between the last two samples."""
        return self._rate(2)

    def _rate(self, field: int) -> float:
        if len(self.op_samples) < 2:
            return 0.0
        before, after = self.op_samples
        elapsed = after[0] - before[0]
        return max(0.0, (after[field] - before[field]) / elapsed) if elapsed > 0 else 0.0

    @property
    def earned(self) -> int:
        """Micro-credits receipted so far."""
        return self.proposal.owed(self.share_seconds)

    async def hang_up(self, reason: str) -> None:
        """Close the lease's session channels; the consumer sees ``reason`` and the
        executor parks the session (no ``bye`` came), to be resumed where it stopped."""
        for channel in list(self.channels):
            await channel.aclose(reason)


class PaymentEnforcer:
    """Issues and settles a provider's receipts and acts on its unpaid leases.

    Args:
        runtime: The node's runtime (identity, mesh, clock, ledger, reports).
        grace: Seconds a receipt may stay unsettled before its lease pauses; the
            lease ends unpaid after twice that.
        on_final: Called once with each lease as it ends (``ENDED`` or ``UNPAID``),
            before ``ActiveLease.settled`` is set.
    """

    def __init__(
        self, runtime: Runtime, *, grace: float, on_final: Callable[[ActiveLease], None]
    ) -> None:
        self.runtime = runtime
        self.grace = grace
        self._on_final = on_final
        self._ledger = runtime.data.ledger()

    def issue(self, active: ActiveLease) -> None:
        """Receipt the lease's use up to now; it waits in ``unsettled``."""
        now = self.runtime.clock()
        envelope = active.meter.issue(now, nonce=self.runtime.mesh.next_nonce())
        active.unsettled.append(Issued(now, envelope))

    async def settle(self, active: ActiveLease) -> None:
        """Have the consumer countersign the lease's unsettled receipts, oldest first,
        until one is refused or times out (it is tried again next time)."""
        async with active.settling:
            await self._settle_in_order(active)

    async def _settle_in_order(self, active: ActiveLease) -> None:
        consumer = peer_of(active.proposal.consumer)
        while active.unsettled:
            envelope = active.unsettled[0].envelope
            try:
                countersigned = await settle_receipt(
                    self.runtime.mesh.host,
                    consumer,
                    envelope,
                    self._ledger,
                    now=self.runtime.clock(),
                    timeout=5.0,
                )
            except (CumulusError, BaseLibp2pError, trio.TooSlowError, OSError) as exc:
                log.warning(
                    "receipt for lease %s not settled yet: %s", active.proposal.lease_id, exc
                )
                return
            active.unsettled.pop(0)
            active.receipts += 1
            active.share_seconds += countersigned.receipt.share_seconds

    def arrears(self, active: ActiveLease) -> str:
        """What the consumer owes, in a sentence for it and the log."""
        if not active.unsettled:
            return "every receipt is settled"
        oldest = active.unsettled[0]
        late = self.runtime.clock() - oldest.at
        return (
            f"{len(active.unsettled)} receipt(s) unsettled, the oldest for {late:.0f} s; "
            f"this host pauses a lease after {self.grace:g} s and ends it after twice that"
        )

    def settle_up(self, active: ActiveLease) -> None:
        """Follow the settlements: resume a paused lease once paid, end a settled one
        with nothing left to serve."""
        if not active.unsettled:
            self._follow(active, settled_event(active.state, done_serving=active.done_serving))

    async def enforce(self, active: ActiveLease) -> None:
        """Make the move the lease's payments call for now (``payment_event``)."""
        now = self.runtime.clock()
        oldest = active.unsettled[0].at if active.unsettled else None
        active.overdue_at = overdue_since(
            active.overdue_at, oldest_unsettled_at=oldest, now=now, grace=self.grace
        )
        event = payment_event(
            active.state,
            oldest_unsettled_at=oldest,
            done_serving=active.done_serving,
            now=now,
            grace=self.grace,
            overdue_at=active.overdue_at,
        )
        lease_id = active.proposal.lease_id
        if event is LeaseEvent.RECEIPT_OVERDUE:
            active.lifecycle.process(event)
            why = self.arrears(active)
            log.warning("lease %s paused: %s", lease_id, why)
            await active.hang_up(f"{HANGUP_PAUSED}: {why}")
        elif event is LeaseEvent.DEFAULTED:
            why = self.arrears(active)
            log.warning("lease %s ended unpaid: %s", lease_id, why)
            self.finish(active, event)
            await active.hang_up(f"unpaid: the lease has ended: {why}")
            await self._report_nonpayment(active)
        else:
            self._follow(active, event)

    def _follow(self, active: ActiveLease, event: LeaseEvent | None) -> None:
        """Make a move of a lease whose receipts are all settled (``settled_event``)."""
        if event is LeaseEvent.SETTLED:
            self.finish(active, event)
        elif event is LeaseEvent.PAID_UP:
            log.info("lease %s: settled; the consumer may resume", active.proposal.lease_id)
            active.lifecycle.process(event)

    def finish(self, active: ActiveLease, event: LeaseEvent) -> None:
        """End the lease (``SETTLED`` or ``DEFAULTED``), once: the session's end and
        the metering loop race to it."""
        if active.settled.is_set():
            return
        active.lifecycle.process(event)
        self._on_final(active)
        active.settled.set()

    async def _report_nonpayment(self, active: ActiveLease) -> None:
        """Gossip signed evidence that the consumer left its oldest receipt unsettled."""
        rt = self.runtime
        evidence = NonPayment(active.lease, rt.identity.public_key, active.unsettled[0].envelope)
        await rt.report(active.proposal.consumer, evidence)
