"""A native session: the device's batches go to a host's executor, readbacks come back.

    ext = native.load()
    with NativeSession.connect(host, port):  # or NativeSession(any FrameChannel)
        model = model.to("cumulus")          # uploads: records in the batch
        loss = train_step(model)             # ops: records in the batch, no Python per op
        print(loss.item())                   # a sync point: the batch goes, bytes return

The executor is the host's own (``cumulus-executor``, or the one a provider's node
runs): a session opens with the op stream's ``hello`` naming the native frames'
version, and the executor replays each batch with the C++ loop (``ReplaySession``).
Any ``FrameChannel`` carries it: plain TCP to a trusted executor, or the secure
channel to a provider (``cumulus_p2p.channel.secure.connect_secure``).

Python runs once per flush. A flush takes the device's batch (``take_batch``) and the
op names interned since the last one, and sends them as one frame (``wire.native``).
Without a readback nothing waits: ``flush()`` sends and returns; the device also calls
it by itself once the batch holds ``flush_bytes``, so that the executor replays the
start of a step while the client records the rest. A readback (``.cpu()``, ``.item()``,
``print``) reaches the device's readback hook, which this session sets: it flushes,
waits for the executor's reply and copies the bytes into the host tensor torch handed
the hook.

A session starts afresh: tensors made before it (with no session, or with an earlier
one) have no storage on its executor, and using one fails there as an unknown handle.

Errors: the executor replays nothing after a record fails; the next reply carries the
failure and this session raises ``NativeSessionError`` from that readback and every
later one. An executor that ends the session raises ``SessionClosedError`` with its
reason.

Not in this slice: failover, checkpoints and parking (a dropped connection ends the
session), device turns cut between the ops of a batch, and a per-device generator
(seeding ``cumulus`` is a no-op; random ops draw from the executor session's generator,
seeded with torch's default seed, or, for ops without a generator argument, from the
executor process's default generator).
"""

from __future__ import annotations

import threading

import torch

from .._errors import CumulusError, SessionClosedError
from ..channel.transport import FrameChannel, SocketFrameChannel
from ..wire import native as wire
from ..wire.protocol import PROTOCOL_VERSION, decode_frame, encode_frame
from . import load

#: Off by default (0): on this 2-core machine the early flushes did not pay for
#: themselves (BENCHMARKS.md, "native session"); a session may set e.g. 32 KiB, about a
#: third of a tiny transformer's step, to replay the start of a step while the client
#: records the rest.
DEFAULT_FLUSH_BYTES = 0


class NativeSessionError(CumulusError):
    """The executor could not run a record of this session's batches.

    Attributes:
        record: the failing record's index in its batch; ``kind``: the rule it broke
            (``errors.KINDS``).
    """

    def __init__(self, message: str, record: int = -1, kind: str = "") -> None:
        super().__init__(message)
        self.record = record
        self.kind = kind


class NativeSession:
    """One executor session for this process's native ``cumulus`` device."""

    def __init__(
        self,
        channel: FrameChannel,
        *,
        quota: int | None = None,
        flush_bytes: int = DEFAULT_FLUSH_BYTES,
    ) -> None:
        """Open a session over ``channel``: at most ``quota`` bytes of storages (the
        executor caps it at its own), batches sent early once they hold ``flush_bytes``
        (0: only at sync points).

        Raises:
            SessionClosedError: the executor refused the session; the message says why.
        """
        self._ext = load()
        self._channel = channel
        self.info = _hello(channel, quota)
        # A new executor knows no names (the whole table goes with the first flush) and
        # no storages: records pending from before, and the deaths of tensors made
        # before, are not for it.
        self._names_sent = 0
        self._ext.begin_session()
        self._failure: NativeSessionError | None = None
        self.flushes = 0
        #: Records sent, and a transfer under way (never: uploads are records too), as
        #: the node's job status shows a session (``node.dial.Counted``).
        self.ops_sent = 0
        self.transfer = None
        # Autograd's device thread may flush (early) while the main thread waits in
        # backward(); one lock keeps a frame whole and replies in order.
        self._lock = threading.Lock()
        self._ext.set_readback_hook(self._read_back)
        if flush_bytes:
            self._ext.set_flush_hook(self.flush, flush_bytes)

    @classmethod
    def connect(cls, host: str, port: int, **options) -> NativeSession:
        """A session with the plain-TCP executor at ``host:port`` (a trusted one: plain
        TCP is neither authenticated nor encrypted); ``options`` as the constructor's."""
        channel = SocketFrameChannel.connect(host, port)
        try:
            return cls(channel, **options)
        except BaseException:
            channel.close()
            raise

    def __enter__(self) -> NativeSession:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def flush(self, wait: bool = False) -> list[bytes]:
        """Send the pending records; with ``wait``, the batch's readbacks once it ran.

        Raises:
            NativeSessionError: (``wait`` only) the executor failed a record, in this
                batch or an earlier one.
        """
        with self._lock:
            batch, records = self._ext.take_batch()
            names = self._ext.op_names(self._names_sent)
            self._names_sent += len(names)
            try:
                self._channel.send_frame(wire.request(wire.BATCH, names, batch, reply=wait))
                self.flushes += 1
                self.ops_sent += records
                if not wait:
                    return []
                frame = self._channel.recv_frame()
            except (OSError, SessionClosedError) as exc:
                raise SessionClosedError(
                    f"lost the executor ({exc}). A native session cannot move to another "
                    "host yet: its tensors are gone with this one; run without --native "
                    "for failover"
                ) from exc
        reply = wire.parse_reply(frame)
        if isinstance(reply, tuple):
            record, kind, message = reply
            self._failure = NativeSessionError(f"the executor failed: {message}", record, kind)
        if self._failure is not None:
            raise self._failure
        return reply

    def _read_back(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        # The device appended the READBACK record just before calling this hook, so it
        # is the batch's last and its bytes are the reply's last.
        data = self.flush(wait=True)[-1]
        host = torch.empty(src.shape, dtype=src.dtype)
        if host.nbytes:
            host.view(-1).view(torch.uint8).copy_(torch.frombuffer(data, dtype=torch.uint8))
        dst.copy_(host)

    def close(self) -> None:
        """Flush what is pending, end the session and detach the hooks."""
        self._ext.set_readback_hook(None)
        self._ext.set_flush_hook(None)
        try:
            self.flush()
            self._channel.send_frame(wire.request(wire.BYE, [], b"", reply=False))
        except CumulusError:
            pass
        finally:
            self._channel.close()


def _hello(channel: FrameChannel, quota: int | None) -> dict:
    """Open the session: the executor's welcome info, or why it refused."""
    options: dict = {"native": wire.VERSION}
    if quota is not None:
        options["quota"] = quota
    channel.send_frame(encode_frame(["hello", PROTOCOL_VERSION, options]))
    header, _ = decode_frame(channel.recv_frame())
    match header:
        case ["welcome", _, dict(info)] if info.get("native") == wire.VERSION:
            return info
        case ["welcome", *_]:
            raise SessionClosedError(
                "the executor does not run native sessions (it is older than this client): "
                "upgrade it, or run without the native device"
            )
        case ["fatal", str(why)]:
            raise SessionClosedError(f"the executor refused the session: {why}")
    raise SessionClosedError(f"the executor answered the hello with {header[0]!r}")
