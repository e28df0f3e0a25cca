"""Collectives among the executors of one job: a real c10d group between hosts.

Theory of operation
-------------------
A job of N GPUs is N sessions, one per rank, each on its own host. When the job's
processes call ``torch.distributed.init_process_group("cumulus")``, each rank's session
tells its executor to join a gloo group with the other ranks' executors
(``cumulus_p2p.remote.distributed`` arranges it). From then on an all-reduce is one small
record on the consumer's link; the tensor's bytes go between the hosts, never through the
consumer.

The group meets through a ``TCPStore`` that rank 0's executor serves. Its keys live
under a prefix the consumer draws at random and tells only the job's ranks, so a host
that is not in the job cannot take a rank's place by guessing keys. That prefix crosses
the hosts' links in the clear, as do gloo's own bytes: these links are authenticated by
nothing stronger than that prefix and are not encrypted (see the module of the same
name on the consumer's side, and the issue this slice belongs to).

A host that other hosts cannot reach (behind NAT or a firewall: ``--no-peer-links``)
says so in its sessions' welcome and refuses to serve a store or join a group; the job's
ranks then run their collectives through the consumer (``remote/distributed.py``).

A collective runs in the session's op stream, in order with its other ops, so a later op
sees its result. It blocks the executor's op thread until every rank arrives, or until
the group's timeout: then the op fails with the timeout's error, reported at the next
sync point as any failed op is, and the session lives on.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from datetime import timedelta
from fractions import Fraction

import torch
import torch.distributed as dist

from ..wire import collective_sizes
from .handles import ErrorKind, OpFailed

#: The reductions a record may name, by the name ``torch.distributed.ReduceOp`` gives.
REDUCE_OPS = {
    "SUM": dist.ReduceOp.SUM,
    "PRODUCT": dist.ReduceOp.PRODUCT,
    "MIN": dist.ReduceOp.MIN,
    "MAX": dist.ReduceOp.MAX,
    "AVG": dist.ReduceOp.AVG,
}
#: Ranks in one group at most: a job of more GPUs than the market sells is malformed.
MAX_WORLD = 64
MAX_TIMEOUT_S = 3600.0


#: Records that wait for the job's other ranks (a store is served at once).
WAITING_RECORDS = frozenset(
    {
        "@pg_join",
        "@pg_allreduce",
        "@pg_broadcast",
        "@pg_allgather",
        "@pg_allgather_base",
        "@pg_reduce_scatter",
    }
)


def is_collective(record: object) -> bool:
    """Whether an op record waits for other ranks (and so must not hold a device turn)."""
    return isinstance(record, list) and bool(record) and record[0] in WAITING_RECORDS


def collective_runs(ops: list) -> list[list]:
    """``ops`` cut into runs of other ops, each collective a run of its own, in order."""
    runs: list[list] = []
    for record in ops:
        if is_collective(record) or not runs or is_collective(runs[-1][0]):
            runs.append([record])
        else:
            runs[-1].append(record)
    return runs


@dataclass
class Membership:
    """How one rank joins its job's group (the fields of a ``@pg_join`` record)."""

    name: str
    store_host: str
    store_port: int
    prefix: str
    rank: int
    world: int
    host: str  # this executor's address, as the other ranks' executors reach it
    timeout_s: float

    @classmethod
    def parse(cls, args: object) -> Membership:
        """Check a ``@pg_join`` record's arguments; raise ``OpFailed`` when malformed."""
        types = (str, str, int, str, int, int, str, (int, float))
        if not (
            isinstance(args, list)
            and len(args) == len(types)
            and all(
                isinstance(a, t) and type(a) is not bool for a, t in zip(args, types, strict=True)
            )
        ):
            raise OpFailed(
                ErrorKind.PROTOCOL_ERROR,
                "@pg_join takes [name, store host, store port, prefix, rank, world, host, "
                "timeout seconds]",
            )
        member = cls(*args)  # type: ignore[arg-type]
        if not 1 <= member.world <= MAX_WORLD or not 0 <= member.rank < member.world:
            raise OpFailed(ErrorKind.VALUE, f"rank {member.rank} of {member.world} is not a rank")
        if not 0 < member.store_port < 65536 or not 0 < member.timeout_s <= MAX_TIMEOUT_S:
            raise OpFailed(ErrorKind.VALUE, "the store's port or the timeout is out of range")
        if len(member.prefix) < 16:
            raise OpFailed(ErrorKind.VALUE, "a group's prefix is a secret of 16 characters or more")
        return member


@dataclass
class CollectiveGroups:
    """The groups one session has joined, and the store it serves as a job's rank 0.
    ``peer_links`` False (``--no-peer-links``): the host cannot be reached by other
    hosts, and refuses to serve a store or join a group (its welcome says so, and the
    job's collectives go through the consumer instead)."""

    peer_links: bool = True
    _groups: dict[str, dist.ProcessGroup] = field(default_factory=dict)
    _served: dict[int, tuple[dist.TCPStore, socket.socket]] = field(default_factory=dict)
    #: The bytes of the tensors its collectives carried between hosts since
    #: ``take_peer_bytes`` last took them, as the records name them: an all-reduce's or a
    #: broadcast's tensor, an all-gather's outputs, a reduce-scatter's input. The consumer
    #: can count the same from
    #: its own records; gloo's wire carries about twice an all-reduce's (ring: 2(n-1)/n
    #: of the tensor out, as much in).
    peer_bytes: int = 0

    def take_peer_bytes(self) -> int:
        """``peer_bytes``, which starts over from 0."""
        taken, self.peer_bytes = self.peer_bytes, 0
        return taken

    def serve_store(self, host: str, world: int) -> int:
        """Serve a store for a group of ``world`` ranks on ``host``; return its port.

        The store listens on ``host`` alone: left to itself, a ``TCPStore`` listens on
        every interface of the machine.
        """
        self._check_links()
        if not 1 <= world <= MAX_WORLD:
            raise OpFailed(ErrorKind.VALUE, f"a group of {world} ranks is not a group")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            listener = socket.create_server((host, 0), family=family)
        except OSError as exc:
            raise OpFailed(ErrorKind.VALUE, f"cannot serve a store on {host}: {exc}") from None
        port = listener.getsockname()[1]
        store = dist.TCPStore(
            host, port, world, is_master=True, wait_for_workers=False,
            master_listen_fd=listener.fileno(),
        )  # fmt: skip
        self._served[port] = (store, listener)
        return port

    def join(self, member: Membership) -> None:
        """Join ``member.name``'s group; blocks until every rank has joined."""
        self._check_links()
        if member.name in self._groups:
            raise OpFailed(ErrorKind.VALUE, f"this session is already in group {member.name!r}")
        timeout = timedelta(seconds=member.timeout_s)
        served = self._served.get(member.store_port) if member.rank == 0 else None
        if served is not None:
            store = served[0]
        else:
            store = dist.TCPStore(
                member.store_host, member.store_port, member.world, is_master=False, timeout=timeout
            )
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=member.host)]
        prefixed = dist.PrefixStore(f"{member.prefix}/{member.name}", store)
        try:
            group = dist.ProcessGroupGloo(prefixed, member.rank, member.world, options)
        except RuntimeError as exc:
            message = f"could not join group {member.name!r}: {exc}"
            raise OpFailed(ErrorKind.RUNTIME, message) from None
        self._groups[member.name] = group

    def all_reduce(self, name: str, tensor: torch.Tensor, op: str) -> None:
        """Reduce ``tensor`` in place across the group (blocking)."""
        if op not in REDUCE_OPS:
            raise OpFailed(ErrorKind.VALUE, f"unknown reduction {op!r}")
        options = dist.AllreduceOptions()
        options.reduceOp = REDUCE_OPS[op]
        self._run(name, tensor, lambda group, t: group.allreduce([t], options))

    def broadcast(self, name: str, tensor: torch.Tensor, root: int) -> None:
        """Overwrite ``tensor`` with ``root``'s across the group (blocking)."""
        options = dist.BroadcastOptions()
        options.rootRank = root
        self._run(name, tensor, lambda group, t: group.broadcast([t], options))

    def all_gather(self, name: str, outputs: list[torch.Tensor], tensor: torch.Tensor) -> None:
        """Fill ``outputs`` (one per rank, in rank order) with every rank's ``tensor``."""
        group = self._group(name)
        if len(outputs) != group.size():
            message = f"an all-gather in {name!r} needs {group.size()} outputs"
            raise OpFailed(ErrorKind.VALUE, message)
        self._agree(name, group, tensor)
        dense = [out.contiguous() for out in outputs]
        self._wait(name, group.allgather([dense], [tensor.contiguous()]))
        self.peer_bytes += sum(out.nbytes for out in dense)
        for out, gathered in zip(outputs, dense, strict=True):
            if gathered is not out:
                out.copy_(gathered)

    def all_gather_base(self, name: str, output: torch.Tensor, tensor: torch.Tensor) -> None:
        """Fill ``output``, of ``world`` times ``tensor``'s elements, with every rank's
        ``tensor`` one after another in rank order (``all_gather_single``)."""
        group = self._group(name)
        self._agree(name, group, tensor, output, Fraction(group.size()))
        self._into(name, output, lambda out: group._allgather_base(out, tensor.contiguous()))
        self.peer_bytes += output.nbytes

    def reduce_scatter(
        self, name: str, output: torch.Tensor, tensor: torch.Tensor, op: str
    ) -> None:
        """Reduce ``tensor`` across the group into ``output``: rank r's is the r-th of the
        reduced tensor's ``world`` equal parts (``reduce_scatter_single``)."""
        if op not in REDUCE_OPS:
            raise OpFailed(ErrorKind.VALUE, f"unknown reduction {op!r}")
        options = dist.ReduceScatterOptions()
        options.reduceOp = REDUCE_OPS[op]
        group = self._group(name)
        self._agree(name, group, tensor, output, Fraction(1, group.size()))
        self._into(
            name, output, lambda out: group._reduce_scatter_base(out, tensor.contiguous(), options)
        )
        self.peer_bytes += tensor.nbytes

    def _run(self, name: str, tensor: torch.Tensor, start) -> None:
        group = self._group(name)
        self._agree(name, group, tensor)
        # gloo reduces dense contiguous buffers: a strided view goes through a copy.
        dense = tensor if tensor.is_contiguous() else tensor.contiguous()
        self._wait(name, start(group, dense))
        self.peer_bytes += dense.nbytes
        if dense is not tensor:
            tensor.copy_(dense)

    def _into(self, name: str, output: torch.Tensor, start) -> None:
        """``start(buffer)`` writes a collective's result to ``buffer``: ``output`` itself,
        or a dense copy of a strided one (gloo writes contiguous buffers only)."""
        dense = output.contiguous()
        self._wait(name, start(dense))
        if dense is not output:
            output.copy_(dense)

    def _agree(
        self,
        name: str,
        group: dist.ProcessGroup,
        tensor: torch.Tensor,
        output: torch.Tensor | None = None,
        out_per_in: Fraction = Fraction(1),
    ) -> None:
        """Check that every rank brings a tensor of the same size and dtype (and, to a
        collective that writes elsewhere, an ``output`` of ``out_per_in`` times its
        elements and of its dtype), or fail on all (``wire/collective_sizes.py``).

        A rank's mismatch would abort the receiving executor, and with it every other
        tenant of that executor. The check costs one small exchange per collective.
        """
        mine = collective_sizes.row(tensor, tensor if output is None else output)
        table = [torch.empty_like(mine) for _ in range(group.size())]
        self._wait(name, group.allgather([table], [mine]))
        rows = [r.tolist() for r in table]
        why = collective_sizes.disagreement(rows, out_per_in, into=output is not None)
        if why is not None:
            raise OpFailed(ErrorKind.VALUE, f"a collective in group {name!r}: {why}")

    def _check_links(self) -> None:
        if not self.peer_links:
            raise OpFailed(
                ErrorKind.RUNTIME,
                "this host takes no connections from other hosts (--no-peer-links): "
                "run the job's collectives through its consumer",
            )

    def _group(self, name: str) -> dist.ProcessGroup:
        group = self._groups.get(name)
        if group is None:
            raise OpFailed(ErrorKind.VALUE, f"this session is in no group {name!r}")
        return group

    @staticmethod
    def _wait(name: str, work: dist.Work) -> None:
        try:
            work.wait()
        except RuntimeError as exc:
            # A peer lost breaks the group: its client may go back and form it again
            # (``remote/regroup.py``). A timeout is the script's to see: a rank that never
            # came would not come after going back either.
            kind = ErrorKind.RUNTIME if "Timed out" in str(exc) else ErrorKind.GROUP
            raise OpFailed(kind, f"collective in group {name!r}: {exc}") from None

    def close(self) -> None:
        """Leave every group and stop serving stores."""
        self._groups.clear()
        for _store, listener in self._served.values():
            listener.close()
        self._served.clear()
