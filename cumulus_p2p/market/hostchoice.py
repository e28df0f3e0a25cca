"""The consumer's choice of host after a failure (sans-IO): whom to try, when, how long.

Theory of operation
-------------------
A host that drops a session has given evidence against itself, not a verdict. On a
finite pool with churn every host fails sooner or later, so a job that banned each host
after one failure would run out of hosts however long the pool stays healthy. Instead:

- Each failure adds one unit of *evidence* against the host. Evidence halves every
  ``half_life_s``, so a host that failed an hour ago weighs little and a host that
  fails again and again weighs a lot.
- A failed host is *set aside* for a backoff that grows with its evidence:
  ``base_s * factor ** (evidence - 1)``, at most ``max_s``.
- It may be tried again only once its backoff is over *and* it has announced a fresh
  offer: one with a newer nonce than any seen from it before the failure. An offer
  still resting in the book from before is the dead host's, not the rebooted one's.
- A host that said it was leaving is set aside, without evidence, until it announces
  again. A host caught misrepresenting its device or overcharging is banned for the
  job: that is signed evidence, judged by reputation, not a matter of time.

Each host's standing is a small state machine whose transitions are data
(``TRANSITIONS``), after h11's ``_state.py``; the end of a backoff is an event like any
other, applied when time is passed in. The job itself has a state too (``JobState``):
a job whose pool is momentarily empty is *waiting*, not dead, until ``patience`` runs
out.

The shell (``node/consumer.py``; ``simulation/jobs.py`` in the simulations) feeds in
events with the time (``see_offer``, ``failed``, ``left``, ``ban``, ``leased``) and asks
``next_step`` what to do: ``Propose`` to these hosts, in this order; ``Wait``; or
``GiveUp``. Nothing here reads a clock or does I/O.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from .._errors import LocalProtocolError


class HostStanding(enum.Enum):
    """Whether a host may be tried, and if not, what it waits for."""

    #: May be tried.
    WELCOME = "welcome"
    #: Failed; its backoff runs and it has not announced since.
    COOLING = "cooling"
    #: Failed, and back with a fresh offer; its backoff still runs.
    RETURNED = "returned"
    #: Its backoff is over (or it left): it waits to announce a fresh offer.
    SILENT = "silent"
    #: Misrepresented its device or overcharged: never again in this job.
    BANNED = "banned"


class HostEvent(enum.Enum):
    FAILED = "failed"
    LEFT = "left"
    #: An offer with a newer nonce than any seen before the host was set aside.
    OFFERED = "offered"
    BACKOFF_ENDED = "backoff ended"
    BANNED = "banned"


_S, _E = HostStanding, HostEvent
#: Every standing's moves; an event missing from a row leaves the standing as it is.
TRANSITIONS: dict[HostStanding, dict[HostEvent, HostStanding]] = {
    _S.WELCOME: {_E.FAILED: _S.COOLING, _E.LEFT: _S.SILENT, _E.BANNED: _S.BANNED},
    _S.COOLING: {
        _E.FAILED: _S.COOLING,
        _E.LEFT: _S.COOLING,
        _E.OFFERED: _S.RETURNED,
        _E.BACKOFF_ENDED: _S.SILENT,
        _E.BANNED: _S.BANNED,
    },
    _S.RETURNED: {
        _E.FAILED: _S.COOLING,
        _E.LEFT: _S.COOLING,
        _E.BACKOFF_ENDED: _S.WELCOME,
        _E.BANNED: _S.BANNED,
    },
    _S.SILENT: {
        _E.FAILED: _S.COOLING,
        _E.LEFT: _S.SILENT,
        _E.OFFERED: _S.WELCOME,
        _E.BANNED: _S.BANNED,
    },
    _S.BANNED: {},
}


class JobState(enum.Enum):
    """Where the job stands in finding a host."""

    STARTING = "starting"
    SEARCHING = "searching"
    #: No host is usable now; the job is held (its state is safe in its checkpoints).
    WAITING = "waiting"
    RUNNING = "running"
    #: No host became usable within the job's patience.
    GAVE_UP = "gave up"


class JobEvent(enum.Enum):
    SEARCH = "search"
    CANDIDATES = "candidates"
    NONE_USABLE = "none usable"
    LEASED = "leased"
    DEADLINE = "deadline"


_J, _JE = JobState, JobEvent
#: The job's moves; an event missing from a row is illegal there.
JOB_TRANSITIONS: dict[JobState, dict[JobEvent, JobState]] = {
    _J.STARTING: {_JE.SEARCH: _J.SEARCHING},
    _J.SEARCHING: {
        _JE.SEARCH: _J.SEARCHING,
        _JE.CANDIDATES: _J.SEARCHING,
        _JE.NONE_USABLE: _J.WAITING,
        _JE.LEASED: _J.RUNNING,
        _JE.DEADLINE: _J.GAVE_UP,
    },
    _J.WAITING: {
        _JE.SEARCH: _J.SEARCHING,
        _JE.CANDIDATES: _J.SEARCHING,
        _JE.NONE_USABLE: _J.WAITING,
        _JE.LEASED: _J.RUNNING,
        _JE.DEADLINE: _J.GAVE_UP,
    },
    _J.RUNNING: {_JE.SEARCH: _J.SEARCHING, _JE.LEASED: _J.RUNNING},
    _J.GAVE_UP: {},
}


@dataclass(frozen=True, slots=True)
class BackoffPolicy:
    """How long a failed host is set aside, and how fast its failures are forgiven.

    Attributes:
        base_s: The backoff after a first failure. A rebooted rig is back and announcing
            within seconds; this keeps a host that crash-loops from taking every failover.
        factor: Growth per unit of evidence.
        max_s: The longest backoff.
        half_life_s: Time for a failure's weight to halve.
    """

    base_s: float = 15.0
    factor: float = 2.0
    max_s: float = 900.0
    half_life_s: float = 600.0

    def __post_init__(self) -> None:
        if not (self.base_s >= 0 and self.factor >= 1 and self.max_s >= self.base_s):
            raise ValueError("need base_s >= 0, factor >= 1 and max_s >= base_s")
        if not self.half_life_s > 0:
            raise ValueError("half_life_s must be positive")

    def backoff_s(self, evidence: float) -> float:
        """The backoff for a host carrying ``evidence`` (at least 1 just after failing)."""
        if math.isinf(self.base_s):
            return math.inf
        return min(self.max_s, self.base_s * self.factor ** max(0.0, evidence - 1.0))

    def decayed(self, evidence: float, elapsed_s: float) -> float:
        return evidence * 0.5 ** (max(0.0, elapsed_s) / self.half_life_s)


#: What the node did before failure became evidence: a host that failed once is never
#: tried again in the job. Kept for the simulations to compare against.
EXCLUDE_FOR_THE_JOB = BackoffPolicy(base_s=math.inf, max_s=math.inf)


@dataclass(frozen=True, slots=True)
class Propose:
    """Propose leases to these hosts, best first, until one grants."""

    hosts: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Wait:
    """No host is usable now: hold the job and ask again later.

    Attributes:
        until: When the first backoff among the matching hosts ends (it may then still
            wait for an offer); None when only new offers can help.
        deadline: When the job gives up.
        reason: What the job waits for, for its status.
    """

    until: float | None
    deadline: float
    reason: str


@dataclass(frozen=True, slots=True)
class GiveUp:
    """The job's patience ran out with no host usable."""

    reason: str


Decision = Propose | Wait | GiveUp


@dataclass(frozen=True, slots=True)
class HostView:
    """One host's standing at a given time, for status."""

    host: str
    standing: HostStanding
    evidence: float
    usable_from: float | None
    reason: str


@dataclass(slots=True)
class _Host:
    standing: HostStanding = HostStanding.WELCOME
    evidence: float = 0.0
    evidence_at: float = 0.0
    until: float = 0.0  # when the backoff ends
    nonce_at_setback: int = -1  # offers up to this nonce are from before the setback
    latest_nonce: int = -1
    reason: str = ""


@dataclass
class HostChoice:
    """One job's memory of its hosts, and its decisions (see the module docstring).

    Args:
        policy: The backoff.
        patience_s: How long a search may go without a usable host before the job gives
            up (``--wait-for-host``).
    """

    policy: BackoffPolicy = BackoffPolicy()
    patience_s: float = 1800.0
    state: JobState = JobState.STARTING
    deadline: float = math.inf
    _searched_for: float = 0.0
    _hosts: dict[str, _Host] = field(default_factory=dict)

    # --- events -------------------------------------------------------------------------

    def see_offer(self, host: str, nonce: int, *, now: float) -> None:
        """An offer from ``host`` with ``nonce`` is in the book (seeing it again is fine)."""
        record = self._advance(host, now)
        record.latest_nonce = max(record.latest_nonce, nonce)
        if nonce > record.nonce_at_setback:
            self._move(record, HostEvent.OFFERED)

    def failed(self, host: str, *, now: float, nonce: int = -1, reason: str = "failed") -> float:
        """``host`` dropped a session, or could not be reached for a lease, or refused or
        ignored a proposal, at ``now``; ``nonce`` is its offer's, if the shell knows one
        newer than any it reported. All its offers are set aside with it: a host that
        floods the book with cheap offers it never honours costs a job one try.

        Returns:
            The backoff it now serves, in seconds.
        """
        record = self._advance(host, now)
        evidence = self.policy.decayed(record.evidence, now - record.evidence_at) + 1.0
        record.evidence, record.evidence_at = evidence, now
        backoff = self.policy.backoff_s(evidence)
        record.until = now + backoff
        record.nonce_at_setback = max(record.latest_nonce, nonce)
        record.reason = reason
        self._move(record, HostEvent.FAILED)
        return backoff

    def left(self, host: str, *, now: float) -> None:
        """``host`` said it was leaving: set aside until it announces again, no blame."""
        record = self._advance(host, now)
        record.nonce_at_setback = record.latest_nonce
        record.reason = "left"
        self._move(record, HostEvent.LEFT)

    def ban(self, host: str, reason: str) -> None:
        """Never try ``host`` again in this job (``reason``: what it did)."""
        record = self._hosts.setdefault(host, _Host())
        record.reason = reason
        self._move(record, HostEvent.BANNED)

    def search(self, *, now: float, patience_s: float | None = None) -> None:
        """The job needs a host from ``now`` on; it gives up ``patience_s`` after (the
        job's own patience by default; the first match may have its own)."""
        self.state = self._job_move(JobEvent.SEARCH)
        self.deadline = now + (self.patience_s if patience_s is None else patience_s)
        self._searched_for = self.deadline - now

    def leased(self, host: str, *, now: float) -> None:
        """``host`` granted a lease: the search is over."""
        self._advance(host, now)
        self.state = self._job_move(JobEvent.LEASED)
        self.deadline = math.inf

    # --- decisions ----------------------------------------------------------------------

    def next_step(self, ranked: Sequence[str], *, now: float) -> Decision:
        """What to do now, given the hosts whose offers meet the bid, best first.

        Raises:
            LocalProtocolError: not searching (call ``search`` first).
        """
        if self.state not in (JobState.SEARCHING, JobState.WAITING):
            raise LocalProtocolError(f"next_step while {self.state.value}: call search()")
        ranked = list(dict.fromkeys(ranked))
        for host in ranked:
            self._advance(host, now)
        usable = tuple(h for h in ranked if self.usable(h, now=now))
        if now >= self.deadline:
            self.state = self._job_move(JobEvent.DEADLINE)
            if usable:
                why = f"none of {len(usable)} usable host(s) granted a lease"
            else:
                why = self._waiting_for(ranked, now)
            return GiveUp(f"no lease within {self._searched_for:.0f}s: {why}")
        if usable:
            self.state = self._job_move(JobEvent.CANDIDATES)
            return Propose(usable)
        reason = self._waiting_for(ranked, now)
        self.state = self._job_move(JobEvent.NONE_USABLE)
        ends = [self._hosts[h].until for h in ranked if self._cooling(h, now)]
        return Wait(min(ends) if ends else None, self.deadline, reason)

    # --- reads (they change nothing) ----------------------------------------------------

    def standing(self, host: str, *, now: float) -> HostStanding:
        record = self._hosts.get(host)
        return HostStanding.WELCOME if record is None else _standing_at(record, now)

    def usable(self, host: str, *, now: float) -> bool:
        return self.standing(host, now=now) is HostStanding.WELCOME

    def view(self, *, now: float) -> list[HostView]:
        """Every host this job has set aside or banned, as of ``now``."""
        rows = []
        for host, record in self._hosts.items():
            standing = _standing_at(record, now)
            if standing is HostStanding.WELCOME and record.evidence == 0:
                continue
            evidence = self.policy.decayed(record.evidence, now - record.evidence_at)
            usable_from = (
                record.until if standing in (HostStanding.COOLING, HostStanding.RETURNED) else None
            )
            rows.append(HostView(host, standing, round(evidence, 3), usable_from, record.reason))
        return rows

    # --- internals ----------------------------------------------------------------------

    def _advance(self, host: str, now: float) -> _Host:
        """``host``'s record, with its backoff's end applied if ``now`` is past it."""
        record = self._hosts.setdefault(host, _Host())
        if _standing_at(record, now) is not record.standing:
            self._move(record, HostEvent.BACKOFF_ENDED)
        return record

    def _move(self, record: _Host, event: HostEvent) -> None:
        record.standing = TRANSITIONS[record.standing].get(event, record.standing)

    def _job_move(self, event: JobEvent) -> JobState:
        try:
            return JOB_TRANSITIONS[self.state][event]
        except KeyError:
            raise LocalProtocolError(
                f"the job cannot take {event.value!r} while {self.state.value}"
            ) from None

    def _cooling(self, host: str, now: float) -> bool:
        return self.standing(host, now=now) in (HostStanding.COOLING, HostStanding.RETURNED)

    def _waiting_for(self, ranked: list[str], now: float) -> str:
        if not ranked:
            return "no offer meets the bid"
        parts = []
        for host in ranked:
            standing = self.standing(host, now=now)
            if standing in (HostStanding.COOLING, HostStanding.RETURNED):
                left = self._hosts[host].until - now
                more = "" if standing is HostStanding.RETURNED else " and a fresh offer"
                parts.append(f"{host[:12]} (backoff, {left:.0f}s more{more})")
            elif standing is HostStanding.SILENT:
                parts.append(f"{host[:12]} (to announce again)")
            else:
                parts.append(f"{host[:12]} ({self._hosts[host].reason})")
        return f"{len(ranked)} matching host(s) set aside: " + ", ".join(parts)


def _standing_at(record: _Host, now: float) -> HostStanding:
    """``record``'s standing at ``now``: a backoff that has ended has ended."""
    if record.standing in (HostStanding.COOLING, HostStanding.RETURNED) and now >= record.until:
        return TRANSITIONS[record.standing][HostEvent.BACKOFF_ENDED]
    return record.standing
