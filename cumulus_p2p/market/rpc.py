"""One request, one response per direct libp2p stream: the shell the market's protocols share.

Each message is a frame: a 4-byte big-endian length, then that many bytes. The lease
protocol (``negotiation``), receipts and lease settlement (``settlement``) all use it.

``serve_rpc`` registers a handler that reads one request, awaits the answer and writes
it. It catches every stream error itself: an exception escaping a py-libp2p handler
breaks later streams on that connection (see LIBP2P-NOTES). A peer that hangs up, stalls
or sends a bad frame loses only its own stream. ``call_rpc`` is the client side.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio
from libp2p.abc import IHost, INetStream
from libp2p.custom_types import TProtocol
from libp2p.exceptions import BaseLibp2pError
from libp2p.peer.id import ID

from .._errors import FrameTooLargeError

__all__ = ["MAX_FRAME", "Answer", "call_rpc", "serve_rpc"]

MAX_FRAME = 16 * 1024
_HEADER = 4

#: ``await answer(request, requester_peer_id) -> response``.
Answer = Callable[[bytes, str], Awaitable[bytes]]


async def _read_exactly(stream: INetStream, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        # StreamEOF is raised on a short read; the caller's except clause handles it.
        buf += await stream.read(n - len(buf))
    return bytes(buf)


async def _read_frame(stream: INetStream, max_size: int) -> bytes:
    size = int.from_bytes(await _read_exactly(stream, _HEADER), "big")
    if size > max_size:
        raise FrameTooLargeError(f"frame of {size} bytes is over the limit of {max_size}")
    return await _read_exactly(stream, size)


async def _write_frame(stream: INetStream, payload: bytes) -> None:
    await stream.write(len(payload).to_bytes(_HEADER, "big") + payload)


def serve_rpc(
    host: IHost,
    protocol: TProtocol,
    answer: Answer,
    *,
    timeout: float = 10.0,
    max_request: int = MAX_FRAME,
) -> None:
    """Answer each request on ``protocol`` with ``answer``, within ``timeout`` seconds."""

    async def handle(stream: INetStream) -> None:
        try:
            with trio.fail_after(timeout):
                request = await _read_frame(stream, max_request)
                requester = stream.muxed_conn.peer_id.to_base58()
                await _write_frame(stream, await answer(request, requester))
                await stream.close()
        except (BaseLibp2pError, FrameTooLargeError, trio.TooSlowError):
            try:
                await stream.reset()
            except BaseLibp2pError:
                pass  # Already torn down; nothing is left to release.

    host.set_stream_handler(protocol, handle)


async def call_rpc(
    host: IHost,
    peer: ID,
    protocol: TProtocol,
    request: bytes,
    *,
    timeout: float = 10.0,
    max_response: int = MAX_FRAME,
) -> bytes:
    """Send one request to ``peer`` on ``protocol`` and return its response.

    Raises:
        FrameTooLargeError: The response is over ``max_response``.
        trio.TooSlowError: No answer within ``timeout``.
        libp2p.exceptions.BaseLibp2pError: The stream could not be opened or broke.
    """
    with trio.fail_after(timeout):
        stream = await host.new_stream(peer, [protocol])
        try:
            await _write_frame(stream, request)
            return await _read_frame(stream, max_response)
        finally:
            try:
                await stream.close()
            except BaseLibp2pError:
                pass  # The response is already in hand; a failed close loses nothing.
