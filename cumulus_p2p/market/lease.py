"""Lease negotiation, host side: reserve shares or disk atomically, or refuse with a reason.

Sans-IO.

Theory of operation
-------------------
A host publishes its own offers into its ``LeaseBook``; each offer id is a pool of
free shares. A consumer sends a signed ``LeaseProposal``; ``LeaseBook.propose`` runs it
through, in order:

1. the envelope validator (shape, signature, expiry, replay) - nothing else is looked
   at for a forged or replayed proposal;
2. the proposal's own terms against this host: addressed to us, sent by its signer,
   lease id unused, offer known and live, price at least the offer's (for a
   contending lease, its contend price: ``pricing.py``), duration at least the offer's
   minimum, start time near now;
3. capacity: the shares must be free. A contending lease draws on the offer's
   contending shares (``Offer.contend_shares``), sold beyond its on-demand ones, which
   nothing preempts. Every other compute lease draws on ``shares_free``; for an
   on-demand lease, the shares there of interruptible leases count as free: the
   cheapest of them are preempted (released at once) when that makes room.
   ``take_preempted`` hands them to the shell, which tells their consumers
   (``NOTICE_PREEMPTED``) and ends their sessions; their state stays parked on the
   host, to resume there or move;
4. admission: the free shares go to the best bid waiting for them first
   (``admission.py``). When other consumers' bids resting in the host's book fit the
   offer and rank ahead of the proposer, and the proposal would leave them too few
   shares, it is refused as ``OUTBID``, for at most ``admission.HOLD_S`` from the first
   proposal outbid on that offer.

A standby proposal (``LeaseKind.STANDBY``) leases disk for another session's
checkpoints instead of shares. Step 2 holds it to the offer's storage terms: the offer
lends storage (``storage_gib > 0``) and the price is at least its ``storage_price``
per GiB-hour; step 3 to the GiB the host has free, host-wide (one disk serves all of a
host's offers), after its other standby leases. A standby never touches a share pool,
and a compute lease never touches the disk.

Only when every check passes are the shares (or GiB) taken from the pool and the
proposal countersigned, in one synchronous call. The trio shell calls ``propose`` without
awaiting in between, so concurrent proposals are serialized by construction and the
pool can never go negative: nothing is double-booked. A refused proposal changes
nothing except the validator's memory of its nonce (so its replay is refused too).

Shares return to the pool when the lease ends (``expire``) or is released. When the
host re-announces an offer (a newer nonce), the pool takes the new ``shares_free``:
announce ``free_shares(offer_id)`` to keep the two in step. Likewise the disk: each
newer offer sets the GiB free to its ``storage_gib``, so every offer a host announces
carries the same ``free_storage()``.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Iterable
from dataclasses import dataclass

from .._errors import MalformedMessageError
from ..envelope import EnvelopeValidator, Rejected, Rejection
from ..identity import NodeIdentity
from .admission import HOLD_S, waiting_ahead
from .messages import Bid, Lease, LeaseKind, LeaseProposal, Offer, PriorityClass, open_message
from .pricing import least_price

__all__ = ["LeaseBook", "RefusalReason", "Refusal", "Reservation"]


class RefusalReason(enum.Enum):
    """Why a host refused a lease proposal."""

    MALFORMED = "malformed"
    BAD_SIGNATURE = "bad signature"
    EXPIRED = "proposal expired"
    REPLAYED = "replayed"
    WRONG_HOST = "addressed to another host"
    WRONG_SENDER = "sent by someone other than its signer"
    DUPLICATE_LEASE_ID = "lease id already used"
    UNKNOWN_OFFER = "no such offer"
    OFFER_EXPIRED = "offer expired"
    PRICE_MISMATCH = "price below what the offer asks"
    TOO_SHORT = "shorter than the offer's minimum lease"
    BAD_START = "start time too far from now"
    NO_CAPACITY = "not enough free shares"
    OUTBID = "the free shares go to a better bid waiting for them"
    NO_STORAGE = "this host keeps no standbys"
    NO_STORAGE_CAPACITY = "not enough free storage"
    OVERLOADED = "host overloaded"
    CONSUMER_REFUSED = "the host does not lease to this consumer now"

    @property
    def is_peer_fault(self) -> bool:
        """Whether the proposer misbehaved (as opposed to bad luck or our load)."""
        return self in _PEER_FAULTS


_PEER_FAULTS = frozenset(
    {
        RefusalReason.MALFORMED,
        RefusalReason.BAD_SIGNATURE,
        RefusalReason.REPLAYED,
        RefusalReason.WRONG_SENDER,
        RefusalReason.DUPLICATE_LEASE_ID,
    }
)

_FROM_REJECTION = {
    Rejection.MALFORMED: RefusalReason.MALFORMED,
    Rejection.OVERSIZED: RefusalReason.MALFORMED,
    Rejection.UNKNOWN_KIND: RefusalReason.MALFORMED,
    Rejection.BAD_SIGNATURE: RefusalReason.BAD_SIGNATURE,
    Rejection.EXPIRED: RefusalReason.EXPIRED,
    Rejection.TOO_FAR_IN_FUTURE: RefusalReason.MALFORMED,
    Rejection.REPLAYED: RefusalReason.REPLAYED,
    Rejection.STALE_NONCE: RefusalReason.REPLAYED,
    Rejection.REPLAY_CACHE_FULL: RefusalReason.OVERLOADED,
}


@dataclass(frozen=True, slots=True)
class Refusal:
    """A refused proposal: the reason and a sentence for the consumer."""

    reason: RefusalReason
    detail: str


@dataclass(frozen=True, slots=True)
class Reservation:
    """Shares (or, for a standby, GiB) held for a granted lease until ``end_at``."""

    lease: Lease
    proposal: LeaseProposal

    @property
    def end_at(self) -> float:
        """When the shares return to the pool."""
        return self.proposal.end_at


@dataclass(slots=True)
class _Pool:
    offer: Offer
    free: int
    contend_free: int = 0

    def free_for(self, priority: PriorityClass) -> int:
        return self.contend_free if priority is PriorityClass.CONTEND else self.free

    def take(self, proposal: LeaseProposal, shares: int) -> None:
        """Add ``shares`` (negative: take them) to the pool ``proposal`` draws on."""
        if proposal.priority is PriorityClass.CONTEND:
            self.contend_free += shares
        else:
            self.free += shares


class LeaseBook:
    """The host's offers, their free shares, its free storage and the leases granted.

    Args:
        identity: The host; it countersigns granted leases.
        max_start_skew: How far (seconds) a proposal's start may be from ``now``.
        max_proposal_ttl: Longest proposal lifetime accepted (the replay memory bound).
    """

    def __init__(
        self,
        identity: NodeIdentity,
        *,
        max_start_skew: float = 300.0,
        max_proposal_ttl: float = 600.0,
    ) -> None:
        self._identity = identity
        self._peer_id = identity.peer_id.to_base58()
        self._validator = EnvelopeValidator([LeaseProposal.KIND], max_ttl=max_proposal_ttl)
        self._max_start_skew = max_start_skew
        self._pools: dict[str, _Pool] = {}
        self._storage_free = 0
        self._leases: dict[str, Reservation] = {}
        self._ends: list[tuple[float, str]] = []
        self._preempted: list[Reservation] = []
        #: When a proposal was first outbid on each offer since its last grant.
        self._outbid_since: dict[str, float] = {}

    @property
    def peer_id(self) -> str:
        """The host's peer ID (base58)."""
        return self._peer_id

    def publish(self, offer: Offer) -> None:
        """Put one of this host's offers up for leasing, or re-announce it.

        A newer nonce for the same ``offer_id`` replaces the terms and sets the free
        shares to ``offer.shares_free`` (and the contending pool's to
        ``offer.contend_shares``), and the host's free storage to ``offer.storage_gib``;
        an older or equal nonce is ignored.

        Raises:
            ValueError: The offer names another host.
        """
        if offer.host != self._peer_id:
            raise ValueError(f"offer names host {offer.host}, this host is {self._peer_id}")
        pool = self._pools.get(offer.offer_id)
        if pool is None or offer.nonce > pool.offer.nonce:
            self._pools[offer.offer_id] = _Pool(offer, offer.shares_free, offer.contend_shares)
            self._storage_free = offer.storage_gib

    def withdraw(self, offer_id: str) -> None:
        """Stop leasing from ``offer_id``; granted leases are unaffected."""
        self._pools.pop(offer_id, None)

    def free_shares(self, offer_id: str) -> int:
        """Shares of ``offer_id`` free now (0 for an unknown offer)."""
        pool = self._pools.get(offer_id)
        return 0 if pool is None else pool.free

    def free_contend_shares(self, offer_id: str) -> int:
        """Shares of ``offer_id``'s contending pool free now (0 for an unknown offer)."""
        pool = self._pools.get(offer_id)
        return 0 if pool is None else pool.contend_free

    def free_storage(self) -> int:
        """GiB of disk free for standby leases now, host-wide."""
        return self._storage_free

    def leases(self) -> list[Reservation]:
        """The leases currently holding shares."""
        return list(self._leases.values())

    def get(self, lease_id: str) -> Reservation | None:
        """The lease ``lease_id`` if it still holds shares, else ``None``."""
        return self._leases.get(lease_id)

    def propose(
        self,
        raw: bytes,
        *,
        now: float,
        sender: str | None = None,
        waiting: Iterable[Bid] = (),
    ) -> Lease | Refusal:
        """Grant or refuse a lease proposal.

        Args:
            raw: The proposal's envelope bytes, as received.
            now: The current Unix time.
            sender: The authenticated peer ID it arrived from, when known; it must
                be the proposal's signer.
            waiting: The bids resting in the host's book: one ranked ahead of the
                proposer may hold the free shares back from it (``admission.py``).

        Returns:
            The countersigned ``Lease`` (the shares or GiB are now reserved), or a
            ``Refusal``. A refusal changes nothing but the replay memory.
        """
        checked = self._validator.validate(raw, now=now)
        if isinstance(checked, Rejected):
            return Refusal(_FROM_REJECTION[checked.reason], checked.detail)
        try:
            proposal = open_message(checked)
        except MalformedMessageError as exc:
            return Refusal(RefusalReason.MALFORMED, str(exc))
        if type(proposal) is not LeaseProposal:
            return Refusal(RefusalReason.MALFORMED, "not a lease proposal")
        refusal = self._check_terms(proposal, now, sender)
        if refusal is None or refusal.reason is RefusalReason.NO_CAPACITY:
            refusal = self._admit(proposal, waiting, now) or refusal
        if refusal is not None and refusal.reason is RefusalReason.NO_CAPACITY:
            refusal = self._preempt_for(proposal, refusal)
        if refusal is not None:
            return refusal
        self._pools[proposal.offer_id].take(proposal, -proposal.shares)
        self._outbid_since.pop(proposal.offer_id, None)
        self._storage_free -= proposal.storage_gib
        lease = Lease.countersign(self._identity, checked)
        self._leases[proposal.lease_id] = Reservation(lease, proposal)
        heapq.heappush(self._ends, (proposal.end_at, proposal.lease_id))
        return lease

    def _check_terms(
        self, proposal: LeaseProposal, now: float, sender: str | None
    ) -> Refusal | None:
        if proposal.host != self._peer_id:
            return Refusal(RefusalReason.WRONG_HOST, f"this host is {self._peer_id}")
        if sender is not None and sender != proposal.consumer:
            return Refusal(RefusalReason.WRONG_SENDER, f"signed by {proposal.consumer}")
        if proposal.lease_id in self._leases:
            return Refusal(RefusalReason.DUPLICATE_LEASE_ID, proposal.lease_id)
        pool = self._pools.get(proposal.offer_id)
        if pool is None:
            return Refusal(RefusalReason.UNKNOWN_OFFER, proposal.offer_id)
        offer = pool.offer
        if offer.expires_at <= now:
            return Refusal(RefusalReason.OFFER_EXPIRED, f"offer expired at {offer.expires_at}")
        standby = proposal.kind is LeaseKind.STANDBY
        if standby and offer.storage_gib == 0:
            return Refusal(RefusalReason.NO_STORAGE, f"offer {offer.offer_id} lends no storage")
        price_refused = self._check_price(proposal, offer)
        if price_refused is not None:
            return price_refused
        if proposal.duration_s < offer.min_lease_s:
            return Refusal(RefusalReason.TOO_SHORT, f"minimum lease is {offer.min_lease_s}s")
        if abs(proposal.start_at - now) > self._max_start_skew:
            return Refusal(RefusalReason.BAD_START, f"start {proposal.start_at}, now {now}")
        if standby and proposal.storage_gib > self._storage_free:
            return Refusal(
                RefusalReason.NO_STORAGE_CAPACITY,
                f"{proposal.storage_gib} GiB wanted, {self._storage_free} GiB free",
            )
        free = pool.free_for(proposal.priority)
        if proposal.shares > free:
            which = " contending" if proposal.priority is PriorityClass.CONTEND else ""
            why = f"{proposal.shares} wanted, {free}{which} free"
            return Refusal(RefusalReason.NO_CAPACITY, why)
        return None

    def _admit(self, proposal: LeaseProposal, waiting: Iterable[Bid], now: float) -> Refusal | None:
        """``OUTBID`` when a better bid waits for the shares this proposal would take,
        within ``HOLD_S`` of the first proposal it outbid there."""
        if proposal.kind is LeaseKind.STANDBY:
            return None
        pool = self._pools[proposal.offer_id]
        ahead = waiting_ahead(proposal, pool.offer, pool.free_for(proposal.priority), waiting)
        if ahead is None:
            return None
        if now - self._outbid_since.setdefault(proposal.offer_id, now) >= HOLD_S:
            return None
        why = f"a bid of {ahead.max_price} per share-hour waits for these shares; bid above it"
        return Refusal(RefusalReason.OUTBID, why)

    @staticmethod
    def _check_price(proposal: LeaseProposal, offer: Offer) -> Refusal | None:
        if proposal.kind is LeaseKind.STANDBY:
            asking, per = offer.storage_price, "GiB-hour"
        else:
            least, per = least_price(offer, proposal.priority), "share-hour"
            if least is None:
                why = f"offer {offer.offer_id} sells no contending leases; it asks {offer.price}"
                return Refusal(RefusalReason.PRICE_MISMATCH, f"{why} per {per}")
            asking = least
        if proposal.price < asking:
            floor = " (its contend price)" if asking < offer.price else ""
            why = f"offered {proposal.price}, asking {asking}{floor} per {per}"
            return Refusal(RefusalReason.PRICE_MISMATCH, why)
        return None

    def _preempt_for(self, proposal: LeaseProposal, refusal: Refusal) -> Refusal | None:
        """Free the shares an on-demand proposal lacks by preempting interruptible
        leases of its offer, cheapest first (the latest first among equals);
        ``refusal`` stands when there are not enough of them (nothing is preempted)."""
        if proposal.priority is not PriorityClass.ON_DEMAND or proposal.kind is LeaseKind.STANDBY:
            return refusal
        victims, freed = [], self._pools[proposal.offer_id].free
        for reservation in self.preemptible(proposal.offer_id):
            if freed >= proposal.shares:
                break
            victims.append(reservation)
            freed += reservation.proposal.shares
        if freed < proposal.shares:
            return refusal
        for reservation in victims:
            self.release(reservation.proposal.lease_id)
        self._preempted.extend(victims)
        return None

    def preemptible(self, offer_id: str) -> list[Reservation]:
        """The compute leases of ``offer_id`` an on-demand lease may preempt (the
        interruptible ones), in the order it does: cheapest first, the latest first
        among equals."""
        below = (
            r
            for r in self._leases.values()
            if r.proposal.offer_id == offer_id
            and r.proposal.kind is LeaseKind.COMPUTE
            and r.proposal.priority is PriorityClass.INTERRUPTIBLE
        )
        return sorted(
            below, key=lambda r: (r.proposal.price, -r.proposal.start_at, r.proposal.lease_id)
        )

    def take_preempted(self) -> list[Reservation]:
        """The leases preempted for on-demand ones since the last call: their shares went
        to those leases, and the host's shell must tell their consumers and end their
        sessions (the state stays parked on the host)."""
        taken, self._preempted = self._preempted, []
        return taken

    def release(self, lease_id: str) -> bool:
        """End a lease early and return its shares or GiB. Returns whether it was held."""
        reservation = self._leases.pop(lease_id, None)
        if reservation is None:
            return False
        pool = self._pools.get(reservation.proposal.offer_id)
        if pool is not None:
            pool.take(reservation.proposal, reservation.proposal.shares)
        self._storage_free += reservation.proposal.storage_gib
        return True

    def expire(self, now: float) -> list[Reservation]:
        """End the leases whose time is up and forget expired proposal nonces.

        Returns:
            The leases that ended.
        """
        ended = []
        while self._ends and self._ends[0][0] <= now:
            _, lease_id = heapq.heappop(self._ends)
            reservation = self._leases.get(lease_id)
            if reservation is not None and reservation.end_at <= now:
                self.release(lease_id)
                ended.append(reservation)
        self._validator.expire(now)
        return ended
