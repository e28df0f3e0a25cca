"""Reporter credibility: EigenTrust over the graph of paid transactions. Sans-IO.

Theory of operation
-------------------
Anyone can mint identities, so a report cannot count for its author's say-so. What
cannot be minted for free is a doubly signed lease with countersigned receipts: real
usage that one party paid the other for. We therefore build a directed graph from the
evidence a node holds:

- consumer -> host, weighted by the host's net good service to that consumer
  (receipted volume minus penalised unserved volume, floored at zero), and
- host -> consumer, weighted by the volume the consumer paid that host,

each decayed with age. Normalising each node's out-edges gives EigenTrust's local
trust matrix ``C``. Global trust is the stationary vector of a random walk that follows
``C`` and, with probability ``alpha`` at every step, jumps back to the *pre-trusted*
set ``P`` (this node itself and the peers it has transacted with directly):

    t = (1 - alpha) * C^T t + alpha * p,     p uniform over P.

A peer with no out-edges hands its mass back to ``p`` (EigenTrust's rule), so mass is
conserved. Why this resists Sybils: trust reaches a node only along paid edges from
``P``. A crowd of fresh identities that lease among themselves forms a component with
no edge from ``P``; its trust is exactly zero however much volume it fakes. An attacker
who buys real service from an honest host gets at most a share of that host's trust,
in proportion to what it paid, which is the classic attack-edge bound. Failure claims
add no edge at all, so smearing a host does not earn the smearer anything.

Credibility, the multiplier applied to a report, is trust relative to the teleport
mass each pre-trusted peer receives (``alpha / |P|``), capped at 1: pre-trusted peers
count fully, peers one paid hop away count in proportion to the trust flowing to
them, and unreachable peers count zero.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .._errors import InvalidMessageError

__all__ = ["TrustPolicy", "credibility", "global_trust"]


@dataclass(frozen=True, slots=True)
class TrustPolicy:
    """EigenTrust parameters.

    Attributes:
        alpha: Probability of jumping back to the pre-trusted set at each step; higher
            values trust the local view more and the wider graph less.
        max_iterations: Bound on power iterations (the graph is bounded by the store).
        tolerance: L1 change at which iteration stops.
    """

    alpha: float = 0.15
    max_iterations: int = 100
    tolerance: float = 1e-10

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise InvalidMessageError("TrustPolicy.alpha must be in (0, 1]")
        if self.max_iterations < 1 or not self.tolerance > 0.0:
            raise InvalidMessageError("TrustPolicy needs max_iterations >= 1, tolerance > 0")


def global_trust(
    edges: Mapping[str, Mapping[str, float]],
    pre_trusted: Iterable[str],
    *,
    policy: TrustPolicy | None = None,
) -> dict[str, float]:
    """Return EigenTrust global trust for every node in the graph or in ``pre_trusted``.

    Args:
        edges: ``edges[i][j]`` is i's non-negative local trust in j (unnormalised).
            Self-edges and non-positive weights are ignored.
        pre_trusted: The seed peers; must not be empty.
        policy: Parameters; the defaults if omitted.

    Returns:
        Trust per peer; the values sum to 1.

    Raises:
        InvalidMessageError: ``pre_trusted`` is empty.
    """
    policy = policy or TrustPolicy()
    seeds = sorted(set(pre_trusted))
    if not seeds:
        raise InvalidMessageError("global_trust needs at least one pre-trusted peer")
    rows = _normalised_rows(edges)
    seed = {peer: 1.0 / len(seeds) for peer in seeds}
    trust = dict(seed)
    for _ in range(policy.max_iterations):
        step = _step(rows, trust, seed, policy.alpha)
        change = sum(abs(step.get(k, 0.0) - trust.get(k, 0.0)) for k in step.keys() | trust)
        trust = step
        if change < policy.tolerance:
            break
    return trust


def credibility(
    trust: Mapping[str, float], pre_trusted: Iterable[str], *, policy: TrustPolicy | None = None
) -> dict[str, float]:
    """Turn global trust into report multipliers in [0, 1].

    Args:
        trust: Output of ``global_trust``.
        pre_trusted: The same seed set.
        policy: The same parameters.

    Returns:
        Credibility per peer with non-zero trust; pre-trusted peers get 1. Peers absent
        from the result have credibility 0.
    """
    policy = policy or TrustPolicy()
    seeds = set(pre_trusted)
    floor = policy.alpha / max(1, len(seeds))
    result = {peer: min(1.0, t / floor) for peer, t in trust.items() if t > 0.0}
    result.update(dict.fromkeys(seeds, 1.0))
    return result


def _normalised_rows(edges: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, float]]:
    rows: dict[str, dict[str, float]] = {}
    for src, outs in edges.items():
        kept = {dst: w for dst, w in outs.items() if dst != src and w > 0.0}
        total = sum(kept.values())
        if total > 0.0:
            rows[src] = {dst: w / total for dst, w in kept.items()}
    return rows


def _step(
    rows: Mapping[str, Mapping[str, float]],
    trust: Mapping[str, float],
    seed: Mapping[str, float],
    alpha: float,
) -> dict[str, float]:
    # Mass of nodes without out-edges returns to the seed, so the total stays 1.
    dangling = sum(t for peer, t in trust.items() if peer not in rows)
    nxt = {peer: (alpha + (1.0 - alpha) * dangling) * s for peer, s in seed.items()}
    for src, t in trust.items():
        row = rows.get(src)
        if row is None or t == 0.0:
            continue
        for dst, w in row.items():
            nxt[dst] = nxt.get(dst, 0.0) + (1.0 - alpha) * t * w
    return nxt
