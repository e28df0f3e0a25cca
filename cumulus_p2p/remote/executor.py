"""The executor: a trio service that runs consumers' op streams on this machine's device.

Each connection is one session (``session.py`` holds its state). The shell reads a frame,
decodes it, lets the session run the batch in a worker thread (torch ops block), and sends
the reply if the batch asked for one. Batches from all sessions take turns on the device:
the device lock is where compute isolation between tenants lives.

A frame that cannot be decoded ends only its own session, with a ``fatal`` message saying
why; the executor and every other session carry on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import trio

from .._errors import FrameTooLargeError, RemoteProtocolError, SessionClosedError
from .protocol import PROTOCOL_VERSION, decode_frame, encode_frame
from .session import Batch, DeviceContext, ExecutorSession, Reply, parse_batch
from .transport import DEFAULT_MAX_FRAME, AsyncFrameChannel, TrioFrameChannel

log = logging.getLogger(__name__)

DEFAULT_QUOTA = 8 * 1024**3
#: Batches this short run on the event loop itself; longer ones go to a worker thread so
#: the loop keeps serving other sessions' I/O while the device computes.
INLINE_OPS = 8


def pick_device(choice: str = "auto") -> torch.device:
    """``"auto"`` is CUDA when present, CPU otherwise; ``"cuda"``/``"cpu"`` force one.

    Raises:
        ValueError: ``"cuda"`` was forced on a machine without CUDA, or the choice is unknown.
    """
    if choice == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was forced but this machine has no usable CUDA GPU")
    if choice not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {choice!r}: use auto, cpu or cuda")
    return torch.device("cuda", 0) if choice == "cuda" else torch.device("cpu")


@dataclass
class ExecutorConfig:
    """How an executor runs: device, per-session memory quota, largest frame accepted."""

    device: str = "auto"
    quota_bytes: int = DEFAULT_QUOTA
    max_frame: int = DEFAULT_MAX_FRAME


class Executor:
    """Serves sessions on one device. Share one instance across listeners and channels."""

    def __init__(self, config: ExecutorConfig | None = None) -> None:
        self.config = config or ExecutorConfig()
        self.ctx = DeviceContext(pick_device(self.config.device))
        self.sessions: dict[int, ExecutorSession] = {}
        self._device_lock = trio.Lock()
        self._next_id = 1

    async def run_session(self, channel: AsyncFrameChannel) -> None:
        """Serve one session until the client leaves or breaks the protocol."""
        session_id = self._next_id
        self._next_id += 1
        session: ExecutorSession | None = None
        try:
            options = await self._handshake(channel, session_id)
            quota = min(options.get("quota", self.config.quota_bytes), self.config.quota_bytes)
            session = ExecutorSession(self.ctx, quota_bytes=quota)
            self.sessions[session_id] = session
            await self._serve_batches(channel, session)
        except RemoteProtocolError as exc:
            log.info("session %d: protocol error: %s", session_id, exc)
            await _send_fatal(channel, str(exc))
        except SessionClosedError:
            log.info("session %d: client went away", session_id)
        except Exception as exc:  # whatever one session does, the others keep running
            log.exception("session %d: internal error", session_id)
            await _send_fatal(channel, f"executor internal error: {type(exc).__name__}: {exc}")
        finally:
            self.sessions.pop(session_id, None)
            if session is not None:
                session.close()
            with trio.CancelScope(shield=True):
                await channel.aclose()

    async def _handshake(self, channel: AsyncFrameChannel, session_id: int) -> dict:
        header, _ = decode_frame(await channel.receive_frame())
        if header[0] != "hello" or len(header) != 3 or not isinstance(header[2], dict):
            raise RemoteProtocolError("expected a hello message first")
        if header[1] != PROTOCOL_VERSION:
            raise RemoteProtocolError(
                f"client speaks op-stream version {header[1]!r}; this executor speaks "
                f"{PROTOCOL_VERSION}. Upgrade the older side."
            )
        options = header[2]
        if "quota" in options and (type(options["quota"]) is not int or options["quota"] <= 0):
            raise RemoteProtocolError("quota must be a positive integer")
        info = {
            "session": session_id,
            "device": str(self.ctx.device),
            "device_name": _device_name(self.ctx.device),
            "torch": str(torch.__version__),
            "quota": min(options.get("quota", self.config.quota_bytes), self.config.quota_bytes),
        }
        await channel.send_frame(encode_frame(["welcome", PROTOCOL_VERSION, info]))
        return options

    async def _serve_batches(self, channel: AsyncFrameChannel, session: ExecutorSession) -> None:
        while True:
            try:
                frame = await channel.receive_frame()
            except FrameTooLargeError as exc:
                raise RemoteProtocolError(str(exc)) from exc
            header, area = decode_frame(frame)
            if header[0] == "bye":
                return
            if header[0] != "batch":
                raise RemoteProtocolError(f"unexpected {header[0]!r} message in a session")
            batch = parse_batch(header, area)
            reply = await self._run_on_device(session, batch)
            if reply is not None:
                await channel.send_frame(_encode_reply(reply))

    async def _run_on_device(self, session: ExecutorSession, batch: Batch) -> Reply | None:
        # Taking a free lock without a checkpoint saves a trip through the scheduler on
        # every sync point; the batch's own I/O awaits are the fairness points.
        try:
            self._device_lock.acquire_nowait()
        except trio.WouldBlock:
            await self._device_lock.acquire()
        try:
            if len(batch.ops) <= INLINE_OPS:
                # A sync point's short tail: a thread hop would cost more than the ops.
                return session.run_batch(batch)
            return await trio.to_thread.run_sync(session.run_batch, batch)
        finally:
            self._device_lock.release()

    async def serve_tcp(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Accept plain TCP sessions forever; reports the bound port through ``task_status``."""
        listeners = await trio.open_tcp_listeners(port, host=host)
        bound = listeners[0].socket.getsockname()[1]

        async def handler(stream: trio.SocketStream) -> None:
            await self.run_session(TrioFrameChannel(stream, max_frame=self.config.max_frame))

        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, handler, listeners)
            task_status.started(bound)


def _encode_reply(reply: Reply) -> list:
    lengths = [len(b) for b in reply.blobs]
    header: list[Any] = ["reply", reply.seq, reply.error, reply.result, lengths]
    return encode_frame(header, reply.blobs)


async def _send_fatal(channel: AsyncFrameChannel, message: str) -> None:
    try:
        with trio.move_on_after(5):
            await channel.send_frame(encode_frame(["fatal", message]))
    except SessionClosedError:
        pass


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"
