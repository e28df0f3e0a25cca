"""The consumer's side: the ``cumulus`` torch device in Python, talking to a host's executor.

The executor that serves it is ``cumulus_p2p.host``; what the two say to each other is
``cumulus_p2p.wire``; the channels the op stream travels on are ``cumulus_p2p.channel``.
Parts:

- ``tensor``, ``kernels`` and ``device``: ``RemoteTensor`` and its dispatch, the PrivateUse1
  kernels dispatch cannot reach, and the ``torch.cumulus`` module; ``autocast``: mixed
  precision as on CUDA.
- ``client``: the consumer's session: batching, sync points, frees, failover.
- ``moves``: tensors moved between two devices of one process, host to host.
- ``transfer``: how a tensor of any size is cut into pieces, and transfer progress.
- ``failover`` and ``checkpoint``: surviving a lost host: the replay log and checkpoint
  policy, checkpoints and where the consumer keeps them (a second host that keeps them off
  the consumer's link: ``blobs.standby``, which the native device uses too).
- ``capture``, ``compiled``, ``compiled_optimizer`` and ``compile_routing``: compiled steps
  sent as graphs, once.
- ``errors``: the executor's errors as the consumer sees them.

Typical use, against an executor started with ``cumulus-executor --port 5555``::

    import torch, cumulus_p2p.remote as remote
    with remote.attach("127.0.0.1:5555"):
        model = MyModel().to("cumulus")
        ...

A model split across GPUs attaches one executor per device, ``cumulus:0`` up; a tensor
moved between them goes from host to host (``moves``)::

    with remote.attach(["10.0.0.1:5555", "10.0.0.2:5555"]):
        first, second = Stage1().to("cumulus:0"), Stage2().to("cumulus:1")
        loss = second(first(x.to("cumulus:0")).to("cumulus:1")).sum()

To survive the executor vanishing, say how to reach a replacement::

    remote.attach(channel=connect(), reconnect=connect, checkpoint_interval=30.0)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .._errors import CheckpointCorruptError, FailoverError
from ..blobs.standby import CheckpointPlacement, HostCheckpoint, StandbyLink
from ..channel.transport import FrameChannel, SocketFrameChannel, silence_limit
from . import device as _device
from . import kernels as _kernels  # noqa: F401 - PrivateUse1 kernels: factories, copies, sdpa
from .checkpoint import (
    Checkpoint,
    CheckpointStore,
    DirectoryCheckpointStore,
    MemoryCheckpointStore,
)
from .client import CURRENT, RemoteSession, current_session
from .errors import RemoteOutOfMemoryError
from .failover import FailoverStatistics
from .tensor import RemoteTensor

__all__ = [
    "Checkpoint",
    "CheckpointCorruptError",
    "CheckpointPlacement",
    "CheckpointStore",
    "DirectoryCheckpointStore",
    "FailoverError",
    "FailoverStatistics",
    "HostCheckpoint",
    "MemoryCheckpointStore",
    "RemoteOutOfMemoryError",
    "RemoteSession",
    "RemoteTensor",
    "StandbyLink",
    "attach",
    "current_session",
    "detach",
    "register_device",
]

#: Make ``cumulus`` a torch device before any session (``attach`` does it too).
register_device = _device.register


class _Attached:
    """Returned by ``attach``: the session (``cumulus:0``'s) and every device's
    (``sessions``), usable as a context manager that detaches."""

    def __init__(self, session: RemoteSession, sessions: list[RemoteSession] | None = None) -> None:
        self.session = session
        self.sessions = sessions if sessions is not None else [session]

    def __enter__(self) -> RemoteSession:
        return self.session

    def __exit__(self, *exc) -> None:
        detach()


def attach(
    address: str | Sequence[str] | None = None,
    *,
    channel: FrameChannel | Sequence[FrameChannel] | None = None,
    quota_bytes: int | None = None,
    reconnect: Callable[[], FrameChannel] | None = None,
    checkpoint_interval: float | None = None,
    checkpoint_store: CheckpointStore | None = None,
    private: bool = False,
    standby: str | FrameChannel | None = None,
    checkpoint_to: str | None = None,
    replace_standby: Callable[[str, int], FrameChannel | None] | None = None,
    fetch_elsewhere: Callable[[list[str]], dict] | None = None,
    group_failover: bool = True,
) -> _Attached:
    """Open a session with an executor and make it the ``cumulus`` device.

    Backward passes started on the calling thread then run on it rather than on autograd's
    thread for the device (``torch.autograd.set_multithreading_enabled(False)`` until
    ``detach``): on cumulus that thread overlaps nothing and only costs hand-offs.

    Several addresses (or channels) attach one session each, as the devices ``cumulus:0``
    to ``cumulus:N-1`` of this process: a model split across them moves its activations
    from host to host (``moves.py``). Failover is for one device yet: its options are
    refused with several.

    Args:
        address: ``"host:port"`` of an executor reachable over plain TCP, or a list of
            them, one per device.
        channel: an already connected ``FrameChannel`` (e.g. the secure channel), or a
            list of them, instead.
        quota_bytes: ask for a smaller memory quota than the executor's default.
        reconnect: turns failover on: called when the executor is lost, returns a new
            connected ``FrameChannel`` (to the same host, which may resume the session
            from its cache, or to a replacement). None: a lost executor ends the session
            with ``SessionClosedError``. See ``RemoteSession``.
        checkpoint_interval: with ``reconnect``, seconds between checkpoints (taken at a
            sync point; 0: every sync point; None: only when the replay log is full).
        checkpoint_store: where checkpoints are kept (default: this process's memory;
            ``DirectoryCheckpointStore(path)`` for disk).
        private: the host keeps none of this session's uploads once it ends (nothing of
            it enters the host's blob store).
        standby: ``"host:port"`` of a second executor that keeps the checkpoints, copied
            there host to host (``blobs/standby.py``): they stay off the consumer's link, and a
            failover pulls the state from there. Or a connected channel to it whose
            ``peer_address`` says where other hosts reach it (a market host's secure
            channel). Needs ``reconnect``.
        checkpoint_to: ``"standby"`` (the default with a standby), ``"consumer"`` (the
            default without: ``checkpoint_store``) or ``"both"``.
        replace_standby: called with why when the standby is lost, and the GiB the next
            must lend (0: as many as the last): a channel to a new one (as ``standby``),
            or None (``RemoteSession``).
        fetch_elsewhere: has the host fetch an upload's missing pieces from other hosts
            first (``RemoteSession``).
        group_failover: whether a job's collective group may take over failover, so
            that it outlives a lost host (``RemoteSession``, ``regroup.py``).

    Returns:
        A handle whose ``.session`` is the ``RemoteSession`` (``cumulus:0``'s;
        ``.sessions`` lists every device's); use it in a ``with`` block to detach at the
        end. ``session.failovers``, ``session.last_failover_s`` and
        ``session.failover_statistics()`` say what failover did.
    """
    if (address is None) == (channel is None):
        raise ValueError("pass exactly one of address='host:port' or channel=...")
    if not isinstance(address, str | None) or isinstance(channel, list | tuple):
        failover = (reconnect, checkpoint_interval, checkpoint_store, standby)
        if failover != (None,) * 4:
            raise ValueError(
                "failover is for one device per process yet: attach one address to "
                "use reconnect, checkpoints or a standby"
            )
        targets = list(address if address is not None else channel)  # type: ignore[arg-type]
        return _attach_devices(targets, quota_bytes=quota_bytes, private=private)
    if channel is None:
        channel = SocketFrameChannel.connect(*host_port(address), silence_s=silence_limit())
    link = None
    if isinstance(standby, str):
        standby_channel = SocketFrameChannel.connect(*host_port(standby), silence_s=silence_limit())
        link = StandbyLink(standby_channel, address=standby)
    elif standby is not None:
        address = getattr(standby, "peer_address", None)
        if address is None:
            raise ValueError("the standby's channel must say where other hosts reach it")
        link = StandbyLink(standby, address=address)
    _device.register()
    detach()
    session = RemoteSession(
        channel,
        quota_bytes=quota_bytes,
        reconnect=reconnect,
        checkpoint_interval=checkpoint_interval,
        checkpoint_store=checkpoint_store,
        private=private,
        standby=link,
        checkpoint_to=checkpoint_to,
        replace_standby=replace_standby,
        fetch_elsewhere=fetch_elsewhere,
        group_failover=group_failover,
    )
    _make_devices([session])
    return _Attached(session)


def _attach_devices(targets: list, **options) -> _Attached:
    """One plain session per address or channel, as ``cumulus:0`` to ``cumulus:N-1``."""
    if not targets:
        raise ValueError("attach needs at least one executor address")
    _device.register()
    detach()
    sessions: list[RemoteSession] = []
    try:
        for target in targets:
            if isinstance(target, str):
                target = SocketFrameChannel.connect(*host_port(target), silence_s=silence_limit())
            sessions.append(RemoteSession(target, **options))
    except BaseException:
        for session in sessions:
            session.close()
        raise
    _make_devices(sessions)
    return _Attached(sessions[0], sessions)


def _make_devices(sessions: list[RemoteSession]) -> None:
    """Make ``sessions`` this process's ``cumulus:0`` to ``cumulus:N-1``, seeded alike."""
    for index, session in enumerate(sessions):
        session.device = torch.device(_device.NAME, index)
    CURRENT.sessions, CURRENT.index = sessions, 0
    _run_backward_on_this_thread()
    pending = _device.CumulusModule._pending_seed
    if pending is not None:
        for session in sessions:
            session.seed(pending)


def host_port(address: str) -> tuple[str, int]:
    """``(host, port)`` of an executor's ``"host:port"`` (brackets off an IPv6 host).

    Raises:
        ValueError: it does not look like ``host:port``.
    """
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"executor address must look like host:port, got {address!r}")
    return host.strip("[]"), int(port)


def detach() -> None:
    """Close the attached sessions, if any; their remote memory is released."""
    sessions, CURRENT.sessions, CURRENT.index = CURRENT.sessions, [], 0
    CURRENT.pairs = {}
    for session in sessions:
        session.close()
    if sessions:
        torch.autograd.set_multithreading_enabled(True)


def _run_backward_on_this_thread() -> None:
    """Make backward passes started on this thread run on it, not on autograd's thread
    for the device.

    Backward on cumulus only queues records, so a thread of its own overlaps nothing; the
    hand-over to it and back cost about 0.3 ms per backward pass here, a tenth of a
    compiled training step. The setting is torch's own, per thread, and ``detach``
    restores the default.
    """
    torch.autograd.set_multithreading_enabled(False)
