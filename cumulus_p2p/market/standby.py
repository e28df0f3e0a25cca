"""The consumer's choice of a standby host, and its standby lease proposal. Sans-IO.

A session's checkpoints are kept on a second host, the *standby*, which only stores
blobs: the consumer leases disk there (a ``LeaseKind.STANDBY`` lease), priced per
GiB-hour at the offer's ``storage_price``. The standby must not be the session's own
host (a host that fails takes its disk with it), must have ``gib`` free
(``Offer.storage_gib``, what the host has left after its other standby leases) and
must ask no more than the consumer's limit.

``choose_standby`` ranks the offers that qualify as the compute choice does
(``matcher.effective_price``): the storage price adjusted by the host's reliability,
so a reliable host at a slightly higher price can come before an unknown one. One
offer per host: a host's offers share one disk, so they carry the same storage terms.
``standby_proposal`` builds the proposal for the chosen offer; seal it with
``seal_message`` and send it with ``call_propose_lease``, as a compute proposal.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from .matcher import RankingPolicy, effective_price
from .messages import LeaseKind, LeaseProposal, Offer, PriorityClass

__all__ = ["choose_standby", "standby_proposal"]


def choose_standby(
    offers: Iterable[Offer],
    *,
    exclude: str,
    gib: int,
    max_price: int,
    now: float,
    scores: Mapping[str, float] | None = None,
    duration_s: int | None = None,
    usable: Callable[[str], bool] | None = None,
    policy: RankingPolicy | None = None,
    limit: int = 10,
) -> list[Offer]:
    """The offers a standby of ``gib`` GiB may be leased from, best first.

    Args:
        offers: Offers seen (e.g. ``r.order for r in book.offers()``).
        exclude: The session's own host, never its standby.
        gib: GiB the standby must keep; offers with less free are skipped.
        max_price: Most micro-credits per GiB-hour the consumer pays.
        now: The current time; expired offers are skipped.
        scores: Host peer ID to reliability in [0, 1] (``scores_for_matcher``); missing
            hosts get ``policy.neutral_reliability``.
        duration_s: The standby lease's length; offers whose ``min_lease_s`` is longer
            are skipped. ``None``: not checked.
        usable: Whether a host may be tried now (the job's ``HostChoice``, liveness);
            ``None``: every host.
        policy: The reliability weights (latency is not weighed); the defaults if
            omitted.
        limit: How many offers to return.

    Returns:
        At most ``limit`` offers, one per host, lowest reliability-adjusted storage
        price first; ties go to the lower asking price, then the more reliable host,
        then the host's and offer's ids, so the order is deterministic.

    Raises:
        ValueError: ``gib`` is below 1.
    """
    if gib < 1:
        raise ValueError(f"a standby keeps at least 1 GiB, not {gib}")
    policy = policy or RankingPolicy()
    scores = scores or {}
    best: dict[str, tuple[tuple[float, int, float, str, str], Offer]] = {}
    for offer in offers:
        if (
            offer.host == exclude
            or offer.storage_gib < gib
            or offer.storage_price > max_price
            or offer.expires_at <= now
            or (duration_s is not None and offer.min_lease_s > duration_s)
            or (usable is not None and not usable(offer.host))
        ):
            continue
        score = min(1.0, max(0.0, scores.get(offer.host, policy.neutral_reliability)))
        price = effective_price(
            offer.storage_price, reliability=score, latency_ms=0.0, policy=policy
        )
        key = (price, offer.storage_price, -score, offer.host, offer.offer_id)
        held = best.get(offer.host)
        if held is None or key < held[0]:
            best[offer.host] = (key, offer)
    ranked = sorted(best.values(), key=lambda row: row[0])
    return [offer for _, offer in ranked[:limit]]


def standby_proposal(
    offer: Offer,
    *,
    consumer: str,
    lease_id: str,
    gib: int,
    start_at: float,
    duration_s: int,
    expires_at: float,
    nonce: int,
    price: int | None = None,
    priority: PriorityClass = PriorityClass.ON_DEMAND,
) -> LeaseProposal:
    """The proposal to lease ``gib`` GiB of ``offer``'s host as a standby.

    Args:
        offer: The offer chosen (``choose_standby``).
        consumer: This consumer's peer ID (base58).
        lease_id: A fresh, unique id (e.g. ``secrets.token_hex(16)``).
        gib: GiB to keep.
        start_at: Lease start (now, within the host's skew).
        duration_s: Lease length, seconds.
        expires_at: When the proposal lapses unanswered.
        nonce: This consumer's next nonce.
        price: Micro-credits per GiB-hour; the offer's ``storage_price`` if omitted.
        priority: ``ON_DEMAND`` unless told otherwise.

    Raises:
        InvalidMessageError: A field is out of range (``gib`` below 1, say).
    """
    return LeaseProposal(
        lease_id,
        consumer,
        offer.host,
        offer.offer_id,
        offer.nonce,
        0,
        offer.storage_price if price is None else price,
        start_at,
        duration_s,
        priority,
        expires_at,
        nonce,
        LeaseKind.STANDBY,
        gib,
    )
