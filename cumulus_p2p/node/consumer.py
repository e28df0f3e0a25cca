"""``cumulus-node --consume -- python train.py``: bid, match, lease, run the script.

One trio program composes:

- the ``Runtime`` (mesh, book, reputation) and a ``ReceiptDesk`` answering the hosts'
  receipts (checked against the lease, countersigned, kept in the ledger);
- the bid, re-announced on the mesh until the script ends, then cancelled;
- ``Consumer.lease()``: rank the offers that meet the bid, hosts with a record of paid
  leases first, then newcomers priced like the market, then newcomers priced far below
  it (``market.matcher.entry_of``), each tier by price adjusted by the hosts' reliability
  scores; let the job's ``HostChoice`` (``market.hostchoice``, sans-IO) say which of
  those hosts may be tried; propose to the best ``PROPOSALS_AT_ONCE`` at once, one slot
  kept for a newcomer (and a ``NEWCOMER_SHARE`` of matches trying newcomers first), each
  with ``PROPOSE_TIMEOUT_S`` to answer, and keep the best grant (extra grants are
  closed). A newcomer counts only once its host has answered a liveness probe
  (``market.liveness``: it signs a fresh challenge with its offer's key); the node probes
  the newcomers whose offers meet the bid in the background (``keep_probing``), and
  before a match that would otherwise have no host or no newcomer to try. A host that
  answers no probe is never proposed to, and probed again only after a backoff that
  doubles with each miss. A host that refuses, fails or ignores a proposal is set aside
  with all its offers, so a flood of cheap offers from hosts that never lease costs the
  job one try per host, not its match window. The job is held while no host is usable
  (bounded by ``match_timeout`` for the first match, ``wait_for_host`` after a failure);
- the control channel the shim in the script's process asks for its session, and for a
  new host when the current one vanished (``failover``): the vanished host gets a signed
  ``LeaseFailure`` report gossiped against it and is set aside for a backoff that grows
  with its failures, then tried again once it announces a fresh offer; a host that said
  it was leaving, or that preempted a contending or interruptible lease for an on-demand
  one (``take_notice``), is set aside until it announces again, unreported. A
  host that misrepresents its device or overcharges is never leased again in the job;
- the script itself, a child process run under ``python -m cumulus_p2p.shim`` that
  lives and dies with this node (``script.py``): a SIGTERM or Ctrl-C stops it first,
  and the leases are settled before the node exits with the script's status.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import random
import secrets
import sys
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import trio
from libp2p.exceptions import BaseLibp2pError

from .._errors import (
    CumulusError,
    LeaseRefusedError,
    LivenessProofError,
    NoMatchError,
    PeerUnreachableError,
)
from ..dht.host import connect
from ..market import (
    Bid,
    Cancel,
    Lease,
    LeaseProposal,
    Offer,
    PriorityClass,
    Side,
    rank_offers,
)
from ..market.hostchoice import BackoffPolicy, GiveUp, HostChoice, Wait
from ..market.lease import RefusalReason
from ..market.liveness import CHALLENGE_SIZE, Liveness
from ..market.matcher import Entry, entry_of, near_first, proposal_batch, standing
from ..market.messages import MAX_OVERCOMMIT_PCT, encode_message, seal_message
from ..market.negotiation import call_propose_lease
from ..market.pricing import proposed_price
from ..market.probing import call_probe
from ..market.settlement import (
    HANGUP_PAUSED,
    NOTICE_PREEMPTED,
    ReceiptDesk,
    call_close_lease,
)
from ..market.standby import choose_standby, standby_proposal
from ..reputation import (
    FailureReason,
    LeaseFailure,
    PerformanceObservation,
    ServiceRecord,
)
from ..reputation.evidence import MAX_RECEIPTS
from . import control, logs
from .probe import ProbeFacts, judge
from .runtime import Runtime, peer_of
from .session_proxy import SessionDoors

log = logging.getLogger("cumulus_p2p.node.consumer")
status = logging.getLogger(logs.STATUS)

BID_NAME = "bid0"
#: How long a job whose host vanished waits for another usable one (``--wait-for-host``).
WAIT_FOR_HOST_S = 1800.0
#: Offers ranked per look at the book: set-aside hosts are skipped after ranking, so a
#: pool of a few hosts with several offers each must still show a usable one.
RANKED_OFFERS = 32
#: How often a held job looks at the book again (offers arrive by gossip, at any time).
HOLD_POLL_S = 0.5
#: Proposals in flight at once: a host that ignores one costs the job PROPOSE_TIMEOUT_S
#: once, while the others answer.
PROPOSALS_AT_ONCE = 4
#: How long a host gets to answer a proposal, dialing included. An honest host answers
#: within tens of milliseconds on loopback or a LAN, and within a second across the
#: internet; one that takes longer is set aside like one that refused.
PROPOSE_TIMEOUT_S = 3.0
#: The share of matches that try newcomers (hosts with no record) before hosts with one,
#: so that a newcomer gets its first leases while a flood of newcomers takes at most this
#: share of the matches.
NEWCOMER_SHARE = 0.2
#: How often the node looks for newcomers to probe (``keep_probing``); each round waits
#: for its probes' verdicts, at most ``LivenessPolicy.timeout_s``.
PROBE_POLL_S = 1.0
#: Refusals that say the offer moved on (the host re-announced): not held against it.
_STALE_OFFER = frozenset({RefusalReason.UNKNOWN_OFFER, RefusalReason.OFFER_EXPIRED})
#: Refusals of an offer that is full (its copy in the book was stale), or whose free
#: shares wait for a better bid. That offer is not proposed to again, without blame to
#: its host (one device of a rig may be taken, not the rest); a newer offer from it is.
_FULL_OFFER = frozenset(
    {RefusalReason.NO_CAPACITY, RefusalReason.NO_STORAGE_CAPACITY, RefusalReason.OUTBID}
)
#: A host may end a session this long before its lease ends (clocks differ) and still
#: count as having served the whole term.
LEASE_END_SLACK_S = 2.0


@dataclass(frozen=True, slots=True)
class ConsumerOptions:
    """What ``--consume`` asks for and runs.

    Attributes:
        command: The script and its arguments (``["train.py", "--epochs", "3"]``).
        gpu_models: Acceptable GPU models; empty for any.
        min_vram_mib: Least device memory.
        min_perf: Least performance units.
        max_price: Most micro-credits per share-hour.
        priority: On-demand, contending (pays an offer's contend price, below its
            ask, and shares the device below on-demand tenants) or interruptible.
        pay_bid: Propose ``max_price`` rather than the ask, to run ahead of the other
            tenants of the same class on a shared device (``pricing.proposed_price``).
        shares: Share units wanted.
        duration_s: Lease length.
        match_timeout: Seconds to wait for a matching offer before giving up.
        cuda_compat: Run CUDA-style scripts unchanged on the remote device.
        native: Run the script on the native C++ device (``cumulus_p2p.native``), as
            ``cumulus-node --consume`` does by default; else on the Python wrapper device
            (``cumulus_p2p.remote``).
        checkpoint_interval: Seconds between session checkpoints (failover).
        checkpoint_to: Where they are kept (``control.CHECKPOINT_PLACES``): with a
            standby, on a second leased host.
        standby_gib: GiB of disk the standby lease holds for them.
        private: Hosts keep none of the job's uploads (``remote.attach(private=True)``).
        max_storage_price: Most micro-credits per GiB-hour for it.
        wait_for_host: Seconds a job whose host failed waits for a usable one before it
            gives up; meanwhile its state is safe in its checkpoints.
        backoff: How long a failed host is set aside (``market.hostchoice``).
        max_overcommit_pct: The most overcommitted host memory acceptable
            (``Offer.overcommit_pct``); 100 keeps the job's memory on the device.
        gpus: GPUs the job leases, each from another host, one per rank of the
            ``torchrun`` the command runs (``node.job``).
    """

    command: tuple[str, ...]
    gpu_models: tuple[str, ...] = ()
    min_vram_mib: int = 0
    min_perf: int = 0
    max_price: int = 2**48
    priority: PriorityClass = PriorityClass.ON_DEMAND
    pay_bid: bool = False
    shares: int = 1
    duration_s: int = 3600
    match_timeout: float = 60.0
    cuda_compat: bool = True
    native: bool = False
    checkpoint_interval: float = 30.0
    checkpoint_to: str = "standby"
    standby_gib: int = 4
    private: bool = False
    max_storage_price: int = 10**6
    wait_for_host: float = WAIT_FOR_HOST_S
    backoff: BackoffPolicy = BackoffPolicy()
    max_overcommit_pct: int = MAX_OVERCOMMIT_PCT
    gpus: int = 1


class LeaseState(enum.Enum):
    """Where a lease this consumer holds stands."""

    #: The session may run under it.
    HELD = "held"
    #: Its term is over (the host ended the session as agreed).
    ENDED = "ended"
    #: The host said it was leaving.
    LEFT = "left"
    #: The host gave its shares to an on-demand lease (this one contended or was
    #: interruptible); the session is parked there.
    PREEMPTED = "preempted"
    #: The host dropped the session before its term, without a word.
    FAILED = "failed"
    #: The probe found the device short of the offer.
    MISREPRESENTED = "misrepresented"


class LeaseRole(enum.Enum):
    """What a lease this consumer holds is for."""

    #: The script's session runs under it.
    SESSION = "session"
    #: Its host keeps the session's checkpoints (``blobs.standby``).
    STANDBY = "standby"


@dataclass
class Held:
    """A lease this consumer holds, and where its session runs."""

    lease: Lease
    proposal: LeaseProposal
    offer: Offer
    host_key: bytes
    endpoints: tuple[str, ...]
    state: LeaseState = LeaseState.HELD
    #: Which path the session channel took (the shim says): direct, or the door.
    path: str = ""
    role: LeaseRole = LeaseRole.SESSION


@dataclass
class Consumer:
    """The consumer's state: its bid, its leases, its choice of hosts."""

    runtime: Runtime
    options: ConsumerOptions
    desk: ReceiptDesk
    bid: Bid | None = None
    #: Whether the bid is announced: while the job waits for a host, and only then.
    bid_resting: bool = False
    held: list[Held] = field(default_factory=list)
    #: Which hosts may be tried, which are set aside and until when (sans-IO).
    choice: HostChoice = field(default_factory=HostChoice)
    status: str = "starting"
    #: While the job is held for want of a usable host: what it waits for.
    waiting_for: str = ""
    exit_code: int | None = None
    doors: SessionDoors | None = None
    #: Why the last host that refused a proposal refused it.
    last_refusal: str = ""
    #: Times the session moved to another host (or to a renewed lease).
    failovers: int = 0
    #: Ops the script's session has sent, over every host (the shim's last report).
    ops: int = 0
    #: The session's long transfer under way (an upload, a checkpoint), if any.
    transfer: control.Transfer | None = None
    #: The job's collectives go through this machine, not between its hosts.
    collectives_through_consumer: bool = False
    #: How the job's hosts link to each other ("tls" or "plain"; "" before its group).
    peer_links: str = ""
    #: Set when the script's shim next reports its byte counts.
    counts_reported: trio.Event = field(default_factory=trio.Event)
    #: The shim gave its session's final counts: no newer ones will come.
    counts_final: bool = False
    #: Where proposals still unanswered when a match is decided finish (and their
    #: grants, if any, are closed); without one, a match waits for all its proposals.
    nursery: trio.Nursery | None = None
    #: Hosts that granted this consumer a lease: they have a record with it.
    granted_by: set[str] = field(default_factory=set)
    #: Each ranked host's entry tier, as of the last look at the book.
    entries: dict[str, Entry] = field(default_factory=dict)
    #: Which newcomers answered a liveness probe, which are set aside (sans-IO).
    liveness: Liveness = field(init=False)
    #: Why no standby could be leased (once the shim asked for one and none came).
    no_standby: str = ""
    #: Offers ``(host, offer_id, nonce)`` found full when proposed to (``_FULL_OFFER``).
    full_offers: set[tuple[str, str, int]] = field(default_factory=set)
    #: The name its bid is announced under: one per rank of a job of several GPUs.
    bid_name: str = BID_NAME
    #: The devices the job's other ranks hold, as ``(host, offer_id)``: this one leases
    #: another device (on one rig, or on another host).
    elsewhere: Callable[[], Collection[tuple[str, str]]] = frozenset
    #: The offer its job's first rank holds, whose rig and region this rank prefers;
    #: None for the first rank (or a job of one GPU).
    near: Callable[[], Offer | None] = lambda: None
    #: Whether the session may move to another host when its host is lost: not a rank of
    #: a job of several GPUs, whose collective group would not follow it.
    movable: bool = True
    #: While an unmovable session renews its lease: the one host it may lease from.
    pinned: str = ""

    def __post_init__(self) -> None:
        self.choice = HostChoice(self.options.backoff, self.options.wait_for_host)
        self.liveness = Liveness(self.runtime.peer_id)

    # --- the bid --------------------------------------------------------------------

    def bid_body(self, nonce: int, expires_at: float) -> bytes:
        o, now = self.options, self.runtime.clock()
        self.bid = Bid(
            self.runtime.peer_id, self.bid_name, o.min_vram_mib, o.gpu_models, o.min_perf,
            o.shares, o.max_price, o.priority, o.duration_s, now, expires_at, nonce,
            o.max_overcommit_pct,
        )  # fmt: skip
        return encode_message(self.bid)

    async def rest_bid(self) -> None:
        """Announce the bid while the job waits for a host (the book then shows it as
        demand, and hosts serve the best waiting bid first: ``market/admission.py``)."""
        if not self.bid_resting:
            await self.runtime.mesh.announce(self.bid_name, Bid.KIND, self.bid_body)
            self.bid_resting = True

    async def withdraw_bid(self) -> None:
        """Stop announcing the bid and tell the market it is gone (it was filled, or the
        job ended)."""
        if not self.bid_resting:
            return
        self.bid_resting = False
        self.runtime.mesh.withdraw(self.bid_name)
        now = self.runtime.clock()
        cancel = Cancel(
            self.runtime.peer_id, Side.BID, self.bid_name, now + 60, self.runtime.mesh.next_nonce()
        )
        await self.runtime.mesh.publish(seal_message(self.runtime.identity, cancel, now=now))

    # --- matching -------------------------------------------------------------------

    async def lease(self, patience: float | None = None) -> Held:
        """Lease from the best usable host whose offer meets the bid; while none is usable,
        hold (the status says what for), up to ``patience`` s (default: the job's
        ``wait_for_host``).

        Raises:
            NoMatchError: No lease in time; the message says what the book held.
        """
        choice = self.choice
        choice.search(now=self.runtime.clock(), patience_s=patience)
        await self.rest_bid()
        newcomers_first: bool | None = None
        probed_for_share = False
        while True:
            now = self.runtime.clock()
            offers = self._candidates(now)
            decision = choice.next_step(list(offers), now=now)
            if type(decision) is GiveUp:
                self.waiting_for = ""
                waited = self.choice.patience_s if patience is None else patience
                raise NoMatchError(self._no_match_reason(waited, decision.reason))
            if type(decision) is Wait:
                if not self.waiting_for:
                    # Before the first lease, waiting for offers is the normal start (the
                    # status says so); a job that had a host and lost it is news.
                    say = log.warning if self.held else log.info
                    say("no usable host: holding the job (%s)", decision.reason)
                self.waiting_for = decision.reason
                self.status = (
                    f"waiting for a host: {decision.reason}; gives up in "
                    f"{decision.deadline - now:.0f}s"
                )
                await trio.sleep(HOLD_POLL_S)
                continue
            self.waiting_for = ""
            if newcomers_first is None:  # kept over a round of probes it asks for
                newcomers_first = random.random() < NEWCOMER_SHARE
            batch = self._batch(decision.hosts, newcomers_first=newcomers_first)
            if self._wants_probes(batch, newcomers_first and not probed_for_share):
                probed_for_share = newcomers_first
                if await self.probe_newcomers():
                    continue  # look at the book again, with the probes' verdicts
            newcomers_first, probed_for_share = None, False
            if not batch:  # only unproven hosts, none left to probe now
                await trio.sleep(HOLD_POLL_S)
                continue
            held = await self._propose_batch([offers[h] for h in batch])
            if held is not None:
                choice.leased(held.proposal.host, now=self.runtime.clock())
                self.held.append(held)
                self.desk.open_account(held.proposal, counts_bytes=True)
                await self.withdraw_bid()  # filled: it no longer waits in anyone's book
                return held
            await trio.sleep(0.25)

    def _batch(self, hosts: tuple[str, ...], *, newcomers_first: bool) -> list[str]:
        """The hosts to propose to at once (``market.matcher.proposal_batch``).
        ``newcomers_first``: this match is one of the newcomers' share."""
        return proposal_batch(
            hosts, self.entries, at_once=PROPOSALS_AT_ONCE, newcomers_first=newcomers_first
        )

    def _wants_probes(self, batch: list[str], newcomers_first: bool) -> bool:
        """Whether this match should wait for probes: it has no host to try (then it
        probes round after round), or it is one of the newcomers' share and has no
        newcomer to try (then it waits for one round at most: a flood of hosts that answer
        nothing must not hold the match)."""
        if not batch:
            return True
        return newcomers_first and all(self.entries.get(h) is not Entry.NEWCOMER for h in batch)

    # --- liveness probes ------------------------------------------------------------

    async def probe_newcomers(self) -> int:
        """Probe the unproven hosts whose offers meet the bid, within the budget
        (``market.liveness``), hosts priced like the market before those priced far
        below it; wait for the verdicts.

        Returns:
            How many probes were sent.
        """
        if self.bid is None:
            return 0
        book, now = self.runtime.book, self.runtime.clock()
        entry = entry_of(book, self.bid, self.has_record)
        tiers: dict[str, int] = {}  # priced like the market 0, far below it 1
        for resting in book.candidates(self.bid):
            host = resting.order.host
            if host not in tiers and not self.has_record(host):
                tiers[host] = int(entry(resting.order) is not Entry.NEWCOMER)
        due = self.liveness.due(tiers, now=now, tier=tiers)
        async with trio.open_nursery() as nursery:
            for host in due:
                nursery.start_soon(self._probe, host)
        return len(due)

    async def keep_probing(self) -> None:
        """Probe newcomers as their offers arrive, so that a proven one can take the
        newcomer slot of any match."""
        while True:
            await self.probe_newcomers()
            await trio.sleep(PROBE_POLL_S)

    async def _probe(self, host: str) -> None:
        rt = self.runtime
        try:
            evidence = await call_probe(
                rt.mesh.host, peer_of(host), self.liveness, clock=rt.clock, reach=self._reach,
                nonce=secrets.token_bytes(CHALLENGE_SIZE),
            )  # fmt: skip
        except LivenessProofError as exc:
            log.warning("host %s: its answer to a liveness probe is refused: %s", host[:12], exc)
        except (CumulusError, BaseLibp2pError, trio.TooSlowError, OSError) as exc:
            log.info("host %s answered no liveness probe: %s", host[:12], exc or type(exc))
        else:
            log.info("host %s is alive: %d shares free", host[:12], evidence.free_shares)
        # A host that missed is set aside by ``self.liveness`` itself (it is never proposed
        # to until it answers), for a backoff that doubles with each miss; the job's
        # ``HostChoice`` is not told: its backoff and its wait for a fresh offer would
        # hold an honest host whose probe was lost to a busy machine for 15 s or more.

    async def _propose_batch(self, offers: list[Offer]) -> Held | None:
        """Propose to every offer's host at once; return the grant of the best one that
        granted, once every better one has answered. Grants that lose are closed."""
        pending = object()
        answers: list[object] = [pending] * len(offers)
        decided = trio.Event()
        winner: list[Held] = []

        def decide() -> None:
            for answer in answers:
                if answer is pending:
                    return
                if isinstance(answer, Held):
                    winner.append(answer)
                    break
            decided.set()

        async def one(i: int, offer: Offer) -> None:
            answers[i] = await self._propose(offer)
            if decided.is_set():
                if isinstance(answers[i], Held):
                    await self._release(answers[i])  # type: ignore[arg-type]
                return
            decide()
            if decided.is_set():
                for answer in answers:
                    if isinstance(answer, Held) and answer is not (winner or [None])[0]:
                        await self._release(answer)

        if self.nursery is None:
            async with trio.open_nursery() as nursery:
                for i, offer in enumerate(offers):
                    nursery.start_soon(one, i, offer)
        else:
            for i, offer in enumerate(offers):
                self.nursery.start_soon(one, i, offer)
            await decided.wait()
        return winner[0] if winner else None

    async def _release(self, held: Held) -> None:
        """Close a lease granted by a proposal that lost to a better one."""
        try:
            await call_close_lease(
                self.runtime.mesh.host, peer_of(held.proposal.host), held.proposal.lease_id
            )
        except (CumulusError, BaseLibp2pError, trio.TooSlowError, OSError) as exc:
            log.info("could not close the extra lease %s: %s", held.proposal.lease_id, exc)

    def _candidates(self, now: float) -> dict[str, Offer]:
        """The best offer of each host that meets the bid, best host first; every offer
        in the book is shown to the choice first (a newer nonce is a sign of life)."""
        self._see_offers(now)
        if self.bid is None:
            return {}
        book = self.runtime.book
        hosts = {r.order.host for r in book.offers()}
        scores = self.runtime.reputation.scores_for_matcher(hosts, now=now)
        entry = entry_of(
            book, self.bid, self.has_record, alive=lambda h: self.liveness.alive(h, now=now)
        )
        ranked = rank_offers(book, self.bid, reliability=scores, limit=RANKED_OFFERS, entry=entry)
        best: dict[str, Offer] = {}
        devices: Counter[str] = Counter()  # the devices each host could lease this job
        taken = self.elsewhere()
        for r in ranked:
            o = r.offer
            if (o.host, o.offer_id) in taken or self.pinned not in ("", o.host):
                continue
            if (o.host, o.offer_id, o.nonce) not in self.full_offers:
                best.setdefault(o.host, o)
                devices[o.host] += 1
        self.entries = {host: entry(offer) for host, offer in best.items()}
        regions = {host: offer.region for host, offer in best.items()}
        first = self.near()
        order = near_first(
            list(best),
            self.entries,
            regions,
            first.region if first else "",
            rig=first.host if first else "",
            devices=devices,
            wanted=self.options.gpus,
        )
        return {h: best[h] for h in order}

    def has_record(self, host: str) -> bool:
        """Whether ``host`` has a record: credible evidence of paid leases, or a lease
        granted to this consumer."""
        return host in self.granted_by or self.runtime.book.vouched(host)

    def _see_offers(self, now: float) -> None:
        for resting in self.runtime.book.offers():
            self.choice.see_offer(resting.order.host, resting.order.nonce, now=now)

    async def _propose(self, offer, proposal: LeaseProposal | None = None) -> Held | None:
        """Propose a lease of ``offer`` (by default, the bid's compute lease)."""
        rt, now = self.runtime, self.runtime.clock()
        proposal = proposal or LeaseProposal(
            secrets.token_hex(16), rt.peer_id, offer.host, offer.offer_id, offer.nonce,
            self.options.shares, self._price_on(offer), now,
            self.options.duration_s,
            self.options.priority, now + 60, rt.mesh.next_nonce(),
        )  # fmt: skip
        peer = peer_of(offer.host)
        grant = None
        with trio.move_on_after(PROPOSE_TIMEOUT_S):
            try:
                await self._reach(peer)
                grant = await call_propose_lease(
                    rt.mesh.host,
                    peer,
                    seal_message(rt.identity, proposal, now=now),
                    timeout=PROPOSE_TIMEOUT_S,
                )
            except LeaseRefusedError as exc:
                log.info("host %s refused the lease: %s", offer.host[:12], exc)
                self.last_refusal = f"host {offer.host[:12]} refused: {exc.detail}"
                if exc.reason in _FULL_OFFER:
                    self.full_offers.add((offer.host, offer.offer_id, offer.nonce))
                elif exc.reason not in _STALE_OFFER:
                    self.choice.failed(
                        offer.host, now=rt.clock(), nonce=offer.nonce, reason="refused a lease"
                    )
                return None
            except (CumulusError, BaseLibp2pError, trio.TooSlowError, OSError) as exc:
                # Its offer may be a dead host's, resting in the book until it expires.
                log.info("host %s unreachable for a lease: %s", offer.host[:12], exc)
                self.choice.failed(offer.host, now=rt.clock(), nonce=offer.nonce)
                return None
        if grant is None:
            log.info("host %s ignored a lease proposal", offer.host[:12])
            self.choice.failed(
                offer.host, now=rt.clock(), nonce=offer.nonce, reason="ignored a proposal"
            )
            return None
        self.granted_by.add(offer.host)
        if not grant.endpoints:
            log.info("host %s gave no session endpoint", offer.host[:12])
            return None
        key = peer.extract_public_key().to_bytes()
        return Held(grant.lease, proposal, offer, key, self._likeliest_first(peer, grant.endpoints))

    def _price_on(self, offer: Offer) -> int:
        """What this job proposes to pay on ``offer`` (the book gave it as a candidate)."""
        price = proposed_price(offer, self.bid, pay_bid=self.options.pay_bid)
        return offer.price if price is None else price

    def _likeliest_first(self, peer, endpoints: tuple[str, ...]) -> tuple[str, ...]:
        """The session endpoints on an address this node knows the host's libp2p
        listener at come first: the network between them is known to work."""
        store = self.runtime.mesh.host.get_peerstore()
        known = {str(a).split("/")[2] for a in store.addrs(peer) if str(a).startswith("/ip")}
        return tuple(sorted(endpoints, key=lambda e: e.rpartition(":")[0] not in known))

    async def _reach(self, peer, *, afresh: bool = False) -> None:
        """Connect to a host: at its own addresses, else through a relay (it may have
        none that can be dialed: behind NAT, it is reachable only through its relays).
        ``afresh``: even if a connection is held (it may be dead: a relay cut it)."""
        mesh = self.runtime.mesh
        # Each failed dial (ours, the DHT's, the auto-connector's: they go on while a host
        # is down) blocks the peer in py-libp2p's negative cache for a minute, checked
        # before even an open connection is reused; a host restarted since would stay
        # unreachable that long. This dial is meant: ``HostChoice`` let the host be tried.
        mesh.host.get_network().unblock_peer(peer)
        if not afresh and peer in mesh.host.get_connected_peers():
            return
        info = await mesh.dht.find_peer(peer)
        failures = []
        if info is not None and info.addrs:
            try:
                await connect(mesh.host, info)
                return
            except PeerUnreachableError as exc:
                failures.append(f"directly: {exc}")
        for relay in mesh.config.relays or mesh.config.bootstrap:
            try:
                await mesh.connect_via_relay(relay, peer)
                return
            except (CumulusError, BaseLibp2pError, OSError, trio.TooSlowError) as exc:
                failures.append(f"via {relay}: {exc}")
        raise CumulusError("cannot reach the host (" + "; ".join(failures or ["no path"]) + ")")

    def _no_match_reason(self, patience: float, gave_up: str) -> str:
        offers = [r.order for r in self.runtime.book.offers()]
        o = self.options
        if self.last_refusal:
            return (
                f"{len(offers)} offer(s) seen in {patience:.0f}s; the hosts refused the "
                f"lease (last: {self.last_refusal})."
            )
        if self._candidates(self.runtime.clock()):
            return f"{gave_up}. Give the job longer (--wait-for-host), or more hosts."
        devices = {(offer.host, offer.offer_id) for offer in offers}
        if devices and devices <= set(self.elsewhere()):
            return (
                f"every device offered ({len(devices)}) already serves another rank of this "
                f"job, and a job of {o.gpus} GPUs leases a device per rank. Wait for more "
                "providers, or lower --gpus."
            )
        if not offers:
            return (
                f"no offers reached this node within {patience:.0f}s. Check --bootstrap, "
                "or wait for providers to join and try again."
            )
        return (
            f"{len(offers)} offer(s) seen in {patience:.0f}s, none meets the bid "
            f"(min VRAM {o.min_vram_mib} MiB, min perf {o.min_perf}, max price "
            f"{o.max_price / 1e6:g}/share-hour, models {list(o.gpu_models) or 'any'}). "
            f"Largest VRAM offered: {max(x.vram_mib for x in offers)} MiB; cheapest price: "
            f"{min(x.price for x in offers) / 1e6:g}{_floors(offers, o)}"
            f"{_overcommitted(offers, o)}. Relax the requirements and retry."
        )

    # --- the shim's requests ----------------------------------------------------------

    def note_receipt(self, countersigned) -> None:
        """A status line for each receipt countersigned: what it charged, and the cost."""
        receipt = countersigned.receipt
        status.info(
            "receipt %d from %s: %d share-s, %s; cost so far %.6f credits",
            receipt.seq, receipt.host[:12], receipt.share_seconds,
            _megabytes(receipt.bytes_moved), self.cost() / 1e6,
        )  # fmt: skip

    def note_refused(self, host: str, why: str) -> None:
        """A receipt from ``host`` was refused (an overcharge): never lease from it again
        in this job.
        Its session goes on until the host pauses it; the failover that follows then
        leases elsewhere, even when the pause falls at the end of the lease's term."""
        log.warning("refused a receipt from host %s: %s", host[:12], why)
        self.choice.ban(host, "overcharged")

    def take_path(self, lease_id: str, path: str) -> None:
        """The shim says which path its session channel for ``lease_id`` took."""
        for held in self.held:
            if held.proposal.lease_id == lease_id:
                held.path = path

    def take_usage(self, usage: control.Usage) -> None:
        """The shim's byte counts per lease, which receipts are checked against, the ops
        its session has sent, and the transfer under way."""
        for lease_id, total in usage.bytes_by_lease.items():
            self.desk.count_bytes(lease_id, total)
        for lease_id, total in usage.peer_bytes_by_lease.items():
            self.desk.count_peer_bytes(lease_id, total)
        self.ops = max(self.ops, usage.ops)
        self.collectives_through_consumer |= usage.through_consumer
        self.peer_links = usage.peer_links or self.peer_links
        self.transfer = usage.transfer
        self.counts_final = self.counts_final or usage.final
        self.counts_reported.set()
        self.counts_reported = trio.Event()

    async def fresh_counts(self) -> None:
        """Wait (briefly) for counts newer than a receipt request that just came: the
        host's count includes frames from after the shim's last report. Once the shim
        sent its final counts (its session closed), or the script ended, none come."""
        if self.exit_code is None and not self.counts_final:
            with trio.move_on_after(4 * control.USAGE_EVERY_S):
                await self.counts_reported.wait()

    @property
    def sessions(self) -> list[Held]:
        """The leases the script's session ran under, oldest first."""
        return [h for h in self.held if h.role is LeaseRole.SESSION]

    async def current_ticket(self) -> control.SessionTicket:
        live = [h for h in self.sessions if h.state is LeaseState.HELD]
        return await self._ticket(live[-1])

    async def fetch_for_session(self, names: list[str]) -> dict:
        """Have the session's host fetch these blobs from other hosts (``blobshare``)."""
        # blobshare reads the host's blob store (remote/, with torch): imported when a
        # shim first asks, so that a consumer node without one stays light.
        from .blobshare import call_fetch

        held = self.sessions[-1]
        try:
            return await call_fetch(
                self.runtime.mesh.host, peer_of(held.proposal.host), held.proposal.lease_id, names
            )
        except (BaseLibp2pError, trio.TooSlowError, OSError) as exc:
            raise CumulusError(f"the session's host did not answer a fetch: {exc}") from exc

    async def standby_ticket(
        self, lost: str = "", gib: int = 0
    ) -> tuple[control.SessionTicket | None, str]:
        """Where the session's checkpoints are kept: a lease of storage on a host other
        than the session's, taken on the shim's first ask and kept until it is ``lost``
        (why the shim says it is gone: then another is leased, of ``gib`` GiB when the
        checkpoint outgrew the last). None, and why, when none could be had: the
        consumer's disk keeps them."""
        live = [h for h in self.held if h.role is LeaseRole.STANDBY and h.state is LeaseState.HELD]
        if live and lost:
            if gib:
                await self._outgrown(live[-1], gib)
            else:
                host = live[-1].proposal.host[:12]
                log.warning("the standby on host %s is gone (%s)", host, lost)
                await self._lease_lost(live[-1])
            live, self.no_standby = [], ""
        if live:
            return await self._ticket(live[-1]), ""
        if not self.no_standby:
            held = await self._lease_standby(gib)
            if held is not None:
                return await self._ticket(held), ""
        return None, self.no_standby

    async def _outgrown(self, held: Held, gib: int) -> None:
        """The checkpoint grew past what ``held`` lends: the host kept its terms, so its
        lease ends and settles without blame, and a standby of ``gib`` GiB is leased."""
        log.warning(
            "the checkpoint outgrew the standby on host %s (%d GiB); leasing one of %d GiB",
            held.proposal.host[:12], held.proposal.storage_gib, gib,
        )  # fmt: skip
        held.state = LeaseState.ENDED
        try:
            await self.close_lease(held)
        except (CumulusError, BaseLibp2pError, trio.TooSlowError, OSError) as exc:
            log.warning("lease %s not settled yet: %s", held.proposal.lease_id, exc)

    async def _lease_standby(self, gib: int = 0) -> Held | None:
        """Lease a standby of ``gib`` GiB, at least ``--standby-gib``."""
        rt, o, now = self.runtime, self.options, self.runtime.clock()
        gib = max(gib, o.standby_gib)
        orders = [r.order for r in rt.book.offers()]
        offers = choose_standby(
            orders,
            exclude=self.sessions[-1].proposal.host,
            gib=gib,
            max_price=o.max_storage_price,
            now=now,
            scores=rt.reputation.scores_for_matcher({order.host for order in orders}, now=now),
            duration_s=o.duration_s,
            usable=lambda host: self.choice.usable(host, now=now),
            limit=PROPOSALS_AT_ONCE,
        )
        if not offers:
            self.no_standby = (
                f"no other host offers {gib} GiB for a standby at "
                f"{o.max_storage_price / 1e6:g} credits per GiB-hour or less"
            )
        for offer in offers:
            proposal = standby_proposal(
                offer, consumer=rt.peer_id, lease_id=secrets.token_hex(16), gib=gib,
                start_at=now, duration_s=o.duration_s, expires_at=now + 60,
                nonce=rt.mesh.next_nonce(),
            )  # fmt: skip
            held = await self._propose(offer, proposal)
            if held is not None:
                held.role = LeaseRole.STANDBY
                self.held.append(held)
                self.desk.open_account(held.proposal, counts_bytes=True)
                log.info("standby: host %s keeps the checkpoints", offer.host[:12])
                return held
        self.no_standby = self.no_standby or f"no host granted a standby ({self.last_refusal})"
        log.info("no standby: %s; checkpoints go to the consumer's disk", self.no_standby)
        return None

    async def _ticket(self, held: Held) -> control.SessionTicket:
        door = "" if self.doors is None else await self.doors.door(held.proposal.host)
        return control.SessionTicket(
            held.proposal.host, held.endpoints, held.host_key, held.lease.to_bytes(), door,
            held.offer.perf_units, held.proposal.lease_id,
        )  # fmt: skip

    async def check_probe(self, wire: object) -> str | None:
        """Judge the shim's probe of the current lease's device against its offer.

        A host that misrepresents is reported (the measured performance against the
        offer's claim), never leased again in this job, and replaced by a new lease
        before this returns; the shim then ends the session (the host settles the probe's
        seconds) and opens one under the new lease.

        Raises:
            CumulusError: the facts are malformed, or no other host could be leased.
        """
        try:
            facts = ProbeFacts.from_wire(wire)
        except ValueError as exc:
            raise CumulusError(f"malformed probe facts: {exc}") from exc
        held = next((h for h in reversed(self.sessions) if h.state is LeaseState.HELD), None)
        if held is None:
            raise CumulusError("no lease is held: nothing to judge the probe against")
        why = judge(held.offer, facts, on_demand=held.proposal.priority is PriorityClass.ON_DEMAND)
        if why is None:
            log.info("host %s's device fits its offer: %s", held.proposal.host[:12], facts)
            return None
        log.warning("host %s misrepresents its device: %s", held.proposal.host[:12], why)
        held.state = LeaseState.MISREPRESENTED
        self.choice.ban(held.proposal.host, "misrepresented its device")
        await self._report_measurement(held, facts)
        self.status = "leasing again: the last host misrepresented its device"
        await self.lease()
        self.status = "running"
        return why

    async def _report_measurement(self, held: Held, facts: ProbeFacts) -> None:
        o = held.offer
        offer = self.runtime.offer_envelopes.get((o.host, o.offer_id, o.nonce))
        if offer is None:
            log.warning("cannot report host %s: its offer has expired", held.proposal.host[:12])
            return
        measured_at = min(self.runtime.clock(), held.proposal.end_at)
        evidence = PerformanceObservation(
            held.lease, held.host_key, offer, facts.perf_units, measured_at
        )
        await self.runtime.report(held.proposal.host, evidence)

    async def take_notice(self, lease_id: str, kind: str, detail: str, sender: str) -> str | None:
        """A host says it ends one of our leases early (it is leaving, or an on-demand
        lease preempted this one): remember it, so that the failover the session is
        about to ask for files no report. The host is set aside until it announces
        again: a preempting host does once shares free up, and the session may resume
        there."""
        held = next((h for h in self.held if h.proposal.lease_id == lease_id), None)
        refusal = notice_refusal(None if held is None else held.proposal, kind, sender)
        if refusal is not None:
            return refusal
        assert held is not None
        if held.state is not LeaseState.HELD:
            return None  # told twice, or after the lease ended: nothing more to do
        preempted = kind == NOTICE_PREEMPTED
        what = "preempted this lease" if preempted else "is leaving"
        log.warning("host %s %s (%s); moving the session", sender[:12], what, detail)
        held.state = LeaseState.PREEMPTED if preempted else LeaseState.LEFT
        now = self.runtime.clock()
        self._see_offers(now)  # its offers so far are from before the notice
        self.choice.left(sender, now=now)
        return None

    async def failover(self, reason: str, regroups: bool = False) -> control.SessionTicket:
        """The session lost its host: lease again and return where to resume.
        ``regroups``: its collective group goes back with it (``remote/regroup.py``), so
        even a rank of a job of several GPUs moves.

        A lease past its term was ended by the host as agreed: its host stays welcome
        (the session waits there, parked, to be resumed under a new lease). A host that
        said it was leaving waits to announce again. A host that dropped the session
        before the term ended without a word vanished: it is reported and set aside for
        a backoff (``market.hostchoice``). While no host is usable the job is held, up to
        ``wait_for_host``; the script's state is safe in its checkpoints meanwhile.
        """
        self.status = f"failover: {reason}"
        self.failovers += 1
        log.warning("failing over: %s", reason)
        sessions = self.sessions
        live = [h for h in sessions if h.state is LeaseState.HELD]
        lost = not live or sessions[-1].state in (LeaseState.LEFT, LeaseState.PREEMPTED)
        if not lost:
            if HANGUP_PAUSED in reason and self._resumable(live[-1]):
                self.status = "running"
                return await self._ticket(live[-1])
            lost = await self._lease_lost(live[-1])
            if not lost:
                self.status = "renewing the lease"
        if lost and not (self.movable or regroups):
            self.status = f"host lost: {reason}"
            raise CumulusError(
                f"this rank's host is gone ({reason}), and its collective group cannot go "
                "back with it while its checkpoints go to a standby host: the job ends. "
                "Run it again with --checkpoint-to consumer, and a lost host costs a pause."
            )
        # Renewed at its term, an unmovable session stays where its group is.
        self.pinned = "" if self.movable or lost else sessions[-1].proposal.host
        try:
            held = await self.lease()
        finally:
            self.pinned = ""
        self.status = "running"
        return await self._ticket(held)

    def _resumable(self, paused: Held) -> bool:
        """Whether the session of ``paused``, which its host paused for a receipt it
        could not settle (this node was slow to answer, or the answer was lost), resumes
        there: the host asks for the receipt again every second, this node pays it, and
        the dial waits for the lease to run again (``node.dial``). Not once the term is
        over, or when the host is set aside (it overcharged): the lease is then lost, as
        a session dropped without a word."""
        proposal, now = paused.proposal, self.runtime.clock()
        if now >= proposal.end_at - LEASE_END_SLACK_S:
            return False
        if not self.choice.usable(proposal.host, now=now):
            return False
        log.warning(
            "host %s paused the lease for an overdue receipt; resuming there once it is paid",
            proposal.host[:12],
        )
        return True

    async def _lease_lost(self, gone: Held) -> bool:
        """A lease's session ended without a word: at its term, as agreed (False: its host
        stays welcome); before it, the host vanished (True: reported, and set aside for a
        backoff)."""
        now = self.runtime.clock()
        if now >= gone.proposal.end_at - LEASE_END_SLACK_S:
            gone.state = LeaseState.ENDED
            return False
        gone.state = LeaseState.FAILED
        self._see_offers(now)  # its offers so far are from before it failed
        backoff = self.choice.failed(gone.proposal.host, now=now, nonce=gone.offer.nonce)
        log.warning("host %s set aside for %.0f s", gone.proposal.host[:12], backoff)
        await self._report_failure(gone)
        return True

    async def _report_failure(self, gone: Held) -> None:
        now = self.runtime.clock()
        ended = min(now, gone.proposal.end_at)
        evidence = LeaseFailure(gone.lease, gone.host_key, FailureReason.VANISHED, ended)
        await self.runtime.report(gone.proposal.host, evidence)

    async def settle_leases(self) -> None:
        """Close each lease whose host is still there, once the script has ended."""
        # The host sends its last receipt when it sees the session end; closing the lease
        # waits for exactly that, so both ledgers end up with the same receipts.
        for held in self.held:
            if held.state in (LeaseState.FAILED, LeaseState.LEFT):  # the host is gone
                continue
            try:
                await self.close_lease(held)
            except (CumulusError, BaseLibp2pError, trio.TooSlowError, OSError) as exc:
                log.warning("lease %s not settled: %s", held.proposal.lease_id, exc)

    async def close_lease(self, held: Held) -> None:
        """End ``held`` with its host, which answers with its last receipt."""
        host, peer = self.runtime.mesh.host, peer_of(held.proposal.host)
        try:
            await call_close_lease(host, peer, held.proposal.lease_id)
        except (BaseLibp2pError, OSError):
            # The connection may be gone (a relay cut its circuit): once more over a new one.
            await self._reach(peer, afresh=True)
            await call_close_lease(host, peer, held.proposal.lease_id)

    async def report_service(self) -> None:
        """Gossip a service record for each lease that was receipted."""
        for held in self.held:
            receipts = tuple(
                e.countersigned
                for e in self.desk.ledger.entries()
                if e.lease_id == held.proposal.lease_id
            )[:MAX_RECEIPTS]
            if receipts:
                record = ServiceRecord(held.lease, held.host_key, receipts)
                await self.runtime.report(held.proposal.host, record)

    # --- status ---------------------------------------------------------------------

    def cost(self) -> int:
        """Micro-credits receipted so far, over all leases."""
        leases = {h.proposal.lease_id: h.proposal for h in self.held}
        return sum(
            leases[e.lease_id].owed(e.share_seconds)
            for e in self.desk.ledger.entries()
            if e.lease_id in leases
        )

    def _standing(self) -> dict | None:
        """While the job waits for a host: the bids ahead of its own, and the price that
        would lease it now (``matcher.standing``)."""
        if self.bid is None or not self.waiting_for:
            return None
        where = standing(self.runtime.book, self.bid)
        return {
            "bids_ahead": where.bids_ahead,
            "run_now_price": where.run_now_price,
            "max_price": self.bid.max_price,
        }

    def lease_rows(self) -> list[dict]:
        """Each lease as status shows it, oldest first."""
        return [_held_row(h, self.desk) for h in self.held]

    def snapshot(self) -> dict:
        return self.runtime.snapshot() | {
            "role": "consumer",
            "status": self.status,
            "command": list(self.options.command),
            "leases": self.lease_rows(),
            "failovers": self.failovers,
            "waiting_for": self.waiting_for,
            "standing": self._standing(),
            "hosts_set_aside": _set_aside_rows(self.choice, self.runtime.clock()),
            "liveness": dataclasses.asdict(self.liveness.statistics(now=self.runtime.clock())),
            "ops": self.ops,
            "collectives_through_consumer": self.collectives_through_consumer,
            "peer_links": self.peer_links,
            "transfer": None if self.transfer is None else self.transfer.to_wire(),
            "cost": self.cost(),
        }


def _megabytes(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def _set_aside_rows(choice: HostChoice, now: float) -> list[dict]:
    return [
        {"host": v.host, "standing": v.standing.value, "evidence": v.evidence,
         "usable_from": v.usable_from, "reason": v.reason}
        for v in choice.view(now=now)
    ]  # fmt: skip


def _held_row(held: Held, desk: ReceiptDesk) -> dict:
    entries = [e for e in desk.ledger.entries() if e.lease_id == held.proposal.lease_id]
    share_seconds = sum(e.share_seconds for e in entries)
    return {
        "lease_id": held.proposal.lease_id,
        "host": held.proposal.host,
        "offer": held.proposal.offer_id,
        "endpoints": list(held.endpoints),
        "path": held.path,
        "price": held.proposal.price,
        "start_at": held.proposal.start_at,
        "receipts": len(entries),
        "share_seconds": share_seconds,
        "cost": held.proposal.owed(share_seconds),
        "bytes": sum(e.bytes_moved for e in entries),
        "peer_bytes": sum(e.peer_bytes for e in entries),
        "bytes_counted": desk.counted_bytes(held.proposal.lease_id),
        "state": held.state.value,
        "role": held.role.value,
    }


#: How ``torch.distributed``'s launcher is named on a command line: ``torchrun`` or
#: ``python -m torch.distributed.run``.
LAUNCHER_MODULE = "torch.distributed.run"


def script_command(
    command: tuple[str, ...], *, cuda_compat: bool, native: bool = False
) -> list[str]:
    """The child's command line: the script under the shim, with this interpreter.

    Accepts ``python train.py args``, ``python -m module args`` or ``train.py args``; and
    ``torchrun [flags] train.py args``, whose every rank runs the script under the shim.

    Raises:
        CumulusError: The command is not a Python script (the shim must run in-process).
    """
    shim = ["-m", "cumulus_p2p.shim"]
    if native:
        shim.append("--native")
    if not cuda_compat:
        shim.append("--no-cuda-compat")
    launched = launcher_arguments(command)
    if launched is not None:
        flags, script = launched
        return [sys.executable, "-m", LAUNCHER_MODULE, *flags, *shim, *script]
    args = without_interpreter(command)
    if not args or not (args[0].endswith(".py") or args[0] == "-m"):
        raise CumulusError(
            f"--consume runs a Python script: give `-- python train.py [args]`, "
            f"`-- python -m package.module [args]` or `-- torchrun [flags] train.py [args]`, "
            f"not {' '.join(command)!r}"
        )
    return [sys.executable, *shim, *args]


def launcher_arguments(command: tuple[str, ...]) -> tuple[list[str], list[str]] | None:
    """For a ``torchrun`` command, its own flags and the script with its arguments; None
    for any other command.

    Raises:
        CumulusError: torchrun runs no ``.py`` script (a module or a binary cannot run
            under the shim).
    """
    args = without_interpreter(command)
    if args[:2] == ["-m", LAUNCHER_MODULE]:
        args = args[2:]
    elif args and os.path.basename(args[0]) == "torchrun":
        args = args[1:]
    else:
        return None
    script = next((i for i, arg in enumerate(args) if arg.endswith(".py")), None)
    if script is None or "-m" in args[:script] or "--module" in args[:script]:
        raise CumulusError(
            "--consume runs torchrun's ranks under the cumulus shim, which takes a script: "
            f"give `-- torchrun --nproc-per-node N train.py [args]`, not {' '.join(command)!r}"
        )
    return args[:script], args[script:]


def without_interpreter(command: tuple[str, ...] | list[str]) -> list[str]:
    """``command`` without a leading ``python`` (any ``python3.11``, any path to one)."""
    args = list(command)
    return args[1:] if args and os.path.basename(args[0]).startswith("python") else args


def notice_refusal(proposal: LeaseProposal | None, kind: str, sender: str) -> str | None:
    """Why a lease notice from ``sender`` about ``proposal`` (None: no lease of ours by
    that id) is refused: not that lease's host, or a preemption of an on-demand lease,
    which nothing preempts. None: the notice stands."""
    if proposal is None or proposal.host != sender:
        return "no such lease with this host"
    if kind == NOTICE_PREEMPTED and proposal.priority is PriorityClass.ON_DEMAND:
        return "an on-demand lease is never preempted"
    return None


def _overcommitted(offers, options: ConsumerOptions) -> str:
    """For a bid that met nothing: whether the offers overcommit more memory than it
    accepts (``--max-overcommit``)."""
    least = min(x.overcommit_pct for x in offers)
    if least <= options.max_overcommit_pct:
        return ""
    return (
        f"; every host overcommits its memory (least: {least / 100:g}x) past your "
        f"--max-overcommit {options.max_overcommit_pct / 100:g}"
    )


def _floors(offers, options: ConsumerOptions) -> str:
    """For a bid that met nothing: the lowest contend price on offer, and for one that is
    not contending, whether a contending lease would have fit its limit."""
    floors = [x.contend_price for x in offers if x.contend_price]
    if options.priority is PriorityClass.CONTEND:
        return (
            f"; lowest contend price: {min(floors) / 1e6:g}"
            if floors
            else ("; no host sells contending leases")
        )
    if floors and min(floors) <= options.max_price:
        return (
            f"; a contending lease fits your limit (--priority contend: below on-demand "
            f"tenants, from {min(floors) / 1e6:g})"
        )
    return ""
