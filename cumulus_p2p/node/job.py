"""``cumulus-node --consume``: lease the job's GPUs, run its script, settle.

A job of one GPU is one ``Consumer``: its bid, its choice of hosts, its leases and its
failover. A job of N (``--gpus N -- torchrun --nproc-per-node N train.py``) is N of them,
one per rank, sharing the node's mesh, book and ledger (``Job``):

- each rank bids under its own name and leases a device none of the others holds, so
  ``cuda:LOCAL_RANK`` in a rank is its own leased GPU;
- the job keeps its ranks close (``matcher.near_first``; trust still comes first): the
  first rank prefers a rig offering a device for every rank, the others the first one's
  rig, then its region (an offer's region is the hint of where its host is);
- each rank has its own control channel: ``CUMULUS_CONTROL`` lists them in rank order,
  and the shim in a rank's process picks its own by ``LOCAL_RANK``
  (``control.address_for_rank``). A script run without a launcher (``--gpus N --
  python train.py``) is one process, which takes every lease as one of its devices
  (``cuda:0`` up) and talks to every rank's channel;
- the ranks' collectives run among their hosts (``remote.distributed``), not through
  this node;
- receipts and lease notices reach the rank whose lease they name; a host refused for
  overcharging is refused by every rank.

The job's status (``state.json``, the screen) shows every rank's leases in one table.
A job of one GPU survives its host (the session moves, ``Consumer.failover``). So does a
job of several whose checkpoints stay on the consumer: its group goes back together
(``remote/regroup.py``). The rank that lost its host asks its consumer to move it
(``regroups``), and the others open fresh sessions on their own hosts under their leases,
which ``Consumer.failover`` never sees. With checkpoints on a standby host the group
cannot go back, so such a rank is told so at once and ends, and torchrun ends the
others, in seconds rather than at the group's timeout.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import trio

from .._errors import NoMatchError
from ..market import BookLimits
from ..market.messages import Offer
from ..market.settlement import ReceiptDesk, serve_lease_notices, serve_receipts
from . import control
from .consumer import Consumer, ConsumerOptions, Held, script_command
from .datadir import DataDir
from .prestart import PrestartedScript
from .runtime import Runtime, open_runtime
from .script import run_script
from .session_proxy import SessionDoors


@dataclass
class Job:
    """A consumer's job: one ``Consumer`` per rank (one for a job of one GPU)."""

    ranks: list[Consumer]
    #: The script's exit status, once it has ended.
    exit_code: int | None = None

    @classmethod
    def of(cls, runtime: Runtime, options: ConsumerOptions, desk: ReceiptDesk) -> Job:
        """``options.gpus`` consumers; each leases a device the others do not hold."""
        job = cls([])
        for rank in range(options.gpus):
            job.ranks.append(
                Consumer(
                    runtime,
                    options,
                    desk,
                    bid_name=f"bid{rank}",
                    elsewhere=job._held_by(rank),
                    near=job._first_offer,
                    movable=options.gpus == 1,
                )
            )
        return job

    def _first_offer(self) -> Offer | None:
        """The offer the first rank holds, whose rig and region the other ranks prefer;
        None before it holds one (the first rank leases before the others)."""
        first = self.ranks[0].sessions
        return first[-1].offer if first else None

    def _held_by(self, rank: int) -> Callable[[], set[tuple[str, str]]]:
        def others() -> set[tuple[str, str]]:
            return {
                (held.proposal.host, held.proposal.offer_id)
                for other in self.ranks[:rank] + self.ranks[rank + 1 :]
                for held in other.held
            }

        return others

    @property
    def runtime(self) -> Runtime:
        return self.ranks[0].runtime

    @property
    def desk(self) -> ReceiptDesk:
        return self.ranks[0].desk

    @property
    def held(self) -> list[Held]:
        """Every rank's leases, rank by rank."""
        return [held for consumer in self.ranks for held in consumer.held]

    @property
    def status(self) -> str:
        """The first rank's status that is not plain running (a failover, a wait)."""
        statuses = [consumer.status for consumer in self.ranks]
        return next((s for s in statuses if s != "running"), statuses[0])

    @status.setter
    def status(self, value: str) -> None:
        for consumer in self.ranks:
            consumer.status = value

    def cost(self) -> int:
        """Micro-credits receipted so far, over every rank's leases."""
        return sum(consumer.cost() for consumer in self.ranks)

    def snapshot(self) -> dict:
        """The first rank's snapshot, with the whole job's leases (each with its rank, in
        a job of several GPUs), failovers, ops and cost."""
        first, others = self.ranks[0].snapshot(), self.ranks[1:]
        leases = [first["leases"], *(consumer.lease_rows() for consumer in others)]
        if others:
            leases = [[{**row, "rank": rank} for row in rows] for rank, rows in enumerate(leases)]
        return first | {
            "status": self.status,
            "gpus": len(self.ranks),
            "leases": [row for rows in leases for row in rows],
            "failovers": first["failovers"] + sum(consumer.failovers for consumer in others),
            "ops": first["ops"] + sum(consumer.ops for consumer in others),
            "collectives_through_consumer": any(
                consumer.collectives_through_consumer for consumer in self.ranks
            ),
            "cost": first["cost"] + sum(consumer.cost() for consumer in others),
        }

    # --- what hosts send, to the rank it concerns -----------------------------------

    def _rank_of(self, lease_id: str) -> Consumer:
        for consumer in self.ranks:
            if any(held.proposal.lease_id == lease_id for held in consumer.held):
                return consumer
        return self.ranks[0]  # a lease of no rank's: the first one refuses it

    def note_receipt(self, countersigned) -> None:
        self._rank_of(countersigned.receipt.lease_id).note_receipt(countersigned)

    def note_refused(self, host: str, why: str) -> None:
        for consumer in self.ranks:
            consumer.note_refused(host, why)

    async def fresh_counts(self) -> None:
        # Which rank's lease a receipt request names is not said here: wait for all.
        async with trio.open_nursery() as nursery:
            for consumer in self.ranks:
                nursery.start_soon(consumer.fresh_counts)

    async def take_notice(self, lease_id: str, kind: str, detail: str, sender: str) -> str | None:
        return await self._rank_of(lease_id).take_notice(lease_id, kind, detail, sender)


async def run_consumer(
    data: DataDir,
    mesh_config,
    options: ConsumerOptions,
    *,
    on_tick=None,
    book_limits: BookLimits | None = None,
    prestarted: PrestartedScript | None = None,
) -> Job:
    """Run the script on leased hosts (one per rank); return the job when it has ended.
    ``prestarted``: the script's interpreter, forked at start-up (``node.prestart``).

    Raises:
        NoMatchError: A rank found no offer meeting the bid within ``options.match_timeout``.
    """
    identity = data.identity()
    argv = script_command(options.command, cuda_compat=options.cuda_compat, native=options.native)
    async with open_runtime(identity, data, mesh_config, book_limits=book_limits) as runtime:
        desk = ReceiptDesk(identity, data.ledger())
        job = Job.of(runtime, options, desk)
        serve_receipts(
            runtime.mesh.host, desk, clock=runtime.clock, fresh_counts=job.fresh_counts,
            on_receipt=job.note_receipt, on_refused=job.note_refused,
        )  # fmt: skip
        serve_lease_notices(runtime.mesh.host, job.take_notice)
        async with trio.open_nursery() as nursery:
            for consumer in job.ranks:
                reach = functools.partial(consumer._reach, afresh=True)
                consumer.doors = SessionDoors(runtime.mesh.host, nursery, reach)
                consumer.nursery = nursery
                nursery.start_soon(consumer.keep_probing)
            nursery.start_soon(_tick, job, on_tick)
            job.status = "matching"
            # One rank after another: each leases from a host the ones before it do not hold.
            try:
                for consumer in job.ranks:
                    await consumer.lease(options.match_timeout)
            except NoMatchError:
                # The ranks that found a host give it back: the job will not run.
                for consumer in job.ranks:
                    await consumer.settle_leases()
                raise
            job.status = "running"
            token = control.new_token()
            addresses = [await nursery.start(_control, token, c) for c in job.ranks]
            env = _child_env(data, ",".join(addresses), token, options)
            job.exit_code = await run_script(argv, env, prestarted=prestarted)
            job.status = "settling"
            for consumer in job.ranks:
                consumer.exit_code = job.exit_code
                await consumer.settle_leases()
                await consumer.withdraw_bid()
                await consumer.report_service()
            await runtime.mesh.drain()
            job.status = "done"
            data.write_state(job.snapshot())
            nursery.cancel_scope.cancel()
    return job


async def _control(
    token: str, consumer: Consumer, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    """Serve one rank's control channel; reports its address."""
    await control.serve_control(
        token, consumer.current_ticket, consumer.failover, usage=consumer.take_usage,
        probe=consumer.check_probe, path=consumer.take_path, standby=consumer.standby_ticket,
        fetch=consumer.fetch_for_session, task_status=task_status,
    )  # fmt: skip


async def _tick(job: Job, on_tick) -> None:
    while True:
        job.runtime.data.write_state(job.snapshot())
        if on_tick is not None:
            on_tick(job)
        await trio.sleep(1.0)


def _child_env(data: DataDir, addresses: str, token: str, options: ConsumerOptions) -> dict:
    env = dict(os.environ)
    env[control.ENV_ADDRESS] = addresses
    env[control.ENV_TOKEN] = token
    env[control.ENV_NODE_PID] = str(os.getpid())
    env["CUMULUS_DATA_DIR"] = str(data.path)
    env["CUMULUS_CHECKPOINT_INTERVAL"] = str(options.checkpoint_interval)
    env[control.ENV_CHECKPOINT_TO] = options.checkpoint_to
    if options.private:
        env[control.ENV_PRIVATE] = "1"
    return env
