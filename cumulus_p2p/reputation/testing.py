"""Helpers that mint real, signed leases, receipts and reports: for tests and simulations.

Everything is signed with real ed25519 keys through the market's own code
(``seal_message``, ``Lease.countersign``, ``CountersignedReceipt.countersign``), so
evidence built here is exactly what honest (or colluding) peers would produce.
"""

from __future__ import annotations

import itertools
import math

from ..envelope import Envelope
from ..identity import NodeIdentity
from ..market.messages import (
    CountersignedReceipt,
    Lease,
    LeaseProposal,
    Offer,
    PriorityClass,
    Receipt,
    seal_message,
)
from .evidence import (
    BadBlob,
    Evidence,
    FailureReason,
    LeaseFailure,
    NonPayment,
    Report,
    ServiceRecord,
    seal_report,
)
from .served import BlobServed, seal_served

__all__ = ["Minter", "peer"]


def peer(identity: NodeIdentity) -> str:
    """The base58 peer ID of ``identity``."""
    return identity.peer_id.to_base58()


class Minter:
    """Mints signed market documents and reports with one increasing nonce counter.

    One counter for every identity keeps each author's nonces increasing, which is all
    the envelope validator asks.
    """

    def __init__(self) -> None:
        self._nonces = itertools.count(1)
        self._lease_ids = itertools.count(1)

    def nonce(self) -> int:
        """The next nonce."""
        return next(self._nonces)

    def lease(
        self,
        consumer: NodeIdentity,
        host: NodeIdentity,
        *,
        start: float,
        duration_s: int = 3600,
        shares: int = 1,
        offer_id: str = "gpu0",
        offer_nonce: int = 1,
        priority: PriorityClass = PriorityClass.ON_DEMAND,
    ) -> Lease:
        """A lease ``consumer`` proposed and ``host`` countersigned (on demand unless
        ``priority`` says)."""
        proposal = LeaseProposal(
            f"L{next(self._lease_ids)}",
            peer(consumer),
            peer(host),
            offer_id,
            offer_nonce,
            shares,
            1000,
            float(start),
            duration_s,
            priority,
            float(start) + 30.0,
            self.nonce(),
        )
        return Lease.countersign(host, seal_message(consumer, proposal, now=float(start)))

    def _receipt(self, lease: Lease, seq: int, t0: float, t1: float) -> Receipt:
        """Receipt ``seq`` of ``lease`` for ``t0`` to ``t1``: the lease's whole
        share-seconds, no bytes moved, to be countersigned within ten minutes of ``t1``."""
        proposal = lease.proposal
        return Receipt(
            proposal.lease_id,
            proposal.host,
            seq,
            t0,
            t1,
            math.floor((t1 - t0) * proposal.shares),
            0,
            t1 + 600.0,
            self.nonce(),
        )

    def service(
        self,
        consumer: NodeIdentity,
        host: NodeIdentity,
        lease: Lease,
        *,
        fraction: float = 1.0,
        receipts: int = 1,
    ) -> ServiceRecord:
        """Receipts covering the first ``fraction`` of ``lease``, countersigned."""
        proposal = lease.proposal
        served_s = proposal.duration_s * fraction
        signed = []
        for seq in range(receipts):
            t0 = proposal.start_at + served_s * seq / receipts
            t1 = proposal.start_at + served_s * (seq + 1) / receipts
            envelope = seal_message(host, self._receipt(lease, seq, t0, t1), now=t1)
            signed.append(CountersignedReceipt.countersign(consumer, envelope))
        return ServiceRecord(lease, host.public_key, tuple(signed))

    def failure(
        self,
        host: NodeIdentity,
        lease: Lease,
        *,
        ended_at: float | None = None,
        reason: FailureReason = FailureReason.VANISHED,
    ) -> LeaseFailure:
        """The consumer's claim that ``host`` stopped serving ``lease`` at ``ended_at``."""
        proposal = lease.proposal
        at = proposal.start_at if ended_at is None else ended_at
        return LeaseFailure(lease, host.public_key, reason, float(at))

    def nonpayment(self, host: NodeIdentity, lease: Lease, *, seq: int = 0) -> NonPayment:
        """The host's claim that ``lease``'s consumer left its first receipt (the first
        tenth of the lease, receipt ``seq``) uncountersigned."""
        proposal = lease.proposal
        end = proposal.start_at + proposal.duration_s / 10
        receipt = self._receipt(lease, seq, proposal.start_at, end)
        return NonPayment(lease, host.public_key, seal_message(host, receipt, now=end))

    def served(
        self, host: NodeIdentity, requester: NodeIdentity, *, now: float, honest: bool = False
    ) -> Envelope:
        """``host``'s signed statement that it served ``requester`` a piece: the bytes
        asked for when ``honest``, other bytes otherwise."""
        name = bytes(range(32))
        sent = name if honest else bytes(reversed(name))
        statement = BlobServed(name, sent, peer(requester), float(now))
        return seal_served(host, statement, nonce=self.nonce())

    def bad_blob(self, host: NodeIdentity, requester: NodeIdentity, *, now: float) -> BadBlob:
        """Evidence that ``host`` served ``requester`` other bytes than asked for."""
        return BadBlob(self.served(host, requester, now=now))

    def offer(
        self,
        host: NodeIdentity,
        *,
        now: float,
        perf_units: int,
        offer_id: str = "gpu0",
        nonce: int = 1,
    ) -> Envelope:
        """A host-signed offer claiming ``perf_units``."""
        offer = Offer(
            peer(host),
            offer_id,
            "RTX 4090",
            24_576,
            perf_units,
            8,
            1000,
            60,
            "",
            float(now),
            float(now) + 3600.0,
            nonce,
        )
        return seal_message(host, offer, now=float(now))

    def report(
        self,
        reporter: NodeIdentity,
        host: str,
        evidence: Evidence,
        *,
        now: float,
        ttl: float = 600.0,
    ) -> Envelope:
        """``evidence`` about ``host`` in a report signed by ``reporter``."""
        report = Report(peer(reporter), host, evidence, float(now), float(now) + ttl, self.nonce())
        return seal_report(reporter, report, now=float(now))
