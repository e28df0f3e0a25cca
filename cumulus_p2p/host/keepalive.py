"""Keepalives from an executor to its consumer while a request is in hand.

A consumer waiting for an answer cannot tell a long op from a hung host by the
connection: a stopped process or a frozen machine still has a kernel that acknowledges
every byte, so no link breaks and TCP's keepalives are answered. So the executor speaks
up: while it holds a request it has not answered, it sends an empty frame every
``KEEPALIVE_S`` of silence, and a consumer that hears nothing for its ``silence_s``
(``channel.transport.silence_limit``) gives the host up as lost (``HostSilentError``)
and fails over, as it does when a host dies. The consumer's channels skip empty frames.

Only the session's own trio task runs while the executor is hung, so nothing here can
pretend to be alive for it: the pulse runs in the same process and loop as the requests.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import trio

from .._errors import SessionClosedError
from ..channel.transport import KEEPALIVE_S, AsyncFrameChannel, Buffer

#: How long a keepalive may wait to be sent: past it, the consumer reads nothing.
SEND_LIMIT_S = 30.0


class KeptAlive:
    """An ``AsyncFrameChannel`` that knows when it owes its peer an answer: from a frame
    received to the next frame sent. ``pulse`` sends the keepalives."""

    def __init__(
        self, inner: AsyncFrameChannel, every_s: float = KEEPALIVE_S, *, owing: bool = False
    ) -> None:
        self._inner = inner
        self._every_s = every_s
        self._sending = trio.Lock()
        #: trio time since which the peer has heard nothing while owed an answer.
        self._owing_since: float | None = trio.current_time() if owing else None

    async def receive_frame(self) -> bytearray:
        self._owing_since = None
        frame = await self._inner.receive_frame()
        self._owing_since = trio.current_time()
        return frame

    async def send_frame(self, parts: Sequence[Buffer]) -> None:
        async with self._sending:
            await self._inner.send_frame(parts)
        self._owing_since = None

    async def aclose(self) -> None:
        await self._inner.aclose()

    def __getattr__(self, name: str):
        return getattr(self._inner, name)  # hand_over, peer_public_key, counters

    async def pulse(self) -> None:
        """Send an empty frame whenever an answer has been owed ``every_s`` in silence;
        runs until cancelled, or until the connection fails. A keepalive is sent whole
        or not at all. A failed one ends nothing: the session's own next read or write
        finds the failed connection, and parks the session as it always does. Only one
        the consumer takes in no ``SEND_LIMIT_S`` closes the connection (half sent, it
        would tear the stream)."""
        while True:
            since = self._owing_since
            due = self._every_s if since is None else since + self._every_s - trio.current_time()
            if due > 0:
                await trio.sleep(due)
                continue
            # Half a frame would tear the stream: shielded, but not for ever.
            deadline = trio.current_time() + SEND_LIMIT_S
            with trio.CancelScope(shield=True, deadline=deadline) as scope:
                async with self._sending:
                    if self._owing_since != since:
                        continue
                    try:
                        await self._inner.send_frame([])
                    except (
                        SessionClosedError,
                        trio.BrokenResourceError,
                        trio.ClosedResourceError,
                        OSError,
                    ):
                        return
                    self._owing_since = trio.current_time()
            if scope.cancelled_caught:  # the consumer reads nothing: a torn frame, perhaps
                with trio.CancelScope(shield=True):
                    await self._inner.aclose()
                return


@asynccontextmanager
async def keeping_alive(
    channel: AsyncFrameChannel, every_s: float = KEEPALIVE_S, *, owing: bool = False
) -> AsyncIterator[KeptAlive]:
    """``channel`` as a ``KeptAlive``, pulsing while the block runs; ``owing``: a request
    received before is still to be answered."""
    kept = KeptAlive(channel, every_s, owing=owing)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(kept.pulse)
            try:
                yield kept
            finally:
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # The pulse raises nothing: this is the block's own error, which callers catch.
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
