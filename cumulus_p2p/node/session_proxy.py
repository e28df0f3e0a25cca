"""Loopback doors to providers' session services, through the consumer node's libp2p host.

The shim dials a provider's session port directly when it can. When it cannot (the
provider is behind NAT or a firewall), it dials the door the consumer node opened for
that provider instead: a loopback port where each connection becomes a libp2p stream on
``SESSION_PROTOCOL`` to the provider, over whatever connection the node holds to it
(direct, or through a circuit relay), with bytes copied both ways.

The secure channel's handshake runs end to end between the shim and the provider, so a
door carries only ciphertext and needs no secret: a local process that connects to it
cannot pass the handshake without the consumer's key. A resume dials the door again and
gets a new stream; when the node's connection to the provider is gone (a relay cut the
circuit at its duration or byte cap), the door reaches the provider again first (a new
circuit), so the session resumes as after any blip instead of losing its host.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import partial

import trio
from libp2p.abc import IHost
from libp2p.peer.id import ID

from ..channel.secure.libp2p_path import SESSION_PROTOCOL, Libp2pByteStream
from .runtime import peer_of

__all__ = ["SessionDoors"]

log = logging.getLogger("cumulus_p2p.node.session_proxy")

_CHUNK = 65536


class SessionDoors:
    """One loopback door per provider, open for as long as ``nursery`` runs.

    Args:
        host: The consumer node's libp2p host.
        nursery: Where the doors' listeners run.
        reach: Connects to a provider afresh (directly, else through a relay); called
            when no stream can be opened over the connection the host holds.
    """

    def __init__(
        self, host: IHost, nursery: trio.Nursery, reach: Callable[[ID], Awaitable[None]]
    ) -> None:
        self._host = host
        self._nursery = nursery
        self._reach = reach
        self._doors: dict[str, str] = {}

    async def door(self, provider: str) -> str:
        """The ``127.0.0.1:port`` endpoint that leads to ``provider`` (opened on first use)."""
        if provider not in self._doors:
            listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
            port = listeners[0].socket.getsockname()[1]
            handler = partial(self._carry, peer_of(provider))
            self._nursery.start_soon(trio.serve_listeners, handler, listeners)
            self._doors[provider] = f"127.0.0.1:{port}"
        return self._doors[provider]

    async def _carry(self, peer: ID, local: trio.SocketStream) -> None:
        async with local:
            try:
                stream = await self._open_stream(peer)
            except Exception as exc:  # noqa: BLE001 - py-libp2p raises many kinds here
                log.warning("no session stream to %s: %s", peer.to_base58()[:12], exc)
                return
            remote = Libp2pByteStream(stream)
            async with remote, trio.open_nursery() as nursery:
                nursery.start_soon(_copy, local, remote, nursery.cancel_scope)
                nursery.start_soon(_copy, remote, local, nursery.cancel_scope)

    async def _open_stream(self, peer: ID):
        try:
            return await self._host.new_stream(peer, [SESSION_PROTOCOL])
        except Exception as exc:  # noqa: BLE001 - py-libp2p raises many kinds here
            log.info("no stream to %s (%s): opening a new circuit", peer.to_base58()[:12], exc)
        await self._reach(peer)
        return await self._host.new_stream(peer, [SESSION_PROTOCOL])


async def _copy(source: trio.abc.Stream, sink: trio.abc.Stream, done: trio.CancelScope) -> None:
    """Copy until either side ends; then end the pair (the secure channel needs no
    half-close: it says goodbye in its own records)."""
    try:
        while data := await source.receive_some(_CHUNK):
            await sink.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass
    finally:
        done.cancel()
