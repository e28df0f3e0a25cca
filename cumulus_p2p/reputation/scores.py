"""Per-host Bayesian reliability scores from locally held evidence. Sans-IO.

Theory of operation
-------------------
A host's reliability is the unknown chance that paid work on it completes. We model
it as ``Beta(a, b)``: the prior ``Beta(prior_mean * w, (1 - prior_mean) * w)`` with a
small weight ``w`` (a newcomer starts neutral-low and is quickly moved by evidence),
plus pseudo-observations from evidence:

- receipted service adds successes, one per ``volume_unit`` share-seconds (paid
  volume, so a minute of one share counts far less than a day of eight);
- a failed lease adds failures for the *unserved* part only (lease volume minus
  what receipts cover), times ``failure_penalty`` because a dropped lease costs the
  consumer its work, not just its time; receipts that cover the whole lease void a
  failure claim;
- heartbeat and performance observations add ``heartbeat_weight`` or
  ``performance_weight`` split by their ratio (answered/expected, measured/claimed);
- a bad blob (a host's signed word that it served other bytes than asked for) adds
  ``bad_blob_weight`` failures;
- a lease its consumer did not pay for adds ``nonpayment_weight`` failures to the
  *consumer's* score (hosts read it to refuse chronic non-payers), unless a service
  record shows that receipt countersigned after all.

Each contribution is multiplied by ``0.5 ** (age / half_life_s)``, so old behaviour
fades and a host can neither coast on nor be haunted by its distant past, and by the
credibility of the peer vouching for it (``trust.py``), so reports from identities
nobody paid or was paid by count for nothing.

Ranking uses the posterior's lower ``lower_quantile`` quantile, not its mean: a host
with three good leases and one with three thousand may have the same mean, but only
the second has earned a high lower bound. The quantile is computed exactly (regularised
incomplete beta, bisection), so adding a success never lowers it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .._errors import InvalidMessageError
from .evidence import EvidenceKind, Finding

__all__ = [
    "HostScore",
    "Outcome",
    "ScoringPolicy",
    "beta_score",
    "decay_factor",
    "outcomes",
    "score_hosts",
    "trust_edges",
]

_DAY = 86_400.0


@dataclass(frozen=True, slots=True)
class ScoringPolicy:
    """How evidence becomes a score.

    Attributes:
        prior_mean: A newcomer's expected reliability.
        prior_weight: The prior's strength, in pseudo-observations.
        half_life_s: Age at which evidence counts half.
        volume_unit: Share-seconds that make one pseudo-observation (one share-hour).
        failure_penalty: Weight of an unserved share-second relative to a served one.
        heartbeat_weight: Pseudo-observations one heartbeat window is worth.
        performance_weight: Pseudo-observations one performance measurement is worth.
        nonpayment_weight: Failures one unpaid lease adds to its consumer's score.
        bad_blob_weight: Failures one bad blob adds to the score of the host that served it.
        lower_quantile: The posterior quantile used as ``lower_bound`` for ranking.
    """

    prior_mean: float = 0.45
    prior_weight: float = 2.0
    half_life_s: float = 14 * _DAY
    volume_unit: float = 3600.0
    failure_penalty: float = 2.0
    heartbeat_weight: float = 0.25
    performance_weight: float = 1.0
    nonpayment_weight: float = 2.0
    bad_blob_weight: float = 4.0
    lower_quantile: float = 0.05

    def __post_init__(self) -> None:
        if not 0.0 < self.prior_mean < 1.0 or not self.prior_weight > 0.0:
            raise InvalidMessageError("prior_mean must be in (0, 1), prior_weight positive")
        if not self.half_life_s > 0.0 or not self.volume_unit > 0.0:
            raise InvalidMessageError("half_life_s and volume_unit must be positive")
        weights = (
            self.failure_penalty,
            self.heartbeat_weight,
            self.performance_weight,
            self.nonpayment_weight,
            self.bad_blob_weight,
        )
        if any(not w >= 0.0 for w in weights):
            raise InvalidMessageError("evidence weights must be non-negative")
        if not 0.0 < self.lower_quantile < 0.5:
            raise InvalidMessageError("lower_quantile must be in (0, 0.5)")


@dataclass(frozen=True, slots=True)
class HostScore:
    """A host's posterior reliability.

    Attributes:
        host: The host's peer ID.
        mean: Posterior mean, in [0, 1].
        lower_bound: Posterior ``lower_quantile`` quantile, in [0, mean]; rank on this.
        std: Posterior standard deviation.
        evidence_weight: Pseudo-observations from evidence (after decay and
            credibility); 0 for a host known only by its prior.
        successes: The success part of ``evidence_weight``.
        failures: The failure part of ``evidence_weight``.
    """

    host: str
    mean: float
    lower_bound: float
    std: float
    evidence_weight: float
    successes: float
    failures: float


@dataclass(frozen=True, slots=True)
class Outcome:
    """One finding as decayed pseudo-observations, before credibility.

    Attributes:
        host: The host it is about.
        credited: The peer whose credibility weighs it.
        good: Success pseudo-observations.
        bad: Failure pseudo-observations.
        paid: Whether it is backed by a lease (it then forms trust-graph edges).
    """

    host: str
    credited: str
    good: float
    bad: float
    paid: bool


def decay_factor(age_s: float, half_life_s: float) -> float:
    """Return ``0.5 ** (age / half_life)``; evidence from the future counts fully."""
    return 0.5 ** (max(0.0, age_s) / half_life_s)


def outcomes(findings: Iterable[Finding], *, now: float, policy: ScoringPolicy) -> list[Outcome]:
    """Turn checked findings into weighted outcomes.

    Args:
        findings: The evidence held (at most one finding per evidence id).
        now: The current Unix time.
        policy: The weights.
    """
    served_until: dict[bytes, float] = {}
    pending: list[Finding] = []
    result: list[Outcome] = []
    for f in findings:
        if f.kind is EvidenceKind.SERVICE:
            served_until[f.lease_key] = max(f.served_until, served_until.get(f.lease_key, 0.0))
            good = f.served / policy.volume_unit
            result.append(_outcome(f, good, 0.0, now, policy))
        elif f.kind in (EvidenceKind.FAILURE, EvidenceKind.NONPAYMENT):
            pending.append(f)  # needs every receipt first, to clip or void the claim
        elif f.kind is EvidenceKind.BADBLOB:
            result.append(_outcome(f, 0.0, policy.bad_blob_weight, now, policy))
        else:
            weight = (
                policy.heartbeat_weight
                if f.kind is EvidenceKind.HEARTBEAT
                else policy.performance_weight
            )
            result.append(_outcome(f, weight * f.ratio, weight * (1.0 - f.ratio), now, policy))
    for f in pending:
        if f.kind is EvidenceKind.NONPAYMENT:
            if served_until.get(f.lease_key, 0.0) < f.served_until:  # else: it was paid
                result.append(_outcome(f, 0.0, policy.nonpayment_weight, now, policy))
            continue
        stopped = max(f.served_until, served_until.get(f.lease_key, 0.0))
        lost = max(0.0, f.lease_end - stopped) * f.lease_shares
        result.append(
            _outcome(f, 0.0, lost / policy.volume_unit * policy.failure_penalty, now, policy)
        )
    return result


def _outcome(f: Finding, good: float, bad: float, now: float, policy: ScoringPolicy) -> Outcome:
    k = decay_factor(now - f.at, policy.half_life_s)
    return Outcome(f.host, f.credited, good * k, bad * k, paid=bool(f.lease_key))


def trust_edges(items: Iterable[Outcome]) -> dict[str, dict[str, float]]:
    """Build the paid-transaction graph ``trust.global_trust`` runs on.

    consumer -> host carries net good service (good minus bad); host -> consumer the
    volume the consumer paid. Heartbeats are unpaid and form no edge.
    """
    edges: dict[str, dict[str, float]] = {}
    for o in items:
        if not o.paid:
            continue
        out = edges.setdefault(o.credited, {})
        out[o.host] = out.get(o.host, 0.0) + o.good - o.bad
        if o.good > 0.0:
            back = edges.setdefault(o.host, {})
            back[o.credited] = back.get(o.credited, 0.0) + o.good
    return edges


def score_hosts(
    items: Iterable[Outcome],
    credibility: Mapping[str, float],
    *,
    policy: ScoringPolicy,
    hosts: Iterable[str] = (),
) -> dict[str, HostScore]:
    """Score every host with evidence, plus each of ``hosts`` (at least its prior).

    Args:
        items: Outcomes from ``outcomes``.
        credibility: Peer to multiplier in [0, 1]; absent peers count zero.
        policy: The prior and quantile.
        hosts: Hosts to include even without evidence.
    """
    tally: dict[str, list[float]] = {host: [0.0, 0.0] for host in hosts}
    for o in items:
        c = min(1.0, max(0.0, credibility.get(o.credited, 0.0)))
        counts = tally.setdefault(o.host, [0.0, 0.0])
        counts[0] += o.good * c
        counts[1] += o.bad * c
    return {host: beta_score(host, s, f, policy) for host, (s, f) in tally.items()}


def beta_score(host: str, successes: float, failures: float, policy: ScoringPolicy) -> HostScore:
    """Return the posterior score after ``successes`` and ``failures`` pseudo-observations.

    Raises:
        InvalidMessageError: A count is negative or not finite.
    """
    if not (math.isfinite(successes) and math.isfinite(failures)) or min(successes, failures) < 0:
        raise InvalidMessageError("successes and failures must be finite and non-negative")
    a = policy.prior_mean * policy.prior_weight + successes
    b = (1.0 - policy.prior_mean) * policy.prior_weight + failures
    n = a + b
    mean = a / n
    std = math.sqrt(a * b / (n * n * (n + 1.0)))
    lower = min(mean, _beta_quantile(policy.lower_quantile, a, b))
    return HostScore(host, mean, lower, std, successes + failures, successes, failures)


def _beta_quantile(q: float, a: float, b: float) -> float:
    # Bisection on the CDF: slower than Newton but monotone in a and b by construction.
    lo, hi = 0.0, 1.0
    for _ in range(48):
        mid = 0.5 * (lo + hi)
        if _beta_cdf(mid, a, b) < q:
            lo = mid
        else:
            hi = mid
    return lo


def _beta_cdf(x: float, a: float, b: float) -> float:
    """Regularised incomplete beta I_x(a, b) (continued fraction, Lentz's method)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_cf(x, a, b) / a
    return 1.0 - math.exp(log_front) * _beta_cf(1.0 - x, b, a) / b


def _beta_cf(x: float, a: float, b: float) -> float:
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        for numerator in _cf_terms(m, x, a, b):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            delta = d * c
            h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return h


def _cf_terms(m: int, x: float, a: float, b: float) -> tuple[float, float]:
    even = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
    odd = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
    return even, odd
