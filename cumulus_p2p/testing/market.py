"""Market message fixtures shared by the specs: terms a consumer proposes to a host."""

from __future__ import annotations

from ..identity import NodeIdentity
from ..market.messages import LeaseProposal, PriorityClass


def lease_proposal(
    consumer: NodeIdentity,
    host: NodeIdentity,
    *,
    start_at: float,
    duration_s: int,
    lease_id: str = "L1",
    offer_id: str = "gpu0",
    shares: int = 1,
    price: int = 1000,
    expires_at: float | None = None,
    nonce: int = 1,
) -> LeaseProposal:
    """An on-demand proposal from ``consumer`` to ``host`` for offer nonce 1.

    It expires 30 s after it starts unless ``expires_at`` says otherwise.
    """
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
        priority=PriorityClass.ON_DEMAND,
        expires_at=start_at + 30 if expires_at is None else expires_at,
        nonce=nonce,
    )
