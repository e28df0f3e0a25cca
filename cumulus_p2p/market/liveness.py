"""Liveness probes: the cost of entry for a host with no record. Sans-IO.

Theory of operation
-------------------
A signed offer costs its author nothing: a key pair is free, and a flood of offers from
hosts that never answer a proposal would otherwise take the newcomers' share of the
matches. So an offer from a host with no record (no evidence of paid leases) counts for
matching only once its host has *proven it is alive*:

1. The prober (a consumer's node) picks hosts to probe (``Liveness.due``) and sends each a
   fresh random challenge (``Liveness.challenge`` returns the request; the shell,
   ``market.probing``, carries it over ``/cumulus/liveness/1.0.0``).
2. The host answers with a ``market/liveness`` envelope signed by its node key, the key
   its offers are signed with and its peer ID derives from (``answer_probe``). The body
   names the prober, repeats the challenge, and carries the time the host answered and
   its free shares (a capacity claim; the device probe and the leases check capacity).
3. The prober checks the answer (``Liveness.answered``) and keeps it as evidence
   (``LivenessEvidence``: probed alive at ``received_at`` by ``prober``). Only a live
   process that holds the key can sign, within the probe's timeout, a challenge it has
   never seen; an answer cannot be reused for another challenge or another prober.

Every refusal names its reason (``ProofRefusal``) in a ``LivenessProofError``:
``MALFORMED`` (not a liveness envelope, or a body of the wrong shape), ``FORGED`` (signed
by another key than the host's, or a signature that does not verify), ``WRONG_PROBER``
(for another node's probe), ``UNKNOWN_CHALLENGE`` (no challenge of ours is outstanding
with this host under that value: a replay, or an answer after the probe timed out) and
``EXPIRED``. A refused answer to an outstanding probe counts as no answer.

Each host's standing is a small state machine whose transitions are data
(``TRANSITIONS``, after h11's ``_state.py``)::

    UNPROVEN --challenged--> PROBING --answered--> ALIVE  --lapsed--> UNPROVEN
                                     --missed----> SILENT --lapsed--> UNPROVEN

``ALIVE`` lasts ``alive_for_s``; ``SILENT`` lasts a backoff that doubles with each
missed probe, up to ``max_backoff_s``, so a host that never answers costs a bounded
number of probes (about ``log2(max/base) + 1`` and then one per ``max_backoff_s``). A
probe with no verdict past twice its timeout counts as missed when time is passed in.

Budget: at most ``at_once`` probes are in flight, and ``due`` hands out unproven hosts
by the tier the shell gives them (a consumer puts hosts priced like the market before
those priced far below it), then in the order they became unproven: first seen, or
back from a backoff. A flood of fresh identities therefore queues behind the newcomer
that was announcing before it, and a silent host back from its backoff queues behind
every host that was waiting meanwhile. Memory is bounded by ``max_hosts``: past it, the host seen
least recently that is neither alive nor being probed is forgotten.

Nothing here reads a clock, draws randomness or does I/O: the shell passes the time and
the challenge's random bytes in.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import msgpack

from .._errors import (
    EnvelopeRejectedError,
    LivenessProofError,
    LocalProtocolError,
    MalformedMessageError,
)
from ..envelope import Envelope, seal
from ..identity import NodeIdentity, peer_id_from_public_key

__all__ = [
    "CHALLENGE_SIZE",
    "LIVENESS_KIND",
    "TRANSITIONS",
    "Liveness",
    "LivenessEvent",
    "LivenessEvidence",
    "LivenessPolicy",
    "LivenessState",
    "Probe",
    "ProofRefusal",
    "answer_probe",
]

#: The envelope kind of a host's answer.
LIVENESS_KIND = "market/liveness"
#: Bytes of randomness in a challenge: never guessed, never repeated.
CHALLENGE_SIZE = 16
#: Tags the request, so a liveness challenge is never mistaken for another request.
_REQUEST_TAG = "cumulus/liveness/v1"
#: Seconds a host's answer lives: it is checked within a probe's timeout of being sent.
PROOF_TTL_S = 60.0
#: The largest answer accepted (an envelope around a body of four short fields).
MAX_PROOF_SIZE = 1024


class LivenessState(enum.Enum):
    """Whether a host with no record has proven it is alive."""

    #: Seen, never probed, or its evidence has lapsed: its offers do not count yet.
    UNPROVEN = "unproven"
    #: A challenge is outstanding.
    PROBING = "probing"
    #: Answered a probe: its offers count, until ``alive_for_s`` has passed.
    ALIVE = "alive"
    #: Missed a probe: set aside for a backoff, then probed again.
    SILENT = "silent"


class LivenessEvent(enum.Enum):
    CHALLENGED = "challenged"
    ANSWERED = "answered"
    MISSED = "missed"
    LAPSED = "lapsed"


_S, _E = LivenessState, LivenessEvent
#: Every state's legal moves; any other event there is a ``LocalProtocolError``.
TRANSITIONS: dict[LivenessState, dict[LivenessEvent, LivenessState]] = {
    _S.UNPROVEN: {_E.CHALLENGED: _S.PROBING},
    _S.PROBING: {_E.ANSWERED: _S.ALIVE, _E.MISSED: _S.SILENT},
    _S.ALIVE: {_E.LAPSED: _S.UNPROVEN},
    _S.SILENT: {_E.LAPSED: _S.UNPROVEN},
}


class ProofRefusal(enum.Enum):
    """Why a host's answer to a probe was refused."""

    MALFORMED = "malformed"
    FORGED = "forged"
    WRONG_PROBER = "for another prober"
    UNKNOWN_CHALLENGE = "answers no outstanding challenge"
    EXPIRED = "expired"


@dataclass(frozen=True, slots=True)
class LivenessPolicy:
    """How hard a prober works, and how long a verdict lasts.

    Attributes:
        timeout_s: Seconds a host gets to answer, dialing included: as long as a lease
            proposal gets (``node.consumer.PROPOSE_TIMEOUT_S``). An honest host answers
            within a round trip (tens of milliseconds on loopback or a LAN, under a second
            across the internet), but a prober that a flood keeps busy takes seconds to
            dial: with 2 s, a consumer under ``spam_bench``'s flood on a loaded 2-core
            machine missed the honest host's first probe.
        at_once: Probes in flight at most.
        alive_for_s: How long an answer counts; then the host is probed again.
        backoff_s: How long a host that missed its first probe is set aside: short, so
            that an honest host whose first probe was lost to a busy machine is soon
            probed again; it doubles with each further miss.
        factor: The backoff's growth per further missed probe.
        max_backoff_s: The longest backoff.
        max_hosts: Hosts remembered at most.
    """

    timeout_s: float = 3.0
    at_once: int = 8
    alive_for_s: float = 600.0
    backoff_s: float = 10.0
    factor: float = 2.0
    max_backoff_s: float = 3600.0
    max_hosts: int = 4096

    def __post_init__(self) -> None:
        if not (self.timeout_s > 0 and self.at_once >= 1 and self.alive_for_s > 0):
            raise ValueError("need timeout_s > 0, at_once >= 1 and alive_for_s > 0")
        if not (0 < self.backoff_s <= self.max_backoff_s and self.factor >= 1):
            raise ValueError("need 0 < backoff_s <= max_backoff_s and factor >= 1")
        if self.max_hosts < self.at_once:
            raise ValueError("max_hosts must hold at least at_once hosts")

    def backoff(self, misses: int) -> float:
        """How long a host that has missed ``misses`` probes in a row is set aside."""
        return min(self.max_backoff_s, self.backoff_s * self.factor ** max(0, misses - 1))


@dataclass(frozen=True, slots=True)
class Probe:
    """A probe to send: ``request`` to ``host``, answered by ``deadline`` (prober's time)."""

    host: str
    request: bytes
    challenge: bytes
    deadline: float


@dataclass(frozen=True, slots=True)
class LivenessEvidence:
    """A host's checked answer: probed alive at ``received_at`` by ``prober``.

    Attributes:
        host: The host's peer ID (base58), whose key signed ``proof``.
        prober: The prober's peer ID.
        challenge: The challenge the host answered.
        answered_at: When the host says it answered (its clock).
        received_at: When the prober checked the answer (its clock).
        free_shares: The host's capacity claim: share units free over its offers.
        proof: The host's signed envelope.
    """

    host: str
    prober: str
    challenge: bytes
    answered_at: float
    received_at: float
    free_shares: int
    proof: Envelope


@dataclass(slots=True)
class _Host:
    state: LivenessState = LivenessState.UNPROVEN
    first_seen: float = 0.0
    last_seen: float = 0.0
    queued_at: float = 0.0  # when it last became unproven: first seen, or lapsed
    order: int = 0  # ties on first sight: the shell's preference
    until: float = math.inf  # ALIVE, SILENT: when it lapses; PROBING: the deadline
    challenge: bytes = b""
    misses: int = 0
    evidence: LivenessEvidence | None = None


@dataclass(frozen=True, slots=True)
class LivenessStatistics:
    """Counts for status and benchmarks."""

    hosts: int
    alive: int
    probing: int
    silent: int
    probes_sent: int
    answers: int
    misses: int
    refused_answers: int


def _packb(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True, strict_types=True)


@dataclass
class Liveness:
    """A prober's memory of the hosts it has probed (see the module docstring).

    Args:
        prober: This node's peer ID (base58); answers must name it.
        policy: Timeouts, budget and backoff.
    """

    prober: str
    policy: LivenessPolicy = LivenessPolicy()
    _hosts: dict[str, _Host] = field(default_factory=dict)
    _probing: set[str] = field(default_factory=set)
    _seen: int = 0
    _counts: dict[str, int] = field(
        default_factory=lambda: dict(sent=0, answers=0, misses=0, refused=0)
    )

    # --- events -------------------------------------------------------------------------

    def see(self, host: str, *, now: float) -> None:
        """An offer from ``host`` (no record) is in the book."""
        record = self._hosts.get(host)
        if record is None:
            if len(self._hosts) >= self.policy.max_hosts and not self._forget_one():
                return  # every remembered host is alive or being probed
            self._seen += 1
            record = self._hosts[host] = _Host(first_seen=now, queued_at=now, order=self._seen)
        record.last_seen = now

    def due(
        self, hosts: Iterable[str], *, now: float, tier: Mapping[str, int] | None = None
    ) -> list[str]:
        """The hosts among ``hosts`` to probe now, at most the free part of the budget.

        Each host is seen (``see``) first. Unproven hosts come out by ``tier`` (lower
        first; 0 if missing), then in the order they became unproven (first seen, or
        their evidence or backoff lapsed), then in the order of ``hosts``.
        """
        tier = tier or {}
        for host in hosts:
            self.see(host, now=now)
        self._expire(now)
        room = self.policy.at_once - len(self._probing)
        if room <= 0:
            return []
        unproven = [
            (tier.get(h, 0), r.queued_at, r.order, h)
            for h, r in self._hosts.items()
            if r.state is LivenessState.UNPROVEN and r.last_seen == now
        ]
        return [row[-1] for row in sorted(unproven)[:room]]

    def challenge(self, host: str, *, nonce: bytes, now: float) -> Probe:
        """Start probing ``host`` with the random ``nonce``; return the request to send.

        Raises:
            LocalProtocolError: ``host`` is not unproven (already alive, set aside or
                being probed), or ``nonce`` is not ``CHALLENGE_SIZE`` bytes.
        """
        if type(nonce) is not bytes or len(nonce) != CHALLENGE_SIZE:
            raise LocalProtocolError(f"a challenge is {CHALLENGE_SIZE} random bytes")
        self.see(host, now=now)
        record = self._record(host, now)
        self._move(record, LivenessEvent.CHALLENGED)
        record.challenge, record.until = nonce, now + self.policy.timeout_s
        self._probing.add(host)
        self._counts["sent"] += 1
        return Probe(host, _packb([_REQUEST_TAG, nonce]), nonce, record.until)

    def answered(self, host: str, raw: bytes, *, now: float) -> LivenessEvidence:
        """Check ``host``'s answer to the outstanding probe; keep it as evidence.

        Returns:
            The evidence; ``host`` is alive until ``now + alive_for_s``.

        Raises:
            LivenessProofError: the answer is refused (``reason`` says why); if a probe
                of ``host`` was outstanding, it counts as missed.
        """
        record = self._hosts.get(host)
        if record is not None:
            self._advance(record, now)
        outstanding = record is not None and record.state is LivenessState.PROBING
        try:
            evidence = self._check(host, raw, record if outstanding else None, now)
        except LivenessProofError:
            self._counts["refused"] += 1
            if outstanding:
                self.missed(host, now=now)
            raise
        record = self._hosts[host]  # _check refuses an answer with no probe outstanding
        self._move(record, LivenessEvent.ANSWERED)
        self._probing.discard(host)
        record.until, record.misses, record.evidence = now + self.policy.alive_for_s, 0, evidence
        record.challenge = b""
        self._counts["answers"] += 1
        return evidence

    def missed(self, host: str, *, now: float) -> float:
        """``host`` did not answer its probe in time (or could not be reached).

        A verdict on a probe that is no longer outstanding (it timed out here already)
        changes nothing.

        Returns:
            The backoff it now serves, in seconds (0 if nothing changed).
        """
        record = self._hosts.get(host)
        if record is None or record.state is not LivenessState.PROBING:
            return 0.0
        return self._miss(record, host, now)

    # --- reads (they change nothing) ----------------------------------------------------

    def state(self, host: str, *, now: float) -> LivenessState:
        record = self._hosts.get(host)
        if record is None:
            return LivenessState.UNPROVEN
        return _state_at(record, now, self.policy)

    def alive(self, host: str, *, now: float) -> bool:
        """Whether ``host`` answered a probe within the last ``alive_for_s``."""
        return self.state(host, now=now) is LivenessState.ALIVE

    def evidence(self, host: str, *, now: float) -> LivenessEvidence | None:
        record = self._hosts.get(host)
        if record is None or _state_at(record, now, self.policy) is not LivenessState.ALIVE:
            return None
        return record.evidence

    def set_aside(self, host: str, *, now: float) -> bool:
        """Whether ``host`` missed its last probe and serves its backoff."""
        return self.state(host, now=now) is LivenessState.SILENT

    def statistics(self, *, now: float) -> LivenessStatistics:
        states = [_state_at(r, now, self.policy) for r in self._hosts.values()]
        c = self._counts
        return LivenessStatistics(
            len(states), states.count(LivenessState.ALIVE), states.count(LivenessState.PROBING),
            states.count(LivenessState.SILENT), c["sent"], c["answers"], c["misses"],
            c["refused"],
        )  # fmt: skip

    # --- internals ----------------------------------------------------------------------

    def _check(self, host: str, raw: bytes, record: _Host | None, now: float) -> LivenessEvidence:
        def refuse(reason: ProofRefusal, detail: str) -> LivenessProofError:
            return LivenessProofError(reason, f"host {host[:12]}: {detail}")

        if type(raw) is not bytes:
            raise refuse(ProofRefusal.MALFORMED, "the answer is not bytes")
        try:
            proof = Envelope.from_bytes(raw, max_size=MAX_PROOF_SIZE)
        except EnvelopeRejectedError as exc:
            raise refuse(ProofRefusal.MALFORMED, f"not an envelope ({exc.detail})") from exc
        if proof.kind != LIVENESS_KIND:
            raise refuse(ProofRefusal.MALFORMED, f"an envelope of kind {proof.kind!r}")
        try:
            signer = peer_id_from_public_key(proof.author).to_base58()
        except ValueError as exc:
            raise refuse(ProofRefusal.FORGED, "its author is not an ed25519 key") from exc
        if signer != host:
            raise refuse(ProofRefusal.FORGED, f"signed by {signer[:12]}, not by the host")
        if not proof.has_valid_signature():
            raise refuse(ProofRefusal.FORGED, "the signature does not verify")
        if proof.expires_at <= now:
            raise refuse(ProofRefusal.EXPIRED, f"expired {now - proof.expires_at:.1f}s ago")
        try:
            body = msgpack.unpackb(proof.body, raw=False, use_list=True, strict_map_key=True)
        except (ValueError, msgpack.UnpackException) as exc:
            raise refuse(ProofRefusal.MALFORMED, "the body is not msgpack") from exc
        if not (
            type(body) is list and len(body) == 4
            and type(body[0]) is str and type(body[1]) is bytes
            and type(body[2]) is float and math.isfinite(body[2])
            and type(body[3]) is int and body[3] >= 0
        ):  # fmt: skip
            raise refuse(
                ProofRefusal.MALFORMED,
                "the body must be [prober, challenge, answered_at, free_shares]",
            )
        prober, challenge, answered_at, free_shares = body
        if prober != self.prober:
            raise refuse(ProofRefusal.WRONG_PROBER, f"answers a probe by {prober[:12]}")
        if record is None or challenge != record.challenge:
            raise refuse(
                ProofRefusal.UNKNOWN_CHALLENGE,
                "no probe of ours with that challenge is outstanding (replayed, or late)",
            )
        return LivenessEvidence(host, prober, challenge, answered_at, now, free_shares, proof)

    def _record(self, host: str, now: float) -> _Host:
        record = self._hosts.setdefault(host, _Host(first_seen=now, last_seen=now, queued_at=now))
        self._advance(record, now)
        return record

    def _advance(self, record: _Host, now: float) -> None:
        """Apply what time alone does: a lapse, or a probe past twice its timeout."""
        if record.state is LivenessState.PROBING:
            if now >= record.until + self.policy.timeout_s:
                host = next(h for h, r in self._hosts.items() if r is record)
                self._miss(record, host, now)
        elif record.state in (LivenessState.ALIVE, LivenessState.SILENT) and now >= record.until:
            self._move(record, LivenessEvent.LAPSED)
            record.queued_at, record.until = record.until, math.inf

    def _expire(self, now: float) -> None:
        for host in list(self._probing):
            self._advance(self._hosts[host], now)
        for record in self._hosts.values():
            if record.state is not LivenessState.PROBING:
                self._advance(record, now)

    def _miss(self, record: _Host, host: str, now: float) -> float:
        self._move(record, LivenessEvent.MISSED)
        self._probing.discard(host)
        record.misses += 1
        backoff = self.policy.backoff(record.misses)
        record.until, record.challenge, record.evidence = now + backoff, b"", None
        self._counts["misses"] += 1
        return backoff

    def _move(self, record: _Host, event: LivenessEvent) -> None:
        try:
            record.state = TRANSITIONS[record.state][event]
        except KeyError:
            raise LocalProtocolError(
                f"a host cannot be {event.value} while {record.state.value}"
            ) from None

    def _forget_one(self) -> bool:
        idle = [
            (r.last_seen, h)
            for h, r in self._hosts.items()
            if r.state in (LivenessState.UNPROVEN, LivenessState.SILENT)
        ]
        if not idle:
            return False
        del self._hosts[min(idle)[1]]
        return True


def _state_at(record: _Host, now: float, policy: LivenessPolicy) -> LivenessState:
    """``record``'s state at ``now``, with what time alone does applied."""
    if record.state is LivenessState.PROBING:
        if now >= record.until + policy.timeout_s:
            return LivenessState.SILENT
        return record.state
    if record.state in (LivenessState.ALIVE, LivenessState.SILENT) and now >= record.until:
        return LivenessState.UNPROVEN
    return record.state


def answer_probe(
    identity: NodeIdentity,
    request: bytes,
    *,
    prober: str,
    now: float,
    free_shares: int,
    nonce: int,
) -> bytes:
    """The host's side: sign an answer to ``prober``'s challenge.

    Args:
        identity: The host's node key (the key its offers are signed with).
        request: The probe's request bytes.
        prober: The prober's peer ID, as the transport authenticated it.
        now: The current Unix time.
        free_shares: Share units free over this host's offers (its capacity claim).
        nonce: A fresh per-author envelope nonce.

    Returns:
        The signed answer's bytes.

    Raises:
        MalformedMessageError: ``request`` is not a liveness challenge.
    """
    try:
        decoded = msgpack.unpackb(request, raw=False, use_list=True, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise MalformedMessageError(f"liveness challenge is not msgpack: {exc}") from exc
    if not (
        type(decoded) is list and len(decoded) == 2 and decoded[0] == _REQUEST_TAG
        and type(decoded[1]) is bytes and len(decoded[1]) == CHALLENGE_SIZE
    ):  # fmt: skip
        raise MalformedMessageError(
            f"liveness challenge must be [{_REQUEST_TAG!r}, {CHALLENGE_SIZE} bytes]"
        )
    body = _packb([prober, decoded[1], float(now), max(0, int(free_shares))])
    return seal(identity, LIVENESS_KIND, body, now=now, ttl=PROOF_TTL_S, nonce=nonce).to_bytes()
