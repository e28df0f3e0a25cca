"""Bare py-libp2p hosts on loopback, for tests of one protocol between two peers."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager

import multiaddr
from libp2p import new_host
from libp2p.abc import IHost
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport

from ..identity import NodeIdentity


@asynccontextmanager
async def noise_hosts(identities: Sequence[NodeIdentity]) -> AsyncIterator[list[IHost]]:
    """Real py-libp2p hosts on 127.0.0.1, Noise as the only security transport."""
    async with AsyncExitStack() as stack:
        hosts = []
        for identity in identities:
            noise = NoiseTransport(
                identity.key_pair, noise_privkey=create_x25519_key_pair().private_key
            )
            host = new_host(key_pair=identity.key_pair, sec_opt={NOISE_PROTOCOL_ID: noise})
            listen = multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")
            await stack.enter_async_context(host.run(listen_addrs=[listen]))
            hosts.append(host)
        yield hosts


async def connect(client: IHost, server: IHost) -> None:
    """Connect ``client`` to ``server`` at its first address."""
    await client.connect(info_from_p2p_addr(server.get_addrs()[0]))
