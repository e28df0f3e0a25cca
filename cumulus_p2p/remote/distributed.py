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

Not yet: the hosts' links are not encrypted, and the prefix is the only thing that
keeps a host outside the job out of its group; scatter, gather, all-to-all and
point-to-point; a group that survives one of its hosts failing over.

FSDP2 (``fully_shard``) runs on these groups. Besides the collectives it needs of the
device: freeing and re-allocating gathered parameters' storage (``fsdp.py``, set up when
a group is created), streams and events (``torch.cumulus.Stream``: ``device.py``), and
its own ops and the functional collectives run with their kernels here
(``tensor.py``'s ``_kernel_here_plan``).
"""

from __future__ import annotations

import secrets
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

from . import fsdp
from .client import RemoteSession, current_session
from .tensor import RemoteTensor

NAME = "cumulus"
_STORE_KEY = "cumulus/hosts-store"
_PREFIX_KEY = "cumulus/prefix"


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
        host = _host_of(self._session)
        if rank == 0:
            port = self._session.call(["@pg_store", [host, size], {}, None])
            store.set(_STORE_KEY, f"{host}:{port}")
            store.set(_PREFIX_KEY, secrets.token_hex(16))
        store_host, _, store_port = store.get(_STORE_KEY).decode().rpartition(":")
        prefix = store.get(_PREFIX_KEY).decode()
        join = [self._name, store_host, int(store_port), prefix, rank, size, host]
        self._session.submit(["@pg_join", [*join, timeout.total_seconds()], {}, None])
        self._session.synchronize()  # a rank that cannot join says so here, not later

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
            self._submit("@pg_allreduce", tensor, op)
        return _done(tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions) -> dist.Work:
        for tensor in tensors:
            self._submit("@pg_broadcast", tensor, int(opts.rootRank))
        return _done(tensors)

    def allgather(
        self,
        outputs: list[list[torch.Tensor]],
        tensors: list[torch.Tensor],
        opts: dist.AllgatherOptions | None = None,
    ) -> dist.Work:
        for gathered, tensor in zip(outputs, tensors, strict=True):
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
        wires = [self._name, _wire(output), _wire(tensor)]
        self._record("@pg_allgather_base", wires, _nbytes(output))
        return _done([output])

    def reduce_scatter_single(
        self, output: torch.Tensor, tensor: torch.Tensor, opts: dist.ReduceScatterOptions
    ) -> dist.Work:
        """Reduce ``tensor`` across the ranks; leave this rank its part of the result in
        ``output`` (FSDP2 reduces a layer's gradients with it)."""
        wires = [self._name, _wire(output), _wire(tensor), _reduce_name(opts.reduceOp)]
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
        self._submit("@pg_allreduce", token, "SUM")
        self._session.synchronize()
        return _done([token])

    def _submit(self, record: str, tensor: torch.Tensor, last: object) -> None:
        self._record(record, [self._name, _wire(tensor), last], _nbytes(tensor))

    def _record(self, record: str, args: list, moved: int) -> None:
        """Submit ``record``, which has the host carry ``moved`` bytes between hosts: the
        count the host's receipts are checked against, as the host counts them
        (``host/collectives.py``)."""
        self._session.submit([record, args, {}, None])
        self._session.count_peer_bytes(moved)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _wire(tensor: torch.Tensor):
    if not isinstance(tensor, RemoteTensor):
        raise ValueError(
            f"the cumulus backend moves tensors on device 'cumulus', not {tensor.device}: "
            "move the tensor there first (or use a gloo group for CPU tensors)"
        )
    return tensor._wire()


def _host_of(session: RemoteSession) -> str:
    """The executor's address as the other hosts reach it: the one this process reached."""
    address = getattr(session._channel, "peer_address", None)
    # A leased session's channel names its host as ``provider_key@host:port``.
    host, sep, port = (address or "").rpartition("@")[2].rpartition(":")
    if not (sep and host and port.isdigit()):
        raise RuntimeError(
            f"the cumulus backend needs each rank's host address, and this session's channel "
            f"names none ({address!r}): attach with a 'host:port' address"
        )
    return host.strip("[]")


def _reduce_name(op: dist.ReduceOp) -> str:
    for name in ("SUM", "PRODUCT", "MIN", "MAX", "AVG"):
        if op == getattr(dist.ReduceOp, name):
            return name
    raise ValueError(f"the cumulus backend does not reduce with {op}")


def _done(tensors: list[torch.Tensor]) -> dist.Work:
    future: Future = Future()
    future.set_result(tensors)
    return _create_work_from_future(future)
