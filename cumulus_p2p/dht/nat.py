"""NAT traversal: AutoNAT, circuit relay v2 and DCUtR, wired from py-libp2p.

Theory of operation
-------------------
- *AutoNAT* answers other peers' dial-back requests, and asks connected peers to dial
  us back so the node learns whether it is publicly reachable.
- A reachable node may serve as a *relay* (circuit relay v2 HOP role) within
  ``RelayLimits``: a cap on reservations, concurrent circuits, circuit duration and
  bytes per circuit.
- An unreachable node (no listen address, or AutoNAT says private) takes the CLIENT
  role: it keeps reservations on the relays it is connected to, so a peer can reach
  it at ``<relay addr>/p2p-circuit/p2p/<its id>``.
- *DCUtR* then tries to upgrade a relayed connection to a direct one (hole punching);
  when it cannot, the relayed connection stays in use.

py-libp2p runs relay discovery at start-up and then every ``discovery_interval``
(300 s by default), so after connecting to a relay the node calls
``discover_relays()`` itself (``NatTraversal.use_relays``).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import cast

import multiaddr
import trio
from libp2p.abc import IHost
from libp2p.host.autonat import AutoNATService, AutoNATStatus
from libp2p.host.basic_host import BasicHost
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from libp2p.tools.anyio_service import background_trio_service

from .._errors import PeerUnreachableError

__all__ = ["NatConfig", "NatTraversal", "circuit_addr", "open_nat_traversal"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class NatConfig:
    """NAT traversal settings.

    Attributes:
        serve_relay: Act as a relay for others when this node is reachable.
        max_reservations: Peers that may hold a reservation on this relay at once.
        max_circuits: Concurrent relayed connections this relay carries.
        circuit_duration: Seconds one relayed connection may last.
        circuit_bytes: Bytes one relayed connection may carry.
        hole_punch: Run DCUtR to upgrade relayed connections to direct ones.
    """

    serve_relay: bool = True
    max_reservations: int = 32
    max_circuits: int = 16
    circuit_duration: int = 120
    circuit_bytes: int = 16 * 1024 * 1024
    hole_punch: bool = True

    def limits(self) -> RelayLimits:
        """Return py-libp2p relay limits for this configuration."""
        return RelayLimits(
            duration=self.circuit_duration,
            data=self.circuit_bytes,
            max_circuit_conns=self.max_circuits,
            max_reservations=self.max_reservations,
        )


def circuit_addr(relay_addr: multiaddr.Multiaddr, relay_id: ID, target: ID) -> multiaddr.Multiaddr:
    """Return the address that reaches ``target`` through the relay at ``relay_addr``."""
    base = str(relay_addr)
    relay_part = f"/p2p/{relay_id.to_base58()}"
    if not base.endswith(relay_part):
        base += relay_part
    return multiaddr.Multiaddr(f"{base}/p2p-circuit/p2p/{target.to_base58()}")


@dataclass(frozen=True, eq=False)
class NatTraversal:
    """The running NAT services of one host. Get one from ``open_nat_traversal``."""

    relay: CircuitV2Protocol
    transport: CircuitV2Transport
    autonat: AutoNATService
    #: Whether this host serves as a relay (it can be dialed and ``serve_relay`` is on).
    is_relay: bool
    #: Whether this host keeps reservations on relays (it cannot be dialed).
    is_client: bool

    def reachability(self) -> str:
        """Return AutoNAT's verdict: ``"public"``, ``"private"`` or ``"unknown"``."""
        status = self.autonat.get_status()
        if status == AutoNATStatus.PUBLIC:
            return "public"
        if status == AutoNATStatus.PRIVATE:
            return "private"
        return "unknown"

    async def check_reachability(self, servers: Iterable[ID]) -> str:
        """Ask ``servers`` to dial us back and return the updated verdict."""
        await self.autonat.check_reachability(list(servers))
        return self.reachability()

    async def use_relays(self) -> list[ID]:
        """Find relays among connected peers now and reserve a slot on each.

        Only an unreachable node (CLIENT role) reserves; call this after connecting
        to a relay, since py-libp2p's own discovery loop runs every 300 s.

        Returns:
            The relays this node holds (or would hold) reservations on.
        """
        discovery = self.transport.discovery
        await discovery.discover_relays()
        return discovery.get_relays()

    async def dial_via_relay(
        self, relay_addr: multiaddr.Multiaddr, relay_id: ID, target: ID, *, timeout: float = 10.0
    ) -> None:
        """Open a relayed connection to ``target``; streams to it then use the relay.

        Raises:
            PeerUnreachableError: The relay refused or the circuit could not be made.
        """
        addr = circuit_addr(relay_addr, relay_id, target)
        try:
            with trio.fail_after(timeout):
                await self.transport.dial(addr)
        except trio.TooSlowError as exc:
            raise PeerUnreachableError(f"relayed dial to {target} timed out") from exc
        except (ConnectionError, OSError, ValueError) as exc:
            raise PeerUnreachableError(f"relay {relay_id} cannot reach {target}: {exc}") from exc


@asynccontextmanager
async def open_nat_traversal(
    host: IHost, config: NatConfig, *, reachable: bool
) -> AsyncIterator[NatTraversal]:
    """Start AutoNAT, circuit relay v2 and DCUtR on a running host.

    Args:
        host: A started host.
        config: Relay limits and switches.
        reachable: Whether the node can be dialed directly (it listens). A reachable
            node serves as a relay if ``config.serve_relay``; an unreachable one keeps
            reservations on the relays it connects to.

    Yields:
        The running services.
    """
    is_relay = reachable and config.serve_relay
    is_client = not reachable
    roles = RelayRole.STOP
    if is_relay:
        roles |= RelayRole.HOP
    if is_client:
        roles |= RelayRole.CLIENT
    limits = config.limits()
    relay = CircuitV2Protocol(host, limits=limits, allow_hop=is_relay)
    transport = CircuitV2Transport(host, relay, RelayConfig(roles=roles, limits=limits))
    # AutoNATService registers its stream handler itself; it catches its own errors.
    autonat = AutoNATService(cast(BasicHost, host), serve=reachable)
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(background_trio_service(relay))
        if is_client:
            await stack.enter_async_context(background_trio_service(transport.discovery))
        if config.hole_punch:
            await stack.enter_async_context(background_trio_service(DCUtRProtocol(host)))
        yield NatTraversal(relay, transport, autonat, is_relay=is_relay, is_client=is_client)
