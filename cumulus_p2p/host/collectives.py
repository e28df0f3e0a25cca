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
under a prefix the consumer draws at random and tells only the job's ranks, each over
its own encrypted channel. That prefix is also the group's secret: neither the store nor
gloo listens where other hosts can reach them, and every byte between two hosts crosses
a TLS 1.3 link that only holders of the secret can open (``peerlinks.py``). A host that
is not in the job fails that handshake and reaches nothing.

A job whose hosts share a network its owner trusts (one rig's GPUs, one rack) may ask for
plain links instead (``links`` "plain": ``CUMULUS_PEER_LINKS=plain`` on the consumer):
the store and gloo then listen on the host's address, unencrypted, a few times faster
on a fast network, and the secret prefix is all that keeps other hosts out.

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

from ..channel.transport import silence_limit
from ..wire import collective_sizes
from ..wire.links import PEER_LINKS, PLAIN, TLS
from .handles import ErrorKind, OpFailed
from .peerlinks import GLOO_HOST, LOOPBACK, STORE, LinkedStore, PeerLinkError, Tunnel

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
    links: str = TLS

    @classmethod
    def parse(cls, args: object) -> Membership:
        """Check a ``@pg_join`` record's arguments; raise ``OpFailed`` when malformed."""
        types = (str, str, int, str, int, int, str, (int, float), str)
        if not (
            isinstance(args, list)
            and len(types) - 1 <= len(args) <= len(types)
            and all(
                isinstance(a, t) and type(a) is not bool for a, t in zip(args, types, strict=False)
            )
        ):
            raise OpFailed(
                ErrorKind.PROTOCOL_ERROR,
                "@pg_join takes [name, store host, store port, prefix, rank, world, host, "
                "timeout seconds, links (optional: 'tls' or 'plain')]",
            )
        member = cls(*args)  # type: ignore[arg-type]
        _check_links(member.links)
        if not 1 <= member.world <= MAX_WORLD or not 0 <= member.rank < member.world:
            raise OpFailed(ErrorKind.VALUE, f"rank {member.rank} of {member.world} is not a rank")
        if not 0 < member.store_port < 65536 or not 0 < member.timeout_s <= MAX_TIMEOUT_S:
            raise OpFailed(ErrorKind.VALUE, "the store's port or the timeout is out of range")
        _check_secret(member.prefix)
        return member


@dataclass
class CollectiveGroups:
    """The groups one session has joined, and the store it serves as a job's rank 0.
    ``peer_links`` False (``--no-peer-links``): the host cannot be reached by other
    hosts, and refuses to serve a store or join a group (its welcome says so, and the
    job's collectives go through the consumer instead)."""

    peer_links: bool = True
    _groups: dict[str, dist.ProcessGroup] = field(default_factory=dict)
    _tunnels: dict[str, Tunnel] = field(default_factory=dict)
    #: By the port the other ranks reach it at: its tunnel's (none with plain links).
    _served: dict[int, tuple[dist.TCPStore, socket.socket, Tunnel | None]] = field(
        default_factory=dict
    )
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

    def serve_store(self, host: str, world: int, secret: str, links: str = TLS) -> int:
        """Serve a store for a group of ``world`` ranks whose secret is ``secret``;
        return the port on ``host`` where the other ranks reach it (its tunnel's).

        With TLS links the store listens on loopback, with plain links on ``host``:
        left to itself, a ``TCPStore`` listens on every interface of the machine.
        """
        self._check_links()
        if not 1 <= world <= MAX_WORLD:
            raise OpFailed(ErrorKind.VALUE, f"a group of {world} ranks is not a group")
        _check_secret(secret)
        _check_links(links)
        tunnel = _tunnel(secret, host) if links == TLS else None
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            listener = socket.create_server((LOOPBACK if tunnel else host, 0), family=family)
        except OSError as exc:
            if tunnel:
                tunnel.close()
            raise OpFailed(ErrorKind.VALUE, f"cannot serve a store on {host}: {exc}") from None
        address = listener.getsockname()[:2]
        store = dist.TCPStore(
            *address, world, is_master=True, wait_for_workers=False,
            master_listen_fd=listener.fileno(),
        )  # fmt: skip
        if tunnel is None:
            self._served[address[1]] = (store, listener, None)
            return address[1]
        tunnel.expose(STORE, address)
        self._served[tunnel.port] = (store, listener, tunnel)
        return tunnel.port

    def join(self, member: Membership) -> None:
        """Join ``member.name``'s group; blocks until every rank has joined."""
        self._check_links()
        if member.name in self._groups:
            raise OpFailed(ErrorKind.VALUE, f"this session is already in group {member.name!r}")
        timeout = timedelta(seconds=member.timeout_s)
        store, tunnel = self._meeting(member, timeout)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        gloo_host = GLOO_HOST if tunnel else member.host
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=gloo_host)]
        prefixed = dist.PrefixStore(f"{member.prefix}/{member.name}", store)
        try:
            linked = LinkedStore(prefixed, tunnel) if tunnel else prefixed
            group = dist.ProcessGroupGloo(linked, member.rank, member.world, options)
        except (RuntimeError, PeerLinkError) as exc:
            if tunnel and tunnel is not self._served.get(member.store_port, (None,) * 3)[2]:
                tunnel.close()
            message = f"could not join group {member.name!r}: {exc}"
            raise OpFailed(ErrorKind.RUNTIME, message) from None
        self._groups[member.name] = group
        if tunnel:
            self._tunnels[member.name] = tunnel

    def _meeting(self, member: Membership, timeout: timedelta) -> tuple[dist.Store, Tunnel | None]:
        """The group's store, and this rank's tunnel (none with plain links): rank 0's
        are those it serves; another rank's tunnel is its own, its store reached
        through it."""
        served = self._served.get(member.store_port) if member.rank == 0 else None
        if served is not None:
            store, _listener, tunnel = served
            served_as = (TLS, tunnel.secret) if tunnel else (PLAIN, member.prefix)
            if served_as != (member.links, member.prefix):
                message = "a group's join names other links or another secret than its store"
                raise OpFailed(ErrorKind.VALUE, message)
            return store, tunnel
        if member.links == PLAIN:
            address = (member.store_host, member.store_port)
            try:
                return dist.TCPStore(*address, member.world, is_master=False, timeout=timeout), None
            except RuntimeError as exc:
                message = f"could not join group {member.name!r}: {exc}"
                raise OpFailed(ErrorKind.RUNTIME, message) from None
        tunnel = _tunnel(member.prefix, member.host)
        rank0 = (member.store_host, member.store_port)
        try:
            tunnel.probe(rank0)
            forward = tunnel.forward(rank0, STORE)
            store = dist.TCPStore(LOOPBACK, forward, member.world, is_master=False, timeout=timeout)
        except (PeerLinkError, RuntimeError) as exc:
            tunnel.close()
            message = f"could not join group {member.name!r}: {exc}"
            raise OpFailed(ErrorKind.RUNTIME, message) from None
        return store, tunnel

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

    def _wait(self, name: str, work: dist.Work) -> None:
        try:
            work.wait()
        except RuntimeError as exc:
            # A peer lost breaks the group: its client may go back and form it again
            # (``remote/regroup.py``). A timeout is the script's to see: a rank that never
            # came would not come after going back either.
            kind = ErrorKind.RUNTIME if "Timed out" in str(exc) else ErrorKind.GROUP
            tunnel = self._tunnels.get(name)
            why = f" ({tunnel.severed})" if tunnel is not None and tunnel.severed else ""
            raise OpFailed(kind, f"collective in group {name!r}: {exc}{why}") from None

    def close(self) -> None:
        """Leave every group, close their links and stop serving stores."""
        self._groups.clear()
        for tunnel in self._tunnels.values():
            tunnel.close()
        self._tunnels.clear()
        for _store, listener, served_tunnel in self._served.values():
            if served_tunnel:
                served_tunnel.close()
            listener.close()
        self._served.clear()


def _check_secret(secret: str) -> None:
    if len(secret) < 16:
        raise OpFailed(ErrorKind.VALUE, "a group's prefix is a secret of 16 characters or more")


def _check_links(links: str) -> None:
    if links not in PEER_LINKS:
        message = f"a group's links are {TLS!r} or {PLAIN!r}, not {links!r}"
        raise OpFailed(ErrorKind.VALUE, message)


def _tunnel(secret: str, host: str) -> Tunnel:
    try:
        return Tunnel(secret, host, silence_s=silence_limit())
    except (PeerLinkError, ValueError) as exc:
        raise OpFailed(ErrorKind.VALUE, str(exc)) from None
    except OSError as exc:
        raise OpFailed(ErrorKind.VALUE, f"cannot open the group's links on {host}: {exc}") from None
