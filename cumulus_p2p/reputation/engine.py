"""``Reputation``: one node's reputation core, wiring intake, store, trust and scores.

Sans-IO: bytes and the time go in, verdicts and scores come out. The shell that
gossips reports feeds ``receive(raw, now=...)`` and hands ``scores_for_matcher`` to
``market.rank_offers``.

Intake order matters: the envelope is checked without recording its nonce, then the
report and its evidence, then the store is asked whether it would keep the finding;
only when everything passes is the nonce recorded and the finding stored. A refused
report therefore changes nothing, not even the replay memory.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from .._errors import InvalidEvidenceError, MalformedMessageError, ReportRejectedError
from ..envelope import Envelope, EnvelopeValidator, Rejected, Rejection
from .evidence import REPORT_KIND, Finding, Report, open_report
from .scores import HostScore, ScoringPolicy, beta_score, outcomes, score_hosts, trust_edges
from .store import AddStatus, EvidenceStore
from .trust import TrustPolicy, credibility, global_trust

__all__ = ["Accepted", "Refused", "ReportRefusal", "Reputation"]


class ReportRefusal(enum.Enum):
    """Why a report was refused."""

    ENVELOPE = "the envelope was rejected"
    MALFORMED = "the report is malformed"
    INVALID_EVIDENCE = "the evidence does not check"
    DUPLICATE = "the evidence is already held"
    TOO_OLD = "the evidence is older than the store keeps"
    QUOTA = "the reporter or host is over its quota"

    @property
    def is_peer_fault(self) -> bool:
        """Whether the sender deserves blame (duplicates are normal gossip echoes)."""
        return self in (ReportRefusal.MALFORMED, ReportRefusal.INVALID_EVIDENCE)


@dataclass(frozen=True, slots=True)
class Accepted:
    """A report that was stored (or superseded an older version of its evidence)."""

    report: Report
    finding: Finding
    status: AddStatus


@dataclass(frozen=True, slots=True)
class Refused:
    """A refused report: the reason, a sentence for logs, and the envelope's rejection
    reason when the envelope itself failed (bad signature, replayed, expired, ...)."""

    reason: ReportRefusal
    detail: str
    envelope_reason: Rejection | None = None

    def to_error(self) -> ReportRejectedError:
        """Return the matching ``ReportRejectedError``."""
        return ReportRejectedError(self.reason, self.detail)


_STORE_REFUSALS = {
    AddStatus.DUPLICATE: ReportRefusal.DUPLICATE,
    AddStatus.TOO_OLD: ReportRefusal.TOO_OLD,
    AddStatus.QUOTA: ReportRefusal.QUOTA,
}


class Reputation:
    """A node's view of every host's reliability.

    Args:
        me: This node's peer ID; always pre-trusted.
        pre_trusted: Peers this node has transacted with itself (more may be added).
        scoring: Scoring parameters.
        trust: EigenTrust parameters.
        store: The evidence store; a default-sized one if omitted.
        validator: Envelope validator for reports; one accepting ``REPORT_KIND``
            if omitted.
    """

    def __init__(
        self,
        me: str,
        *,
        pre_trusted: Iterable[str] = (),
        scoring: ScoringPolicy | None = None,
        trust: TrustPolicy | None = None,
        store: EvidenceStore | None = None,
        validator: EnvelopeValidator | None = None,
    ) -> None:
        self._me = me
        self._pre_trusted = {me, *pre_trusted}
        self._scoring = scoring or ScoringPolicy()
        self._trust = trust or TrustPolicy()
        self._store = store if store is not None else EvidenceStore()
        self._validator = validator or EnvelopeValidator([REPORT_KIND])

    @property
    def store(self) -> EvidenceStore:
        """The evidence store (read it; add through ``receive``)."""
        return self._store

    @property
    def policy(self) -> ScoringPolicy:
        """The scoring parameters."""
        return self._scoring

    def add_pre_trusted(self, peer: str) -> None:
        """Seed trust with ``peer``: call after transacting with it directly."""
        self._pre_trusted.add(peer)

    def receive(self, raw: bytes, *, now: float) -> Accepted | Refused:
        """Check and store a report received as envelope bytes.

        Args:
            raw: The envelope's wire bytes, as received.
            now: The current Unix time.

        Returns:
            ``Accepted``, or ``Refused`` with a reason; a refusal changes nothing.
        """
        checked = self._validator.validate(raw, now=now, remember=False)
        if isinstance(checked, Rejected):
            return Refused(ReportRefusal.ENVELOPE, checked.detail, checked.reason)
        return self._admit(checked, now)

    def receive_envelope(self, envelope: Envelope, *, now: float) -> Accepted | Refused:
        """Like ``receive`` for an envelope already decoded (a local report, a relay)."""
        checked = self._validator.validate_envelope(envelope, now=now, remember=False)
        if isinstance(checked, Rejected):
            return Refused(ReportRefusal.ENVELOPE, checked.detail, checked.reason)
        return self._admit(checked, now)

    def _admit(self, envelope: Envelope, now: float) -> Accepted | Refused:
        try:
            report, finding = open_report(envelope)
        except MalformedMessageError as exc:
            return Refused(ReportRefusal.MALFORMED, str(exc))
        except InvalidEvidenceError as exc:
            return Refused(ReportRefusal.INVALID_EVIDENCE, str(exc))
        status = self._store.would_add(finding, now=now)
        if status in _STORE_REFUSALS:
            return Refused(_STORE_REFUSALS[status], status.value)
        remembered = self._validator.validate_envelope(envelope, now=now, remember=True)
        if isinstance(remembered, Rejected):  # the replay cache filled up meanwhile
            return Refused(ReportRefusal.ENVELOPE, remembered.detail, remembered.reason)
        return Accepted(report, finding, self._store.add(finding, now=now))

    def check(self, raw: bytes, *, now: float) -> Accepted:
        """Like ``receive``, but raise on refusal.

        Raises:
            ReportRejectedError: The report was refused; ``reason`` says why.
        """
        result = self.receive(raw, now=now)
        if isinstance(result, Refused):
            raise result.to_error()
        return result

    def expire(self, now: float) -> int:
        """Forget expired evidence and replay nonces; return how many findings went."""
        self._validator.expire(now)
        return self._store.expire(now)

    def credibility(self, *, now: float) -> dict[str, float]:
        """Return each reporter's credibility in [0, 1] (absent peers: 0)."""
        items = outcomes(self._store.findings(), now=now, policy=self._scoring)
        return self._credibility(trust_edges(items))

    def scores(self, *, now: float, hosts: Iterable[str] = ()) -> dict[str, HostScore]:
        """Score every host with evidence, plus ``hosts`` (which get at least the prior)."""
        return self.scores_and_credibility(now=now, hosts=hosts)[0]

    def scores_and_credibility(
        self, *, now: float, hosts: Iterable[str] = ()
    ) -> tuple[dict[str, HostScore], dict[str, float]]:
        """``scores`` and ``credibility`` from one pass over the evidence."""
        items = outcomes(self._store.findings(), now=now, policy=self._scoring)
        cred = self._credibility(trust_edges(items))
        return score_hosts(items, cred, policy=self._scoring, hosts=hosts), cred

    def score(self, host: str, *, now: float) -> HostScore:
        """Return one host's score (the prior if nothing is known)."""
        return self.scores(now=now, hosts=[host])[host]

    def prior(self) -> HostScore:
        """The score of a host nobody has evidence about."""
        return beta_score("", 0.0, 0.0, self._scoring)

    def scores_for_matcher(self, hosts: Iterable[str] = (), *, now: float) -> dict[str, float]:
        """Return ``{host: lower_bound}`` for ``market.rank_offers(reliability=...)``.

        Pass the book's hosts as ``hosts`` so unknown hosts get the prior's lower bound
        rather than the matcher's ``neutral_reliability``; or set
        ``RankingPolicy(neutral_reliability=reputation.prior().lower_bound)``.
        """
        return {h: s.lower_bound for h, s in self.scores(now=now, hosts=hosts).items()}

    def _credibility(self, edges: dict[str, dict[str, float]]) -> dict[str, float]:
        trust = global_trust(edges, self._pre_trusted, policy=self._trust)
        return credibility(trust, self._pre_trusted, policy=self._trust)
