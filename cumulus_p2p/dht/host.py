"""The libp2p host factory: Noise only, yamux only, TCP; bootstrap and mDNS helpers.

py-libp2p's ``new_host()`` offers Noise, TLS, SECIO and ``/plaintext/2.0.0`` unless
told otherwise, and a default listener accepts a plaintext dialer. Every host Cumulus
builds goes through ``new_mesh_host``, which passes ``sec_opt`` with Noise alone and
``muxer_opt`` with yamux alone, so a peer that cannot speak Noise never gets a
connection.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import IHost
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.custom_types import TMuxerOptions, TProtocol, TSecurityOptions
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux

from .._errors import MeshError, PeerUnreachableError

__all__ = [
    "interface_ipv4s",
    "LOOPBACK",
    "connect",
    "new_mesh_host",
    "noise_only",
    "parse_peer_addr",
    "yamux_only",
]

LOOPBACK = multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")


def noise_only(key_pair: KeyPair) -> TSecurityOptions:
    """Return security options offering Noise and nothing else.

    The Noise static key is a fresh X25519 key per host; the libp2p identity key signs
    it during the handshake, so the peer ID is still authenticated.
    """
    noise_key = create_x25519_key_pair().private_key
    return {NOISE_PROTOCOL_ID: NoiseTransport(key_pair, noise_privkey=noise_key)}


def yamux_only() -> TMuxerOptions:
    """Return muxer options offering yamux and nothing else."""
    return {TProtocol(YAMUX_PROTOCOL_ID): Yamux}


def new_mesh_host(
    key_pair: KeyPair,
    *,
    listen_addrs: Sequence[multiaddr.Multiaddr] = (),
    enable_mdns: bool = False,
) -> IHost:
    """Build (but do not start) a libp2p host for the mesh.

    Start it with ``async with host.run(listen_addrs=[...])``.

    Args:
        key_pair: The node's libp2p key pair (``NodeIdentity.key_pair``).
        listen_addrs: Where it will listen; decides which transports are built
            (TCP when empty).
        enable_mdns: Announce and discover peers with mDNS on the local network.
            Off by default: it multicasts on the LAN, which tests and servers avoid.

    Returns:
        The host.
    """
    return new_host(
        key_pair=key_pair,
        sec_opt=noise_only(key_pair),
        muxer_opt=yamux_only(),
        listen_addrs=list(listen_addrs) or None,
        enable_mDNS=enable_mdns,
    )


def parse_peer_addr(addr: str | multiaddr.Multiaddr) -> PeerInfo:
    """Parse ``/ip4/.../tcp/.../p2p/<peer id>`` into a ``PeerInfo``.

    Raises:
        MeshError: The address is not a multiaddr ending in ``/p2p/<peer id>``.
    """
    try:
        maddr = addr if isinstance(addr, multiaddr.Multiaddr) else multiaddr.Multiaddr(addr)
        return info_from_p2p_addr(maddr)
    except Exception as exc:  # noqa: BLE001 - multiaddr raises many unrelated types
        raise MeshError(f"{addr!s} is not a multiaddr ending in /p2p/<peer id>: {exc}") from exc


async def connect(host: IHost, info: PeerInfo, *, timeout: float = 10.0) -> None:
    """Connect ``host`` to a peer, or raise.

    Raises:
        PeerUnreachableError: The dial failed or took longer than ``timeout``.
    """
    if info.peer_id == host.get_id():
        return
    try:
        with trio.fail_after(timeout):
            await host.connect(info)
    except trio.TooSlowError as exc:
        raise PeerUnreachableError(f"dialing {info.peer_id} timed out") from exc
    except Exception as exc:  # noqa: BLE001 - swarm errors have no common base
        raise PeerUnreachableError(f"cannot connect to {info.peer_id}: {exc}") from exc


def interface_ipv4s() -> list[str]:
    """This machine's IPv4 addresses, other interfaces' first, loopback last."""
    from multiaddr.utils import get_network_addrs  # what py-libp2p itself enumerates

    found = [ip for ip in get_network_addrs(4) or [] if not ip.startswith("127.")]
    return [*found, "127.0.0.1"]


def observed_ipv4s(host: IHost) -> list[str]:
    """Public IPv4 addresses that peers have seen this host at, as confirmed by identify.

    py-libp2p counts an address as observed once several distinct peers report it (its
    ``ObservedAddrManager``); behind a NAT it is the router's address. Listen addresses
    and loopback are left out: they are not news.
    """
    listening = {str(a) for a in host.get_transport_addrs()}
    found = []
    for addr in host.get_addrs():
        parts = str(addr).split("/")
        if len(parts) < 3 or parts[1] != "ip4" or parts[2].startswith("127."):
            continue
        bare = str(addr).split("/p2p/")[0]
        if bare not in listening and parts[2] not in found:
            found.append(parts[2])
    return found


def is_connected(host: IHost, peer_id: ID) -> bool:
    """Return whether ``host`` holds at least one connection to ``peer_id``."""
    return bool(host.get_network().get_connections(peer_id))


def listen_addrs_with_id(host: IHost) -> list[multiaddr.Multiaddr]:
    """Return the host's addresses, each ending in ``/p2p/<its peer id>``."""
    suffix = f"/p2p/{host.get_id().to_base58()}"
    out = []
    for addr in host.get_addrs():
        text = str(addr)
        out.append(multiaddr.Multiaddr(text if text.endswith(suffix) else text + suffix))
    return out


def peers_to_dial(host: IHost, *, exclude: Iterable[ID] = ()) -> list[PeerInfo]:
    """Return peers in the peerstore with addresses that ``host`` is not connected to.

    mDNS and identify fill the peerstore; this is what the node's maintenance loop
    dials so that discovered peers join the mesh.
    """
    skip = set(exclude)
    skip.add(host.get_id())
    store = host.get_peerstore()
    out = []
    for peer_id in store.peers_with_addrs():
        if peer_id in skip or is_connected(host, peer_id):
            continue
        addrs = [a for a in store.addrs(peer_id) if "/p2p-circuit" not in str(a)]
        if addrs:
            out.append(PeerInfo(peer_id, addrs))
    return out
