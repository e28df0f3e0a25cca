"""``cumulus-node --provide``: offer this machine's device, lease it, run the op streams.

One trio program composes:

- the ``Runtime`` (mesh, book, reputation);
- the device ``hardware.detect`` found (CUDA, else the CPU), served by a
  ``WorkerSupervisor`` (a worker process per session: the default with CUDA) or an
  in-process ``Executor``; while the supervisor finds the device unhealthy, the offer
  is withdrawn;
- the secure session channel on TCP, admitting only consumers that present a lease this
  host countersigned and that is still held (``_Leases.authorize``);
- a ``LeaseBook`` behind the lease protocol, whose offer is re-announced on the mesh
  with the shares still free (withdrawn while none are);
- a ``Meter`` per session: receipts every ``receipt_interval`` and at the session's end,
  countersigned by the consumer over ``/cumulus/receipt/1.0.0``, then kept in the ledger.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import trio
from libp2p.exceptions import BaseLibp2pError

from .._errors import CumulusError
from ..dht import MeshConfig
from ..market import (
    Lease,
    LeaseBook,
    LeaseProposal,
    LeaseServer,
    Meter,
    Offer,
    PriorityClass,
    serve_leases,
)
from ..market.messages import encode_message, peer_id_of
from ..market.settlement import call_countersign, serve_lease_close
from ..remote.executor import Executor, ExecutorConfig
from ..remote.executor_main import build_executor
from ..remote.scheduler import lease_rank
from ..remote.secure import serve_secure
from ..remote.secure.libp2p_path import handle_libp2p_sessions
from ..remote.supervisor import WorkerSupervisor
from ..remote.transport import CountingChannel
from .datadir import DataDir
from .hardware import DeviceFacts
from .runtime import Runtime, open_runtime, peer_of

log = logging.getLogger("cumulus_p2p.node.provider")

OFFER_NAME = "device0"


@dataclass(frozen=True, slots=True)
class ProviderOptions:
    """What ``--provide`` was asked to offer.

    Attributes:
        device: The device offered (from ``hardware.detect``).
        perf_units: Self-benchmark result.
        shares: Share units the device is split into.
        price: Micro-credits per share-hour.
        min_lease_s: Shortest lease accepted.
        region: Free-form region hint.
        session_host: Address the session channel listens on.
        session_port: Its port (0: any free one).
        advertise_host: The address consumers are told to dial (default: session_host).
        receipt_interval: Seconds between receipts.
        grace_period: Seconds a dropped session may take to resume.
        workers: A worker process per session (None: when the device is a GPU).
        pool: Worker processes kept started for the next lease.
    """

    device: DeviceFacts
    perf_units: int
    shares: int
    price: int
    min_lease_s: int = 0
    region: str = ""
    session_host: str = "127.0.0.1"
    session_port: int = 0
    advertise_host: str | None = None
    receipt_interval: float = 30.0
    grace_period: float = 30.0
    workers: bool | None = None
    pool: int = 1

    @property
    def uses_workers(self) -> bool:
        """Whether sessions run in worker processes of their own."""
        return self.device.kind == "cuda" if self.workers is None else self.workers


@dataclass
class ActiveLease:
    """A lease being served, its meter and what it has earned so far."""

    lease: Lease
    proposal: LeaseProposal
    meter: Meter
    started: float
    unsettled: list = field(default_factory=list)
    settled: trio.Event = field(default_factory=trio.Event)
    receipts: int = 0
    share_seconds: int = 0
    ended: bool = False

    @property
    def earned(self) -> int:
        """Micro-credits receipted so far."""
        return self.share_seconds * self.proposal.price // 3600


class Provider:
    """The provider's state: leases granted, sessions served, receipts settled."""

    def __init__(
        self, runtime: Runtime, options: ProviderOptions, executor: Executor | WorkerSupervisor
    ) -> None:
        self.runtime = runtime
        self.options = options
        self.executor = executor
        self.book = LeaseBook(runtime.identity)
        self.active: dict[str, ActiveLease] = {}
        self.finished: list[ActiveLease] = []
        self._ledger = runtime.data.ledger()
        self._presented: dict[bytes, LeaseProposal] = {}
        self.endpoint = ""
        self.announced = False
        # Memory isolation between tenants: a lease gets its shares' part of the device.
        self.share_bytes = options.device.memory_mib * 2**20 // options.shares

    # --- offers ---------------------------------------------------------------------

    def free_shares(self) -> int:
        """Shares not held by any lease."""
        held = sum(r.proposal.shares for r in self.book.leases())
        return self.options.shares - held

    def offer_body(self, nonce: int, expires_at: float) -> bytes:
        """The offer as it stands, sealed afresh each announce round."""
        facts, now = self.options.device, self.runtime.clock()
        offer = Offer(
            self.runtime.peer_id, OFFER_NAME, facts.model, facts.memory_mib,
            self.options.perf_units, max(1, self.free_shares()), self.options.price,
            self.options.min_lease_s, self.options.region, now, expires_at, nonce,
        )  # fmt: skip
        self.book.publish(offer)
        return encode_message(offer)

    async def keep_offer_current(self) -> None:
        """Announce while shares are free and the device is healthy; withdraw otherwise.
        Expire ended leases."""
        while True:
            self.book.expire(self.runtime.clock())
            free = self.free_shares() if self.executor.health.healthy else 0
            if free > 0 and not self.announced:
                await self.runtime.mesh.announce(OFFER_NAME, Offer.KIND, self.offer_body)
                self.announced = True
            elif free <= 0 and self.announced:
                self.runtime.mesh.withdraw(OFFER_NAME)
                self.announced = False
            await trio.sleep(0.5)

    # --- sessions -------------------------------------------------------------------

    def authorize(self, consumer_key: bytes, token: bytes | None) -> str | None:
        """Admit a consumer presenting a lease this host granted and still holds."""
        if token is None:
            return "a lease is required: match an offer with cumulus-node --consume"
        try:
            lease = Lease.from_bytes(token)
            proposal = lease.verify(self.runtime.identity.public_key)
        except CumulusError as exc:
            return f"the lease is not valid here: {exc}"
        if proposal.consumer != peer_id_of(consumer_key):
            return "the lease belongs to another consumer"
        if self.book.get(proposal.lease_id) is None:
            return "the lease has ended or was never granted by this host"
        self._presented[consumer_key] = proposal
        return None

    async def serve_session(self, channel) -> None:
        """Run one consumer's session on the executor, metered under its lease."""
        proposal = self._presented.pop(channel.peer_public_key)
        active = self.active.get(proposal.lease_id)
        if active is None:
            lease = self.book.get(proposal.lease_id).lease
            meter = Meter(self.runtime.identity, proposal, interval=self.options.receipt_interval)
            active = ActiveLease(lease, proposal, meter, self.runtime.clock())
            self.active[proposal.lease_id] = active
        try:
            metered = CountingChannel(channel, active.meter.record_bytes)
            # The session is served for the lease's term, no longer: then the executor
            # parks it, and the consumer leases again and resumes it.
            left = proposal.end_at - self.runtime.clock()
            await self.executor.run_session(
                metered,
                quota_bytes=self.share_bytes * proposal.shares,
                rank=lease_rank(proposal.priority is PriorityClass.ON_DEMAND, proposal.price),
                until=trio.current_time() + max(0.0, left),
            )
        finally:
            with trio.CancelScope(shield=True):
                await self._end(active)

    async def _end(self, active: ActiveLease) -> None:
        active.ended = True
        now = self.runtime.clock()
        if not active.meter.finished:
            active.unsettled.append(active.meter.issue(now, nonce=self.runtime.mesh.next_nonce()))
        with trio.move_on_after(10):
            await self._settle(active)
        self.book.release(active.proposal.lease_id)
        self.active.pop(active.proposal.lease_id, None)
        self.finished.append(active)
        active.settled.set()

    async def close_lease(self, lease_id: str, requester: str) -> str | None:
        """The consumer is done: answer once the lease's session ended and is settled."""
        found = self.active.get(lease_id) or next(
            (a for a in self.finished if a.proposal.lease_id == lease_id), None
        )
        if found is None:
            return "no session ran under this lease here"
        if found.proposal.consumer != requester:
            return "only the lease's consumer may close it"
        with trio.move_on_after(20):
            await found.settled.wait()
        return None if found.settled.is_set() and not found.unsettled else "not settled yet"

    # --- receipts -------------------------------------------------------------------

    async def metering_loop(self) -> None:
        """Issue and settle receipts for every running lease."""
        while True:
            now = self.runtime.clock()
            for active in list(self.active.values()):
                if not active.ended and active.meter.due(now):
                    nonce = self.runtime.mesh.next_nonce()
                    active.unsettled.append(active.meter.issue(now, nonce=nonce))
                await self._settle(active)
            await trio.sleep(min(1.0, self.options.receipt_interval))

    async def _settle(self, active: ActiveLease) -> None:
        # In order: the consumer accepts receipt k+1 only after receipt k.
        consumer = peer_of(active.proposal.consumer)
        while active.unsettled:
            envelope = active.unsettled[0]
            try:
                countersigned = await call_countersign(self.runtime.mesh.host, consumer, envelope)
            except (CumulusError, BaseLibp2pError, trio.TooSlowError, OSError) as exc:
                log.warning(
                    "receipt for lease %s not settled yet: %s", active.proposal.lease_id, exc
                )
                return
            await trio.to_thread.run_sync(self._ledger.append, countersigned)
            active.unsettled.pop(0)
            active.receipts += 1
            active.share_seconds += countersigned.receipt.share_seconds

    # --- status ---------------------------------------------------------------------

    def snapshot(self) -> dict:
        """What ``cumulus-node status`` shows."""
        leases = [*self.active.values(), *self.finished[-10:]]
        return self.runtime.snapshot() | {
            "role": "provider",
            "session_endpoint": self.endpoint,
            "device": self.options.device.model,
            "perf_units": self.options.perf_units,
            "price": self.options.price,
            "shares_total": self.options.shares,
            "shares_free": self.free_shares(),
            "sessions": len(self.executor.sessions),
            "isolation": "worker per session" if self.options.uses_workers else "shared process",
            "device_health": self.executor.health.reason or "ok",
            "session_workers": _session_workers(self.executor),
            "earned": sum(a.earned for a in leases),
            "leases": [_lease_row(a) for a in leases],
        }


def _session_workers(executor: Executor | WorkerSupervisor) -> list[dict]:
    """Each session's worker process and the frames it relayed (worker mode only)."""
    if not isinstance(executor, WorkerSupervisor):
        return []
    return [
        {"pid": view.worker_pid, "frames_in": view.frames_in, "frames_out": view.frames_out}
        for view in executor.sessions.values()
    ]


def _lease_row(active: ActiveLease) -> dict:
    p = active.proposal
    return {
        "lease_id": p.lease_id,
        "consumer": p.consumer,
        "shares": p.shares,
        "price": p.price,
        "receipts": active.receipts,
        "share_seconds": active.share_seconds,
        "earned": active.earned,
        "state": "ended" if active.ended else "running",
    }


async def run_provider(
    data: DataDir,
    mesh_config: MeshConfig,
    options: ProviderOptions,
    *,
    on_ready=None,
    on_tick=None,
) -> None:
    """Run a provider node until cancelled.

    Args:
        data: The node's data directory.
        mesh_config: How to join the mesh.
        options: What to offer and where to serve sessions.
        on_ready: Called once with the ``Provider`` when it serves and announces.
        on_tick: Called every second with the ``Provider`` (status display).
    """
    identity = data.identity()
    facts = options.device
    device = f"cuda:{facts.index}" if facts.kind == "cuda" else "cpu"
    config = ExecutorConfig(device=device, quota_bytes=facts.memory_mib * 2**20)
    executor = build_executor(
        config, workers=options.uses_workers, pool=options.pool, hidden=[data.path]
    )
    async with open_runtime(identity, data, mesh_config) as runtime:
        provider = Provider(runtime, options, executor)
        serve_leases(
            runtime.mesh.host, LeaseServer(provider.book, endpoints=lambda: [provider.endpoint])
        )
        serve_lease_close(runtime.mesh.host, provider.close_lease)
        async with trio.open_nursery() as nursery:
            if isinstance(executor, WorkerSupervisor):
                await nursery.start(executor.run)
            server = await nursery.start(_serve_sessions, identity, provider)
            # The same sessions over libp2p streams, for consumers that cannot dial the
            # session port (this host behind NAT: the stream may come through a relay).
            handle_libp2p_sessions(runtime.mesh.host, server)
            provider.endpoint = f"{options.advertise_host or options.session_host}:{server.port}"
            nursery.start_soon(provider.keep_offer_current)
            nursery.start_soon(provider.metering_loop)
            if on_ready is not None:
                on_ready(provider)
            while True:
                data.write_state(provider.snapshot())
                if on_tick is not None:
                    on_tick(provider)
                await trio.sleep(1.0)


async def _serve_sessions(identity, provider: Provider, *, task_status) -> None:
    await serve_secure(
        identity, authorize=provider.authorize, handler=provider.serve_session,
        host=provider.options.session_host, port=provider.options.session_port,
        grace_period=provider.options.grace_period, task_status=task_status,
    )  # fmt: skip
