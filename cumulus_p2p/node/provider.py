"""``cumulus-node --provide``: offer this machine's device, lease it, run the op streams.

One trio program composes:

- the ``Runtime`` (mesh, book, reputation);
- each device offered (every GPU ``hardware.detect`` found, else the CPU), an offer of
  its own, served by a ``WorkerSupervisor`` of its own (a worker process per session:
  the default with CUDA) or an in-process ``Executor``; while a supervisor finds its
  device unhealthy, that device's offer is withdrawn;
- the secure session channel on TCP, admitting only consumers that present a lease this
  host countersigned and that is still held (``_Leases.authorize``);
- a ``LeaseBook`` behind the lease protocol, whose offers are re-announced on the mesh
  with the shares still free (each withdrawn while none are); a lease names its offer,
  so its session runs on that offer's device;
- a ``Meter`` per session: receipts every ``receipt_interval`` and at the session's end,
  countersigned by the consumer over ``/cumulus/receipt/1.0.0``, then kept in the ledger.

Nothing runs unpaid (``payment.PaymentEnforcer``, deciding by
``market.lease_state``). A receipt unsettled for ``settle_grace`` seconds pauses the
lease: its session is hung up on (and parked, as at the end of a term) and the consumer
is refused until it settles. Unsettled for twice that, the lease ends, its shares go
back on offer and the host gossips signed ``NonPayment`` evidence against the consumer;
with ``min_consumer_score`` set, consumers that such evidence scores below it are
refused leases.

Status reads change nothing: a lease's op rate comes from samples the serving side
takes once a second (``sample_ops``), so any number of readers see the same row.

Leaving is orderly (``leave``, on SIGTERM or Ctrl-C): the offer is cancelled, no lease
is granted, each consumer is told the host is leaving (it moves its session at once and
files no failure report), the sessions are hung up on and their last receipts settled.
A second signal, or ``leave_timeout``, stops the node at once.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import signal
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import partial

import trio
from libp2p.exceptions import BaseLibp2pError

from .._errors import CumulusError
from ..blobs import service as blobservice
from ..blobs.standby import STANDBY_QUOTA
from ..blobs.store import BlobStore
from ..channel.secure import SessionSettings, serve_secure
from ..channel.secure.libp2p_path import handle_libp2p_sessions
from ..channel.transport import CountingChannel
from ..dht import MeshConfig
from ..dht.host import interface_ipv4s, observed_ipv4s
from ..envelope import Envelope
from ..host.executor import DEFAULT_BLOB_CAP, Executor, ExecutorConfig
from ..host.executor_main import build_executor
from ..host.options import DEFAULT_RAM_BYTES, GraphCompiler
from ..host.scheduler import lease_rank
from ..host.session import SessionStats
from ..host.supervisor import WorkerSupervisor
from ..market import (
    BookLimits,
    Cancel,
    Lease,
    LeaseBook,
    LeaseProposal,
    LeaseServer,
    Meter,
    Offer,
    PriorityClass,
    Side,
    serve_leases,
)
from ..market.lease import Reservation
from ..market.lease_state import LeaseEvent, LeaseState
from ..market.messages import (
    MAX_OVERCOMMIT_PCT,
    LeaseKind,
    encode_message,
    peer_id_of,
    seal_message,
)
from ..market.probing import serve_liveness
from ..market.settlement import (
    NOTICE_LEAVING,
    NOTICE_PREEMPTED,
    call_lease_notice,
    serve_lease_close,
)
from ..reputation import BadBlob
from .blobshare import BlobSharing, serve_fetches
from .datadir import DataDir
from .hardware import DeviceFacts, GpuMeter
from .payment import ActiveLease, PaymentEnforcer
from .runtime import Runtime, open_runtime, peer_of

log = logging.getLogger("cumulus_p2p.node.provider")

#: Seconds between samples of each session's op count, the op rate's time base.
OP_SAMPLE_INTERVAL = 1.0
#: Ended leases a provider remembers (for a late close, and status's last rows): a node that
#: serves for months would otherwise keep every lease it ever served.
FINISHED_KEPT = 256
#: The most GiB an offer may lend to standbys, and the most micro-credits an offer may ask
#: (``market.messages.Offer`` refuses more).
MAX_STORAGE_GIB, MAX_PRICE = 2**20, 2**48
#: What a preempted lease's consumer is told.
PREEMPTED_BECAUSE = "an on-demand lease needs its shares; the session is parked on this host"


@dataclass(frozen=True, slots=True)
class OfferedDevice:
    """One device on offer: what ``hardware.detect`` found and its self-benchmark."""

    facts: DeviceFacts
    perf_units: int

    @property
    def offer_id(self) -> str:
        """The offer's name on the mesh, one per device of the node."""
        return f"device{self.facts.index}"


@dataclass(frozen=True, slots=True)
class ProviderOptions:
    """What ``--provide`` was asked to offer.

    Attributes:
        devices: The devices offered, an offer each (distinct indices).
        shares: Share units each device is split into.
        price: Micro-credits per share-hour.
        contend_price: Micro-credits per share-hour a contending lease pays (it runs
            below on-demand tenants, in their idle gaps; 0: none sold).
        contend_shares: Contending shares each device sells beyond its ``shares``
            (never preempted: they hold no on-demand share). Their memory share comes on
            top of the device's, as a contending tenant's does.
        min_lease_s: Shortest lease accepted.
        storage_price: Micro-credits per GiB-hour of a standby lease (disk kept for
            another host's session's checkpoints).
        storage_gib: GiB of disk lent to standby leases, all of them together (0: this
            host keeps no standbys).
        region: Free-form region hint.
        session_host: Address the session channel listens on (None: the libp2p
            listener's, so a node reachable on the network serves sessions there too).
        session_port: Its port (0: any free one).
        advertise_host: The address consumers are told to dial (default: each address
            of the interfaces the session channel listens on).
        receipt_interval: Seconds between receipts.
        settle_grace: Seconds a receipt may stay unsettled before the lease pauses (it
            ends after twice that); None: two receipt intervals.
        min_consumer_score: Refuse leases to consumers whose payment record scores
            below this (0: lease to anyone).
        leave_timeout: Seconds an orderly stop may take before it is forced.
        grace_period: Seconds a dropped session may take to resume.
        workers: A worker process per session (None: when a device is a GPU).
        pool: Worker processes kept started for the next lease, per device.
        graph_compiler: How the executor runs compiled graphs (``graph_compiler.py``).
        blob_cap: Bytes of disk the blob store (``<data dir>/blobs``) may take.
        ram_tier: Bytes of host memory that sessions evicted from a GPU may hold
            together; past it they go to the blob store.
        overcommit: How many times its memory each device sells (1.0..2.0): a share
            grants 1/``shares`` of the device's memory, and ``overcommit * shares`` of
            them are sold. The executor pages idle tenants' memory out to make room
            (``host/eviction.py``); the offer says so (``Offer.overcommit_pct``).
        peer_links: Whether other hosts can connect to this one (``--no-peer-links``:
            not); a job of several GPUs runs its collectives through its consumer if not.
    """

    devices: tuple[OfferedDevice, ...]
    shares: int
    price: int
    min_lease_s: int = 0
    region: str = ""
    session_host: str | None = None
    session_port: int = 0
    advertise_host: str | None = None
    receipt_interval: float = 30.0
    settle_grace: float | None = None
    min_consumer_score: float = 0.0
    leave_timeout: float = 30.0
    grace_period: float = 30.0
    workers: bool | None = None
    pool: int = 1
    graph_compiler: GraphCompiler = GraphCompiler.LOOP
    blob_cap: int = DEFAULT_BLOB_CAP
    ram_tier: int = DEFAULT_RAM_BYTES
    storage_price: int = 0
    storage_gib: int = 0
    contend_price: int = 0
    contend_shares: int = 0
    overcommit: float = 1.0
    peer_links: bool = True

    @property
    def sold_shares(self) -> int:
        """On-demand shares each device sells: ``shares`` times the overcommit."""
        return round(self.shares * self.overcommit)

    @property
    def overcommit_pct(self) -> int:
        """The overcommit as an offer states it."""
        return round(100 * self.overcommit)

    @property
    def unpaid_grace(self) -> float:
        """Seconds a receipt may stay unsettled before the lease pauses."""
        return 2 * self.receipt_interval if self.settle_grace is None else self.settle_grace

    @property
    def uses_workers(self) -> bool:
        """Whether sessions run in worker processes of their own."""
        if self.workers is not None:
            return self.workers
        return any(d.facts.kind == "cuda" for d in self.devices)

    def __post_init__(self) -> None:
        ids = [d.offer_id for d in self.devices]
        if not ids or len(set(ids)) != len(ids):
            raise ValueError(f"offer one or more distinct devices, not {ids}")
        if not 0 <= self.storage_gib <= MAX_STORAGE_GIB:
            raise ValueError(f"storage_gib must be 0..{MAX_STORAGE_GIB}, not {self.storage_gib}")
        if not 0 <= self.storage_price <= MAX_PRICE:
            raise ValueError(f"storage_price must be 0..{MAX_PRICE}, not {self.storage_price}")
        if not 100 <= self.overcommit_pct <= MAX_OVERCOMMIT_PCT:
            raise ValueError(
                f"overcommit must be 1.0..{MAX_OVERCOMMIT_PCT / 100:g}, not {self.overcommit}"
            )
        if not 0 <= self.contend_price <= self.price:
            raise ValueError(
                f"the contend price ({self.contend_price}) must lie between 0 and the price "
                f"({self.price})"
            )
        unpriced = self.contend_shares and not self.contend_price
        if not 0 <= self.contend_shares <= 2**16 or unpriced:
            raise ValueError(
                f"contend_shares ({self.contend_shares}) must be 0..65536, and needs a "
                "contend price"
            )


@dataclass
class Served:
    """A device on offer and the executor running its sessions."""

    device: OfferedDevice
    executor: Executor | WorkerSupervisor
    #: Memory isolation between tenants: a lease gets its shares' part of the device.
    share_bytes: int
    announced: bool = False


class Provider:
    """The provider's state: leases granted, sessions served, receipts settled."""

    def __init__(
        self,
        runtime: Runtime,
        options: ProviderOptions,
        executors: Sequence[Executor | WorkerSupervisor],
    ) -> None:
        self.runtime = runtime
        self.options = options
        self.served = {
            device.offer_id: Served(
                device, executor, device.facts.memory_mib * 2**20 // options.shares
            )
            for device, executor in zip(options.devices, executors, strict=True)
        }
        self.book = LeaseBook(runtime.identity)
        self.active: dict[str, ActiveLease] = {}
        self.finished: deque[ActiveLease] = deque(maxlen=FINISHED_KEPT)
        self.payments = PaymentEnforcer(
            runtime, grace=options.unpaid_grace, on_final=self._on_final
        )
        # By consumer and lease token: a job of several GPUs on one rig opens its ranks'
        # sessions here at once, each under its own lease.
        self._presented: dict[tuple[bytes, bytes | None], LeaseProposal] = {}
        #: Hosts admitted to read kept pieces, and the device whose session keeps them.
        self._readers: dict[bytes, Served] = {}
        #: Its public blobs, announced to and fetched from other hosts (once serving).
        self.sharing: BlobSharing | None = None
        self.endpoints: list[str] = []
        self.session_socket: tuple[str, int] | None = None  # (bound address, port)
        self.leaving = False
        self.meter = GpuMeter()  # GPU utilization for status; ``run_provider`` opens it
        # Leases preempted for on-demand ones, on their way to ``end_preempted``.
        self._preempted, self._to_end = trio.open_memory_channel[Reservation](math.inf)

    # --- offers ---------------------------------------------------------------------

    def free_shares(self, offer_id: str | None = None) -> int:
        """On-demand shares not held by any lease: of one offer, or of every device's
        (None)."""
        return self.options.sold_shares * self._count(offer_id) - self._held(offer_id, False)

    def free_contend_shares(self, offer_id: str | None = None) -> int:
        """Contending shares not held by a contending lease (``free_shares``'s way)."""
        return self.options.contend_shares * self._count(offer_id) - self._held(offer_id, True)

    def _count(self, offer_id: str | None) -> int:
        return len(self.served) if offer_id is None else 1

    def _held(self, offer_id: str | None, contending: bool) -> int:
        return sum(
            r.proposal.shares
            for r in self.book.leases()
            if (offer_id is None or r.proposal.offer_id == offer_id)
            and (r.proposal.priority is PriorityClass.CONTEND) == contending
        )

    def preemptible_shares(self, offer_id: str) -> int:
        """Shares of ``offer_id`` held by interruptible leases: an on-demand lease
        preempts them."""
        return sum(r.proposal.shares for r in self.book.preemptible(offer_id))

    def free_storage(self) -> int:
        """GiB of ``storage_gib`` not held by a standby lease; every offer announces it
        (one disk serves all the devices' offers)."""
        held = sum(r.proposal.storage_gib for r in self.book.leases())
        return max(0, self.options.storage_gib - held)

    def offer_body(self, served: Served, nonce: int, expires_at: float) -> bytes:
        """A device's offer as it stands, sealed afresh each announce round.

        It announces the shares an on-demand lease could have: those free, and those
        that interruptible leases hold (``LeaseBook`` preempts them for it); and the
        contending shares free. The book is told only of those free: a pool reset to
        more would grant them twice. A device none of whose shares is to be had is
        withdrawn within ``keep_offer_current``'s half second; an announce round may
        seal its offer before that, and an offer must name at least one share."""
        device, now = served.device, self.runtime.clock()
        free = self.free_shares(device.offer_id)
        available = free + self.preemptible_shares(device.offer_id)
        contending = self.free_contend_shares(device.offer_id)
        offer = Offer(
            self.runtime.peer_id,
            device.offer_id,
            device.facts.model,
            device.facts.memory_mib,
            device.perf_units,
            available if contending else max(1, available),
            self.options.price,
            self.options.min_lease_s,
            self.options.region,
            now,
            expires_at,
            nonce,
            self.options.storage_price,
            self.free_storage(),
            self.options.contend_price,
            contending,
            self.options.overcommit_pct,
        )
        if free > 0 or contending > 0:
            self.book.publish(dataclasses.replace(offer, shares_free=free))
        return encode_message(offer)

    async def keep_offer_current(self) -> None:
        """Announce each device while it is healthy and has shares free or preemptible
        (``offer_body``); withdraw it otherwise. Expire ended leases."""
        while True:
            self.book.expire(self.runtime.clock())
            for served in self.served.values():
                await self._keep_current(served)
            await trio.sleep(0.5)

    async def _keep_current(self, served: Served) -> None:
        offer_id = served.device.offer_id
        serving = served.executor.health.healthy and not self.leaving
        free = (
            self.free_shares(offer_id)
            + self.preemptible_shares(offer_id)
            + self.free_contend_shares(offer_id)
            if serving
            else 0
        )
        if free > 0 and not served.announced:
            body = partial(self.offer_body, served)
            await self.runtime.mesh.announce(offer_id, Offer.KIND, body)
            served.announced = True
        elif free <= 0 and served.announced:
            self.runtime.mesh.withdraw(offer_id)
            served.announced = False

    def screen(self, consumer: str) -> str | None:
        """Refuse a proposal before the book sees it: while leaving, or from a consumer
        whose payment record is below ``min_consumer_score``."""
        if self.leaving:
            return "this host is shutting down"
        bar = self.options.min_consumer_score
        if bar <= 0:
            return None
        score = self.runtime.reputation.score(consumer, now=self.runtime.clock())
        if score.mean >= bar:
            return None
        return (
            f"this host leases only to consumers whose payment record scores at least "
            f"{bar:g}; yours scores {score.mean:.2f} ({score.failures:.1f} unpaid-lease "
            "weight on record)"
        )

    # --- sessions -------------------------------------------------------------------

    def authorize(self, consumer_key: bytes, token: bytes | None) -> str | None:
        """Admit a consumer presenting a lease this host granted and still holds; or
        another host reading a session's kept pieces by the grant its consumer gave it
        (``blobs.service``: a standby copying a checkpoint, a failover's restore)."""
        grant = blobservice.grant_in(token)
        if grant is not None:
            keeper = next((s for s in self.served.values() if s.executor.holds_grant(grant)), None)
            if keeper is None:
                return "no session on this host keeps pieces under that grant"
            self._readers[consumer_key] = keeper
            return None
        if token is None:
            return "a lease is required: match an offer with cumulus-node --consume"
        try:
            lease = Lease.from_bytes(token)
            proposal = lease.verify(self.runtime.identity.public_key)
        except CumulusError as exc:
            return f"the lease is not valid here: {exc}"
        if proposal.consumer != peer_id_of(consumer_key):
            return "the lease belongs to another consumer"
        active = self._lease(proposal.lease_id)
        # An unpaid lease is refused with what is owed, whether it is paused or already
        # ended: how far its end has come depends only on timing.
        if active is not None and active.state is not LeaseState.RUNNING:
            return f"the lease is {active.state.value}: {self.payments.arrears(active)}"
        if self.book.get(proposal.lease_id) is None:
            return "the lease has ended or was never granted by this host"
        self._presented[consumer_key, token] = proposal
        return None

    async def serve_session(self, channel) -> None:
        """Run one consumer's session on its offer's device, metered under its lease."""
        keeper = self._readers.pop(channel.peer_public_key, None)
        if keeper is not None:
            await keeper.executor.run_session(channel, only_blobs=True)
            return
        proposal = self._presented.pop((channel.peer_public_key, channel.lease_token))
        served = self.served[proposal.offer_id]
        active = self.active.get(proposal.lease_id)
        if active is None:
            lease = self.book.get(proposal.lease_id).lease
            meter = Meter(self.runtime.identity, proposal, interval=self.options.receipt_interval)
            active = ActiveLease(lease, proposal, meter, self.runtime.clock())
            self.active[proposal.lease_id] = active
        active.channels.add(channel)
        try:
            metered = CountingChannel(channel, active.count_bytes, active.count_peer_bytes)
            # The session is served for the lease's term, no longer: then the executor
            # parks it, and the consumer leases again and resumes it.
            left = proposal.end_at - self.runtime.clock()
            # A standby's session keeps blobs on disk, no more than the lease lends, and
            # holds no device memory.
            standby = proposal.kind is LeaseKind.STANDBY
            await served.executor.run_session(
                metered,
                quota_bytes=STANDBY_QUOTA if standby else served.share_bytes * proposal.shares,
                hold_bytes=proposal.storage_gib * 2**30 if standby else None,
                rank=lease_rank(proposal.priority is PriorityClass.ON_DEMAND, proposal.price),
                until=trio.current_time() + max(0.0, left),
            )
        finally:
            active.channels.discard(channel)
            with trio.CancelScope(shield=True):
                await self._end(active)

    async def _end(self, active: ActiveLease) -> None:
        """The lease's last session is over: receipt the rest of its use, try to settle.

        Not when the lease is paused: it lives on, and its consumer may resume the
        parked session once it has settled."""
        if active.channels or active.session_over or active.state is not LeaseState.RUNNING:
            return
        active.session_over = True
        self.book.release(active.proposal.lease_id)
        if not active.meter.finished:
            self.payments.issue(active)
        if active.unsettled:
            active.lifecycle.process(LeaseEvent.SESSION_OVER)
        with trio.move_on_after(10):
            await self.payments.settle(active)
        self.payments.settle_up(active)

    def may_fetch(self, consumer: str, lease_id: str) -> str | None:
        """Whether ``consumer`` may have this host fetch blobs from others for it: only
        for a lease of its own that this host holds (``blobshare``)."""
        held = self.book.get(lease_id)
        if held is None or held.proposal.consumer != consumer:
            return "no lease of yours is held here under that id"
        return None

    async def report_bad_blob(self, statement: Envelope) -> None:
        """Gossip signed evidence that a peer served this host other bytes than asked
        for: its own statement (``blobshare``)."""
        host = peer_id_of(statement.author)
        if await self.runtime.report(host, BadBlob(statement)):
            log.warning("reported peer %s: it served garbage and signed that it did", host[:12])

    def _lease(self, lease_id: str) -> ActiveLease | None:
        """A lease this host served, running or finished."""
        finished = (a for a in self.finished if a.proposal.lease_id == lease_id)
        return self.active.get(lease_id) or next(finished, None)

    def _on_final(self, active: ActiveLease) -> None:
        """A lease ended (settled or unpaid): its shares go back, status keeps it."""
        self.book.release(active.proposal.lease_id)
        self.active.pop(active.proposal.lease_id, None)
        self.finished.append(active)

    async def close_lease(self, lease_id: str, requester: str) -> str | None:
        """The consumer is done: answer once the lease's session ended and is settled."""
        found = self._lease(lease_id)
        if found is None:
            return self._release_unused(lease_id, requester)
        if found.proposal.consumer != requester:
            return "only the lease's consumer may close it"
        with trio.move_on_after(20):
            await found.settled.wait()
        return None if found.settled.is_set() and not found.unsettled else "not settled yet"

    def _release_unused(self, lease_id: str, requester: str) -> str | None:
        """A lease granted and closed before any session ran under it (a grant that lost
        to a better one, a job that found no host for another rank): its shares or GiB
        go back now, not at the end of its term."""
        reservation = self.book.get(lease_id)
        if reservation is None:
            return "no such lease here"
        if reservation.proposal.consumer != requester:
            return "only the lease's consumer may close it"
        self.book.release(lease_id)
        return None

    # --- receipts -------------------------------------------------------------------

    async def metering_loop(self) -> None:
        """Issue and settle receipts for every lease; pause or end the unpaid ones."""
        while True:
            for active in list(self.active.values()):
                if not active.session_over and active.meter.due(self.runtime.clock()):
                    self.payments.issue(active)
                await self.payments.settle(active)
                await self.payments.enforce(active)
            await trio.sleep(min(1.0, self.options.receipt_interval))

    # --- leaving ------------------------------------------------------------------------

    async def leave(self) -> None:
        """Stop in order: cancel the offer, tell each consumer, hang up, settle."""
        self.leaving = True
        await self._cancel_offer()
        running = [a for a in self.active.values() if not a.session_over]
        for active in running:
            await self._tell_leaving(active)
            await active.hang_up("leaving: the host is shutting down")
        for active in list(self.active.values()):
            await active.settled.wait()
        await self.runtime.mesh.drain()  # the cancel must leave before the node stops

    async def _cancel_offer(self) -> None:
        rt, now = self.runtime, self.runtime.clock()
        for offer_id, served in self.served.items():
            rt.mesh.withdraw(offer_id)
            served.announced = False
            cancel = Cancel(rt.peer_id, Side.OFFER, offer_id, now + 60, rt.mesh.next_nonce())
            try:
                await rt.mesh.publish(seal_message(rt.identity, cancel, now=now))
            except CumulusError as exc:
                log.warning("could not cancel offer %s: %s", offer_id, exc)

    async def _tell_leaving(self, active: ActiveLease) -> None:
        # Told first, so that when the session drops the consumer knows why at once.
        await self._notify(active.proposal, NOTICE_LEAVING, "the host is shutting down")

    async def _notify(self, proposal: LeaseProposal, kind: str, why: str) -> None:
        consumer = peer_of(proposal.consumer)
        try:
            await call_lease_notice(self.runtime.mesh.host, consumer, proposal.lease_id, kind, why)
        except (CumulusError, BaseLibp2pError, trio.TooSlowError, OSError) as exc:
            log.warning("could not tell consumer %s: %s", proposal.consumer[:12], exc)

    def preempted(self, reservations: list[Reservation]) -> None:
        """An on-demand lease took these leases' shares (``LeaseBook``): end them."""
        for reservation in reservations:
            self._preempted.send_nowait(reservation)

    async def end_preempted(self) -> None:
        """Tell each preempted lease's consumer, then hang up its session: the executor
        parks it, for the consumer to resume here when shares free up, or elsewhere.
        Its receipts cover the time it was served."""
        async for reservation in self._to_end:
            proposal = reservation.proposal
            log.info("lease %s preempted for an on-demand lease", proposal.lease_id)
            await self._notify(proposal, NOTICE_PREEMPTED, PREEMPTED_BECAUSE)
            active = self.active.get(proposal.lease_id)
            if active is not None:
                await active.hang_up(f"preempted: {PREEMPTED_BECAUSE}")

    # --- status ---------------------------------------------------------------------

    def current_endpoints(self) -> list[str]:
        """Where consumers dial the session channel, as of now: peers' observations of
        this host's address change while it runs (``session_endpoints``)."""
        if self.session_socket is not None:
            bind, port = self.session_socket
            observed = observed_ipv4s(self.runtime.mesh.host)
            self.endpoints = session_endpoints(bind, port, self.options.advertise_host, observed)
        return self.endpoints

    def snapshot(self) -> dict:
        """What ``cumulus-node status`` shows: totals, then a row per device."""
        leases = [*self.active.values(), *list(self.finished)[-10:]]
        executors = [s.executor for s in self.served.values()]
        return self.runtime.snapshot() | {
            "role": "provider",
            "session_endpoint": ", ".join(self.current_endpoints()),
            "price": self.options.price,
            "shares_total": self.options.sold_shares * len(self.served),
            "overcommit": self.options.overcommit,
            "shares_free": self.free_shares(),
            "contend_shares_free": self.free_contend_shares(),
            "storage_price": self.options.storage_price,
            "storage_gib_total": self.options.storage_gib,
            "storage_gib_free": self.free_storage(),
            "blobs_announced": 0 if self.sharing is None else len(self.sharing.announced),
            "sessions": sum(len(e.sessions) for e in executors),
            "isolation": "worker per session" if self.options.uses_workers else "shared process",
            "device_health": _health(self.served.values()),
            "session_workers": [w for e in executors for w in _session_workers(e)],
            "devices": [self._device_row(s) for s in self.served.values()],
            "earned": sum(a.earned for a in leases),
            "leases": [self._lease_row(a) for a in leases],
        }

    def _device_row(self, served: Served) -> dict:
        device = served.device
        return {
            "offer_id": device.offer_id,
            "device": device.facts.target,
            "model": device.facts.model,
            "perf_units": device.perf_units,
            "shares_free": self.free_shares(device.offer_id),
            "sessions": len(served.executor.sessions),
            "health": served.executor.health.reason or "ok",
            "gpu_utilization": self.meter.utilization(device.facts),
        }

    def _lease_row(self, active: ActiveLease) -> dict:
        """One lease as status shows it: terms, receipts, and its session at work.

        A read: the op rate comes from the samples ``sample_ops`` took."""
        row = _lease_row(active)
        served = self.served[active.proposal.offer_id]
        stats = self._session_stats(active)
        if stats is not None:
            row |= {
                "ops": stats.ops,
                "ops_per_s": round(active.ops_per_s, 1),
                "bytes_per_s": round(active.bytes_per_s),
                "memory": stats.bytes_in_use,
                "tier": stats.tier,
                "on_device": stats.bytes_on_device,
                "held": stats.held_bytes,
                "quota": served.share_bytes * active.proposal.shares,
            }
            if stats.wait_p99_ms is not None:  # it took device turns in the last minute
                row |= {"wait_p50_ms": stats.wait_p50_ms, "wait_p99_ms": stats.wait_p99_ms}
        return row

    def _session_stats(self, active: ActiveLease) -> SessionStats | None:
        if active.session_over:
            return None
        executor = self.served[active.proposal.offer_id].executor
        return executor.session_stats(active.lease.envelope.author)

    def sample_ops(self, now: float) -> None:
        """Sample each running session's op count at ``now`` (the op rate's input)."""
        for active in self.active.values():
            stats = self._session_stats(active)
            if stats is not None:
                active.record_ops(now, stats.ops)

    async def keep_op_rates(self) -> None:
        """Sample every session's op count each ``OP_SAMPLE_INTERVAL`` seconds."""
        while True:
            self.sample_ops(trio.current_time())
            await trio.sleep(OP_SAMPLE_INTERVAL)


def _health(served: Iterable[Served]) -> str:
    """The word ok while every device is healthy, else why each unhealthy one is not."""
    reasons = [
        f"{s.device.facts.target}: {s.executor.health.reason}"
        for s in served
        if s.executor.health.reason
    ]
    return "; ".join(reasons) or "ok"


def _session_workers(executor: Executor | WorkerSupervisor) -> list[dict]:
    """Each session's worker process and the bytes it carried (worker mode only)."""
    if not isinstance(executor, WorkerSupervisor):
        return []
    return [
        {"pid": view.worker_pid, "bytes": view.bytes_carried} for view in executor.sessions.values()
    ]


def _lease_row(active: ActiveLease) -> dict:
    p = active.proposal
    return {
        "lease_id": p.lease_id,
        "offer_id": p.offer_id,
        "consumer": p.consumer,
        "shares": p.shares,
        "price": p.price,
        "receipts": active.receipts,
        "share_seconds": active.share_seconds,
        "earned": active.earned,
        "bytes": active.bytes_moved,
        "peer_bytes": active.peer_bytes,
        "state": active.state.value,
    }


async def run_provider(
    data: DataDir,
    mesh_config: MeshConfig,
    options: ProviderOptions,
    *,
    on_ready=None,
    on_tick=None,
    on_leaving=None,
    handle_signals: bool = False,
    book_limits: BookLimits | None = None,
) -> None:
    """Run a provider node until cancelled, or with ``handle_signals`` until SIGTERM or
    SIGINT, when it leaves in order (``Provider.leave``) and returns.

    Args:
        data: The node's data directory.
        mesh_config: How to join the mesh.
        options: What to offer and where to serve sessions.
        on_ready: Called once with the ``Provider`` when it serves and announces.
        on_tick: Called every second with the ``Provider`` (status display).
        on_leaving: Called with a sentence when an orderly stop begins, and again if it
            is forced.
        handle_signals: Catch SIGTERM and SIGINT (the main thread only).
    """
    identity = data.identity()
    executors = [_executor_for(device, options, data) for device in options.devices]
    async with open_runtime(identity, data, mesh_config, book_limits=book_limits) as runtime:
        provider = Provider(runtime, options, executors)
        server = LeaseServer(
            provider.book,
            endpoints=provider.current_endpoints,
            screen=provider.screen,
            on_preempted=provider.preempted,
            waiting=lambda: (r.order for r in runtime.book.bids()),
        )
        serve_leases(runtime.mesh.host, server)
        serve_liveness(
            runtime.mesh.host, identity, free_shares=provider.free_shares,
            next_nonce=runtime.mesh.next_nonce, clock=runtime.clock,
        )  # fmt: skip
        serve_lease_close(runtime.mesh.host, provider.close_lease)
        store = BlobStore(data.path / "blobs", options.blob_cap)
        sharing = provider.sharing = BlobSharing(
            runtime.mesh, store, report=provider.report_bad_blob, clock=runtime.clock
        )
        sharing.serve()
        serve_fetches(runtime.mesh.host, sharing, provider.may_fetch)
        with provider.meter:  # one NVML session for the status of every tick
            async with trio.open_nursery() as nursery:
                for executor in executors:
                    if isinstance(executor, WorkerSupervisor):
                        await nursery.start(executor.run)
                bind = options.session_host or listen_host(mesh_config.listen_addrs)
                sessions = await nursery.start(_serve_sessions, identity, provider, bind)
                # The same sessions over libp2p streams, for consumers that cannot dial the
                # session port (this host behind NAT: the stream may come through a relay).
                handle_libp2p_sessions(runtime.mesh.host, sessions)
                provider.session_socket = (bind, sessions.port)
                if handle_signals:
                    nursery.start_soon(_leave_on_signal, provider, nursery.cancel_scope, on_leaving)
                nursery.start_soon(provider.keep_offer_current)
                nursery.start_soon(provider.end_preempted)
                nursery.start_soon(provider.metering_loop)
                nursery.start_soon(provider.keep_op_rates)
                nursery.start_soon(sharing.announce_forever)
                if on_ready is not None:
                    on_ready(provider)
                while True:
                    data.write_state(provider.snapshot())
                    if on_tick is not None:
                        on_tick(provider)
                    await trio.sleep(1.0)


def _executor_for(
    device: OfferedDevice, options: ProviderOptions, data: DataDir
) -> Executor | WorkerSupervisor:
    config = ExecutorConfig(
        device=device.facts.target,
        quota_bytes=device.facts.memory_mib * 2**20,
        graph_compiler=options.graph_compiler,
        blob_dir=str(data.path / "blobs"),
        blob_cap=options.blob_cap,
        # Quotas add up past the device (overcommit, contending shares): its sessions are
        # paged out to make room.
        device_bytes=device.facts.memory_mib * 2**20,
        ram_bytes=options.ram_tier,
        peer_links=options.peer_links,
    )
    return build_executor(
        config, workers=options.uses_workers, pool=options.pool, hidden=[data.path]
    )


async def _leave_on_signal(provider: Provider, node: trio.CancelScope, on_leaving) -> None:
    """First SIGTERM or SIGINT: leave in order; a second one, or the timeout, forces it."""
    say = on_leaving or (lambda text: log.warning("%s", text))
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            break
        timeout = provider.options.leave_timeout
        say(
            f"leaving: offer cancelled, consumers told, settling (up to {timeout:g} s; "
            "signal again to stop at once)"
        )
        async with trio.open_nursery() as leaving:
            leaving.start_soon(_force_on_signal, signals, leaving.cancel_scope, say)
            with trio.move_on_after(timeout) as waited:
                await provider.leave()
            if waited.cancelled_caught:
                say(f"leaving took over {timeout:g} s: stopping now")
            leaving.cancel_scope.cancel()
    provider.runtime.data.write_state(provider.snapshot())
    node.cancel()


async def _force_on_signal(signals, leaving: trio.CancelScope, say) -> None:
    async for _ in signals:
        say("stopping now, without waiting for settlement")
        leaving.cancel()
        return


def listen_host(listen_addrs) -> str:
    """The IPv4 address the libp2p listener binds (``0.0.0.0``: every interface), for the
    session channel to bind too; loopback when the node listens on no IPv4 address."""
    for addr in listen_addrs:
        parts = str(addr).split("/")
        if len(parts) > 2 and parts[1] == "ip4":
            return parts[2]
    return "127.0.0.1"


def session_endpoints(
    bind: str, port: int, advertise: str | None, observed: Sequence[str] = ()
) -> list[str]:
    """The ``host:port`` addresses consumers are told to dial.

    ``advertise`` alone when given. Otherwise the addresses peers observed this host at
    (identify; behind a NAT, the router's, which works once the port is forwarded),
    then the bound address, or each interface's when bound to all of them. A consumer
    dials the one it already reached this node's libp2p address at first, so the order
    only matters for consumers that know none of them.
    """
    if advertise:
        return [f"{advertise}:{port}"]
    local = interface_ipv4s() if bind == "0.0.0.0" else [bind]
    ips = [*observed, *(ip for ip in local if ip not in observed)]
    return [f"{ip}:{port}" for ip in ips]


async def _serve_sessions(identity, provider: Provider, bind: str, *, task_status) -> None:
    await serve_secure(
        identity,
        authorize=provider.authorize,
        handler=provider.serve_session,
        host=bind,
        port=provider.options.session_port,
        settings=SessionSettings(grace_period=provider.options.grace_period),
        task_status=task_status,
    )
