"""Market message fixtures shared by the specs: terms a consumer proposes to a host."""

from __future__ import annotations

from ..identity import NodeIdentity
from ..market.messages import LeaseKind, LeaseProposal, PriorityClass


def lease_proposal(
    consumer: NodeIdentity,
    host: NodeIdentity,
    *,
    start_at: float,
    duration_s: int,
    lease_id: str = "L1",
    offer_id: str = "gpu0",
    shares: int | None = None,
    price: int = 1000,
    expires_at: float | None = None,
    nonce: int = 1,
    storage_gib: int = 0,
    priority: PriorityClass = PriorityClass.ON_DEMAND,
) -> LeaseProposal:
    """A proposal (on-demand unless ``priority`` says) from ``consumer`` to ``host`` for
    offer nonce 1.

    It expires 30 s after it starts unless ``expires_at`` says otherwise. With
    ``storage_gib`` it is a standby lease of that many GiB (and no shares); otherwise a
    compute lease of ``shares`` (1 unless given).
    """
    kind = LeaseKind.STANDBY if storage_gib else LeaseKind.COMPUTE
    if shares is None:
        shares = 0 if storage_gib else 1
    return LeaseProposal(
        lease_id=lease_id,
        consumer=consumer.peer_id.to_base58(),
        host=host.peer_id.to_base58(),
        offer_id=offer_id,
        offer_nonce=1,
        shares=shares,
        price=price,
        start_at=start_at,
        duration_s=duration_s,
        priority=priority,
        expires_at=start_at + 30 if expires_at is None else expires_at,
        nonce=nonce,
        kind=kind,
        storage_gib=storage_gib,
    )
