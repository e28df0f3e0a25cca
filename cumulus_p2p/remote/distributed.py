"""``torch.distributed`` on ``cumulus`` tensors: the ``cumulus`` backend.

Theory of operation
-------------------
A job of N GPUs runs N processes (``torchrun``, or any launcher that sets the usual
``RANK``/``WORLD_SIZE``/``MASTER_ADDR``), each attached to its own leased session. Each
calls ``init_process_group("cumulus")`` (or ``"nccl"`` under CUDA compatibility mode) as
it would on a cluster. The backend created then:

1. draws, on rank 0, a secret prefix and has its executor serve a ``TCPStore`` for the
   hosts; the prefix and the store's address reach the other ranks through the launcher's
   own store (the consumer's, which only these processes see);
2. has every rank's executor join one gloo group through that store
   (``cumulus_p2p.host.collectives``);
3. turns each collective into one record in the session's op stream: the executors
   reduce among themselves, and the consumer's link carries a few dozen bytes per
   collective instead of the tensor.

A collective is queued like any op, so the returned work is complete at once in the
consumer's eyes: later ops on the tensor run after it on the executor, in order. A
failure (a rank gone, the group's timeout) surfaces at the next sync point as the
failed op's error.

The collectives: all-reduce, broadcast, all-gather (into a list or one tensor),
reduce-scatter (from one tensor) and barrier; what DDP, DiLoCo and FSDP2's collectives
call.

Where a rank's host cannot be reached by the others (its welcome says it takes no peer
links, ``--no-peer-links``, or the session reached it through a relay, with no address
the others could dial), no group is formed between the hosts. The ranks' own processes
then form a gloo group among themselves on the consumer's machine, and each collective
reads the tensor back, runs on the CPU copy and writes the result to the host again
(``_ThroughConsumer``): slower (each tensor crosses the consumer's link twice a
collective), but the job runs. Every rank decides alike, from the addresses all ranks
put in the launcher's store, before any host is asked to join; rank 0 says so once.

With failover on, the group outlives a lost host (``regroup.py``): the ranks checkpoint
together, and when one's host is lost, every rank rebuilds its session from that
checkpoint, the group re-forms, and each replays its stream since.

The prefix rank 0 draws is also the group's secret: the hosts' links are TLS tunnels
keyed by it (``host/peerlinks.py``), unless the job asks for plain links
(``CUMULUS_PEER_LINKS=plain``, ``regroup.peer_links``). Not yet: relays between hosts;
scatter, gather, all-to-all and point-to-point.

FSDP2 (``fully_shard``) runs on these groups. Besides the collectives it needs of the
device: freeing and re-allocating gathered parameters' storage (``fsdp.py``, set up when
a group is created), streams and events (``torch.cumulus.Stream``: ``device.py``), and
its own ops and the functional collectives run with their kernels here
(``tensor.py``'s ``_kernel_here_plan``).
"""

from __future__ import annotations

import sys
from datetime import timedelta
from fractions import Fraction

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

from ..wire import collective_sizes
from . import fsdp
from .client import RemoteSession, current_session
from .regroup import Regroup, reachable_host
from .tensor import RemoteTensor, download, upload_into

NAME = "cumulus"
#: Each rank's host address as the other hosts reach it, or "" where none can.
_HOST_KEY = "cumulus/host"


def register() -> None:
    """Make ``cumulus`` a ``torch.distributed`` backend for the ``cumulus`` device
    (idempotent)."""
    if NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(NAME, _create, devices=[NAME])


def _create(store: dist.Store, rank: int, size: int, timeout: timedelta) -> CumulusProcessGroup:
    return CumulusProcessGroup(store, rank, size, timeout)


class CumulusProcessGroup(dist.ProcessGroup):
    """A process group whose collectives run among the ranks' executors.

    Args:
        store: the launcher's store, shared by the job's processes.
        rank, size: this process's rank and the job's size.
        timeout: how long a collective may wait for the other ranks.
        session: the rank's session (default: the attached one).
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        timeout: timedelta,
        session: RemoteSession | None = None,
    ) -> None:
        super().__init__(rank, size)
        fsdp.adapt()  # FSDP2 shards over a group: its storage resizes must reach the hosts
        self._session = session or current_session()
        self._rank, self._size = rank, size
        self._name = "default"
        self._group_name = ""  # c10d's, set after creation (``setGroupName``)
        host = reachable_host(self._session.info, self._session._channel)
        store.set(f"{_HOST_KEY}/{rank}", host or "")
        hosts = [store.get(f"{_HOST_KEY}/{r}").decode() for r in range(size)]
        cut_off = [r for r, reachable in enumerate(hosts) if not reachable]
        #: Set when the collectives go through the consumer (see the module's docstring).
        self._through: _ThroughConsumer | None = None
        #: Set when they run among the hosts.
        self._regroup: Regroup | None = None
        if cut_off:
            self._go_through_consumer(store, timeout, cut_off)
        else:
            self._join_hosts(store, host or "", timeout)

    def _join_hosts(self, store: dist.Store, host: str, timeout: timedelta) -> None:
        """Have this rank's executor join the group among the job's hosts (``regroup.py``,
        which also has the group outlive a lost host)."""
        self._regroup = Regroup(store, self._rank, self._size, timeout, self._session)
        self._regroup.form(host)

    def _go_through_consumer(self, store: dist.Store, timeout: timedelta, cut_off: list) -> None:
        """Run the collectives among the ranks' processes; say so (rank 0, and status)."""
        self._through = _ThroughConsumer(store, self._rank, self._size, timeout)
        self._session.collectives_through_consumer()
        if self._rank == 0:
            print(
                f"cumulus: the hosts of ranks {cut_off} take no connections from other "
                "hosts: this job's collectives go through this machine (each tensor "
                "crosses its link twice a collective)",
                file=sys.stderr,
                flush=True,
            )

    def getBackendName(self) -> str:  # noqa: N802 - c10d's name
        return NAME

    # c10d names each group after creating it. A ProcessGroup keeps its name in its
    # backends, and this one has none: without these, ``group_name`` (which DeviceMesh,
    # and so FSDP2, reads) raises "ProcessGroup name not set".
    def setGroupName(self, name: str) -> None:  # noqa: N802 - c10d's name
        self._group_name = name

    def getGroupName(self) -> str:  # noqa: N802 - c10d's name
        return self._group_name

    def getSize(self) -> int:  # noqa: N802 - c10d's name
        return self._size

    def allreduce(self, tensors: list[torch.Tensor], opts: dist.AllreduceOptions) -> dist.Work:
        op = _reduce_name(opts.reduceOp)
        for tensor in tensors:
            if self._through is not None:
                self._through.all_reduce(_remote(tensor), op)
            else:
                self._submit("@pg_allreduce", tensor, op)
        return _done(tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions) -> dist.Work:
        for tensor in tensors:
            if self._through is not None:
                self._through.broadcast(_remote(tensor), int(opts.rootRank))
            else:
                self._submit("@pg_broadcast", tensor, int(opts.rootRank))
        return _done(tensors)

    def allgather(
        self,
        outputs: list[list[torch.Tensor]],
        tensors: list[torch.Tensor],
        opts: dist.AllgatherOptions | None = None,
    ) -> dist.Work:
        for gathered, tensor in zip(outputs, tensors, strict=True):
            if self._through is not None:
                self._through.all_gather([_remote(out) for out in gathered], _remote(tensor))
                continue
            wires = [_wire(out) for out in gathered]
            moved = sum(_nbytes(out) for out in gathered)
            self._record("@pg_allgather", [self._name, _wire(tensor), wires], moved)
        return _done(outputs)

    def all_gather_single(
        self,
        output: torch.Tensor,
        tensor: torch.Tensor,
        opts: dist.AllgatherOptions | None = None,
    ) -> dist.Work:
        """Fill ``output`` with every rank's ``tensor``, in rank order (FSDP2 gathers a
        layer's parameters with it)."""
        if self._through is not None:
            self._through.all_gather_single(_remote(output), _remote(tensor))
            return _done([output])
        wires = [self._name, _wire(output), _wire(tensor)]
        self._record("@pg_allgather_base", wires, _nbytes(output))
        return _done([output])

    def reduce_scatter_single(
        self, output: torch.Tensor, tensor: torch.Tensor, opts: dist.ReduceScatterOptions
    ) -> dist.Work:
        """Reduce ``tensor`` across the ranks; leave this rank its part of the result in
        ``output`` (FSDP2 reduces a layer's gradients with it)."""
        op = _reduce_name(opts.reduceOp)
        if self._through is not None:
            self._through.reduce_scatter_single(_remote(output), _remote(tensor), op)
            return _done([output])
        wires = [self._name, _wire(output), _wire(tensor), op]
        self._record("@pg_reduce_scatter", wires, _nbytes(tensor))
        return _done([output])

    def all_gather_single_coalesced(
        self,
        outputs: list[torch.Tensor],
        tensors: list[torch.Tensor],
        opts: dist.AllgatherOptions | None = None,
    ) -> dist.Work:
        """``all_gather_single`` of each pair (DTensor's ``full_tensor`` gathers with it)."""
        for output, tensor in zip(outputs, tensors, strict=True):
            self.all_gather_single(output, tensor, opts)
        return _done(outputs)

    # torch before 2.13 (``all_gather_into_tensor``, ``reduce_scatter_tensor``, functional
    # collectives) calls them by their older names.
    _allgather_base = all_gather_single
    _reduce_scatter_base = reduce_scatter_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def barrier(self, opts: dist.BarrierOptions | None = None) -> dist.Work:
        """Every rank's executor has run its ops up to here: an all-reduce of one element."""
        token = torch.zeros(1, device=NAME)
        if self._through is not None:
            self._session.synchronize()
            self._through.barrier()
            return _done([token])
        self._submit("@pg_allreduce", token, "SUM")
        self._session.synchronize()
        return _done([token])

    def _submit(self, record: str, tensor: torch.Tensor, last: object) -> None:
        self._record(record, [self._name, _wire(tensor), last], _nbytes(tensor))

    def _record(self, record: str, args: list, moved: int) -> None:
        """Submit ``record``, which has the host carry ``moved`` bytes between hosts: the
        count the host's receipts are checked against, as the host counts them
        (``host/collectives.py``). A checkpoint of the whole group may come first."""
        self._regroup.before_collective()
        self._session.submit([record, args, {}, None])
        self._session.count_peer_bytes(moved)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _remote(tensor: torch.Tensor) -> RemoteTensor:
    if not isinstance(tensor, RemoteTensor):
        raise ValueError(
            f"the cumulus backend moves tensors on device 'cumulus', not {tensor.device}: "
            "move the tensor there first (or use a gloo group for CPU tensors)"
        )
    return tensor


def _wire(tensor: torch.Tensor):
    return _remote(tensor)._wire()


class _ThroughConsumer:
    """A job's collectives run by its ranks' own processes: each reads its tensor back,
    the ranks run the collective on the CPU copies over a gloo group among themselves
    (met through the launcher's store), and each writes its result to its host again.

    It reads and writes with the session's own transfers (``download``, ``upload_into``),
    not ``.cpu()`` and ``copy_``: a collective may be called from inside another op's
    kernel (FSDP2's and DTensor's functional collectives), where those would dispatch
    differently. Each collective first checks that the ranks brought alike tensors
    (``agree``), as the hosts do.
    """

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta) -> None:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_default_device()]
        prefixed = dist.PrefixStore("cumulus/through-consumer", store)
        self._group = dist.ProcessGroupGloo(prefixed, rank, size, options)

    def agree(
        self, sent: torch.Tensor, received: torch.Tensor, out_per_in: Fraction = Fraction(1)
    ) -> None:
        """Check that every rank brings a tensor of ``sent``'s size and dtype, and that
        ``received`` holds ``out_per_in`` times it (``wire/collective_sizes.py``), or raise
        ``ValueError`` on every rank: gloo would abort a rank's process instead."""
        mine = collective_sizes.row(sent, received)
        table = [torch.empty_like(mine) for _ in range(self._group.size())]
        self._group.allgather([table], [mine]).wait()
        rows = [r.tolist() for r in table]
        why = collective_sizes.disagreement(rows, out_per_in, into=received is not sent)
        if why is not None:
            raise ValueError(f"a collective through the consumer: {why}")

    def all_reduce(self, tensor: RemoteTensor, op: str) -> None:
        self.agree(tensor, tensor)
        local = download(tensor)
        options = dist.AllreduceOptions()
        options.reduceOp = getattr(dist.ReduceOp, op)
        self._group.allreduce([local], options).wait()
        upload_into(tensor, local)

    def broadcast(self, tensor: RemoteTensor, root: int) -> None:
        self.agree(tensor, tensor)
        local = download(tensor)
        options = dist.BroadcastOptions()
        options.rootRank = root
        self._group.broadcast([local], options).wait()
        upload_into(tensor, local)

    def all_gather(self, outputs: list[RemoteTensor], tensor: RemoteTensor) -> None:
        for out in outputs:
            self.agree(tensor, out)
        gathered = [_cpu_like(out) for out in outputs]
        self._group.allgather([gathered], [download(tensor)]).wait()
        for out, local in zip(outputs, gathered, strict=True):
            upload_into(out, local)

    def all_gather_single(self, output: RemoteTensor, tensor: RemoteTensor) -> None:
        self.agree(tensor, output, Fraction(self._group.size()))
        gathered = _cpu_like(output)
        self._group._allgather_base(gathered, download(tensor)).wait()
        upload_into(output, gathered)

    def reduce_scatter_single(self, output: RemoteTensor, tensor: RemoteTensor, op: str) -> None:
        self.agree(tensor, output, Fraction(1, self._group.size()))
        part = _cpu_like(output)
        options = dist.ReduceScatterOptions()
        options.reduceOp = getattr(dist.ReduceOp, op)
        self._group._reduce_scatter_base(part, download(tensor), options).wait()
        upload_into(output, part)

    def barrier(self) -> None:
        self._group.barrier().wait()


def _cpu_like(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")


def _reduce_name(op: dist.ReduceOp) -> str:
    for name in ("SUM", "PRODUCT", "MIN", "MAX", "AVG"):
        if op == getattr(dist.ReduceOp, name):
            return name
    raise ValueError(f"the cumulus backend does not reduce with {op}")


def _done(tensors: list[torch.Tensor]) -> dist.Work:
    future: Future = Future()
    future.set_result(tensors)
    return _create_work_from_future(future)
