"""Reputation: evidence, per-host scores and Sybil-resistant aggregation. Sans-IO.

Parts, lowest first (each imports only those above it):

- ``evidence``: the typed, self-checking evidence records (``ServiceRecord``,
  ``LeaseFailure``, ``HeartbeatObservation``, ``PerformanceObservation``, ``NonPayment``,
  ``BadBlob``), the signed
  ``Report`` that carries one about a host (envelope kind ``REPORT_KIND``), its
  canonical msgpack codec, and ``seal_report``/``open_report``. ``Report.check``
  verifies every signature and returns a ``Finding``: the plain facts.
- ``served``: ``BlobServed``, the statement a host signs for each blob it serves
  another host; a false one becomes ``BadBlob`` evidence.
- ``store``: ``EvidenceStore``, findings deduplicated by evidence id, bounded by
  per-peer quotas and a global cap, expired by age.
- ``trust``: EigenTrust over the paid-transaction graph, seeded by pre-trusted peers:
  reporter ``credibility`` in [0, 1]. Its module docstring explains the Sybil argument.
- ``scores``: ``ScoringPolicy``, the Beta-posterior ``HostScore`` (mean, lower credible
  bound, evidence weight), volume weighting and exponential decay.
- ``engine``: ``Reputation``, one node's core: ``receive(raw, now=...)`` ->
  ``Accepted | Refused`` (a refusal changes nothing), ``scores(now=...)`` and
  ``scores_for_matcher(hosts, now=...)`` for ``market.rank_offers(reliability=...)``.

Nothing here reads a clock or does I/O: times are passed in. The gossip shell that
carries reports lives with the mesh; ``simulations/attacks.py`` drives these
same cores with a simulated population.
"""

from .engine import Accepted as Accepted
from .engine import Refused as Refused
from .engine import ReportRefusal as ReportRefusal
from .engine import Reputation as Reputation
from .evidence import MAX_RECEIPTS as MAX_RECEIPTS
from .evidence import REPORT_KIND as REPORT_KIND
from .evidence import BadBlob as BadBlob
from .evidence import Evidence as Evidence
from .evidence import EvidenceKind as EvidenceKind
from .evidence import FailureReason as FailureReason
from .evidence import Finding as Finding
from .evidence import HeartbeatObservation as HeartbeatObservation
from .evidence import LeaseFailure as LeaseFailure
from .evidence import NonPayment as NonPayment
from .evidence import PerformanceObservation as PerformanceObservation
from .evidence import Report as Report
from .evidence import ServiceRecord as ServiceRecord
from .evidence import decode_report as decode_report
from .evidence import encode_report as encode_report
from .evidence import open_report as open_report
from .evidence import seal_report as seal_report
from .scores import HostScore as HostScore
from .scores import Outcome as Outcome
from .scores import ScoringPolicy as ScoringPolicy
from .scores import beta_score as beta_score
from .scores import decay_factor as decay_factor
from .scores import outcomes as outcomes
from .scores import score_hosts as score_hosts
from .scores import trust_edges as trust_edges
from .store import AddStatus as AddStatus
from .store import EvidenceStore as EvidenceStore
from .store import StoreStatistics as StoreStatistics
from .trust import TrustPolicy as TrustPolicy
from .trust import credibility as credibility
from .trust import global_trust as global_trust
