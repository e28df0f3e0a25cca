"""Remote execution: the ``cumulus`` torch device and the executor that serves it.

Parts:

- ``transport``: frame channels (plain TCP here; ``secure`` adds the encrypted one).
- ``protocol``: the op-stream codec (sans-IO).
- ``session``: the executor's per-session state machine (handles, quota, op execution).
- ``executor``: the trio service that runs sessions; ``executor_main`` is its command.
- ``client``: the consumer's session: batching, sync points, frees.
- ``tensor``, ``kernels`` and ``device``: ``RemoteTensor`` and its dispatch, the PrivateUse1
  kernels dispatch cannot reach, and the ``torch.cumulus`` module.

Typical use, against an executor started with ``cumulus-executor --port 5555``::

    import torch, cumulus_p2p.remote as remote
    with remote.attach("127.0.0.1:5555"):
        model = MyModel().to("cumulus")
        ...
"""

from __future__ import annotations

from . import device as _device  # registers the cumulus device with torch
from . import kernels as _kernels  # noqa: F401 - PrivateUse1 kernels: factories, copies, sdpa
from .client import CURRENT, RemoteSession, current_session
from .errors import RemoteOutOfMemoryError
from .tensor import RemoteTensor
from .transport import FrameChannel, SocketFrameChannel

__all__ = [
    "RemoteOutOfMemoryError",
    "RemoteSession",
    "RemoteTensor",
    "attach",
    "current_session",
    "detach",
]


class _Attached:
    """Returned by ``attach``: the session, usable as a context manager that detaches."""

    def __init__(self, session: RemoteSession) -> None:
        self.session = session

    def __enter__(self) -> RemoteSession:
        return self.session

    def __exit__(self, *exc) -> None:
        detach()


def attach(
    address: str | None = None,
    *,
    channel: FrameChannel | None = None,
    quota_bytes: int | None = None,
) -> _Attached:
    """Open a session with an executor and make it the ``cumulus`` device.

    Args:
        address: ``"host:port"`` of an executor reachable over plain TCP.
        channel: an already connected ``FrameChannel`` (e.g. the secure channel) instead.
        quota_bytes: ask for a smaller memory quota than the executor's default.

    Returns:
        A handle whose ``.session`` is the ``RemoteSession``; use it in a ``with`` block
        to detach at the end.
    """
    if (address is None) == (channel is None):
        raise ValueError("pass exactly one of address='host:port' or channel=...")
    if channel is None:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"executor address must look like host:port, got {address!r}")
        channel = SocketFrameChannel.connect(host, int(port))
    detach()
    session = RemoteSession(channel, quota_bytes=quota_bytes)
    CURRENT.session = session
    pending = _device.CumulusModule._pending_seed
    if pending is not None:
        session.seed(pending)
    return _Attached(session)


def detach() -> None:
    """Close the attached session, if any; its remote memory is released."""
    session, CURRENT.session = CURRENT.session, None
    if session is not None:
        session.close()
