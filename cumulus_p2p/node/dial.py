"""Reaching a leased host from the script's process, and counting what the session carried.

Both devices use this: the Python device (``attach``) and the native one
(``native_attach``), so it imports neither.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, TypeVar

from .._errors import (
    CumulusError,
    HandshakeError,
    PeerAuthenticationError,
    PeerUnreachableError,
    SessionRefusedError,
)
from ..blobs.service import Source
from ..blobs.standby import CheckpointPlacement
from ..channel.secure import connect_secure
from ..channel.transport import CountingFrameChannel, silence_limit
from ..identity import NodeIdentity
from .control import ControlClient, SessionTicket, Transfer, Usage

log = logging.getLogger("cumulus_p2p.node.dial")

T = TypeVar("T")


class Counted(Protocol):
    """What the node's status shows of a session: its ops, and a transfer under way."""

    ops_sent: int
    transfer: Any


#: Seconds a direct dial may take before the next address is tried.
DIAL_TIMEOUT = 3.0
#: How long a host that paused the lease for an overdue receipt is dialled again before
#: the refusal stands: it asks for the receipt again every second, and the node pays.
PAUSED_PATIENCE_S = 30.0
PAUSED_RETRY_S = 0.5
#: How ``Provider.authorize`` refuses a paused lease (``LeaseState.PAUSED``); spelled out
#: here because the script's process loads no libp2p, which ``market`` imports.
PAUSED_REFUSAL = "the lease is paused"


class Opened(NamedTuple):
    """A session channel, which path it took (for the node's status), and the endpoint
    it dialled directly (None: it went through this node's door)."""

    channel: Any
    path: str
    endpoint: str | None


def open_channel(
    ticket: SessionTicket, identity: NodeIdentity, *, resume_timeout: float = 10.0
) -> Opened:
    """Open the secure session channel a ticket describes (blocking).

    Direct TCP to each of the provider's session endpoints first; when none can be
    dialed (the provider is behind NAT or a firewall), the same channel through the
    consumer node's door to it (``session_proxy``: a libp2p stream over the node's own
    connection to the provider, relayed or not). A provider that answers and refuses is
    not retried.

    Returns:
        The channel, which path it took, and the endpoint it dialled.

    Raises:
        PeerUnreachableError: no path reached the provider; the message names each.
    """
    keys = {"identity": identity, "expected_peer_public_key": ticket.provider_key}
    keys |= {"lease": ticket.lease, "resume_timeout": resume_timeout}
    keys |= {"silence_s": silence_limit()}
    failures = []
    for endpoint in filter(None, (*ticket.endpoints, ticket.door)):
        host, _, port = endpoint.rpartition(":")
        direct = endpoint != ticket.door
        try:
            # An address that blackholes the dial must not hold up the next one long.
            channel = connect_secure(
                host, int(port), timeout=DIAL_TIMEOUT if direct else 10.0, **keys
            )
        except PeerAuthenticationError:
            raise  # someone answered, and is not the provider: no other path will help
        except (OSError, HandshakeError) as exc:
            failures.append(f"{endpoint}: {exc}")
            continue
        if direct:
            return Opened(channel, f"direct to {endpoint}", endpoint)
        log.warning("provider's session port unreachable; going through libp2p")
        why = "; ".join(failures)
        return Opened(channel, f"libp2p door (no direct address answered: {why})", None)
    raise PeerUnreachableError(
        "could not reach the provider on any path (" + "; ".join(failures) + "). "
        "The provider may be offline, or unreachable from here: a provider behind NAT "
        "should forward its session port and set --advertise-host."
    )


def dial_leased(
    client: ControlClient, ticket: SessionTicket, identity: NodeIdentity, *, resume_timeout: float
) -> CountingFrameChannel:
    """The session channel of ``ticket``'s lease (``open_channel``), its path told to the
    node and its bytes counted (``USAGE``). Dialled directly, it names its host as other
    hosts reach it (``peer_address``: a standby pulls checkpoints from there)."""
    opened = _open_when_running(ticket, identity, resume_timeout=resume_timeout)
    client.report_path(ticket, opened.path)
    address = opened.endpoint and Source.secure_address(ticket.provider_key, opened.endpoint)
    return USAGE.count(opened, ticket, peer_address=address)


def _open_when_running(
    ticket: SessionTicket, identity: NodeIdentity, *, resume_timeout: float
) -> Opened:
    """``open_channel``, tried again while the host refuses because the lease is paused
    (for ``PAUSED_PATIENCE_S`` at most): the node pays the overdue receipt when the host
    asks again, and the session resumes where the pause parked it."""
    deadline = time.monotonic() + PAUSED_PATIENCE_S
    while True:
        try:
            return open_channel(ticket, identity, resume_timeout=resume_timeout)
        except SessionRefusedError as exc:
            if not exc.reason.startswith(PAUSED_REFUSAL) or time.monotonic() >= deadline:
                raise
            log.info("the host paused the lease (%s); dialling again once it is paid", exc.reason)
            time.sleep(PAUSED_RETRY_S)


def open_first(
    client: ControlClient, ticket: SessionTicket, open_session: Callable[[SessionTicket], T]
) -> tuple[SessionTicket, T]:
    """``open_session(ticket)``, once more on the node's next lease if it fails: a short
    lease can run out before its session opens on a busy machine (the node then leases
    again without blame: the term is over), and a host that refused a live lease is
    failed over. Returns the ticket that opened, and the session."""
    try:
        return ticket, open_session(ticket)
    except (OSError, CumulusError) as exc:
        log.warning("cannot open the leased session (%s); asking the node again", exc)
        ticket = client.failover(f"the session could not open: {exc}")
        return ticket, open_session(ticket)


def standby_ticket(
    client: ControlClient, placement: CheckpointPlacement, lost: str = "", gib: int = 0
) -> SessionTicket | None:
    """The lease of a standby to keep the session's checkpoints, when ``placement`` puts
    them on one and the node has one (``lost``, ``gib``: as ``ControlClient.standby``);
    else None, said in the log: the consumer's disk keeps them."""
    if not placement.on_standby:
        return None
    ticket, why = client.standby(lost, gib)
    if ticket is None:
        log.warning("no standby (%s): checkpoints go to this machine's disk", why)
    return ticket


class LeaseUsage:
    """The bytes this process's session channels carried, per lease: what the node
    checks its hosts' receipts against; and the ops its session sent, for the job's
    status. The shim reports both over the control channel."""

    def __init__(self) -> None:
        self._bytes: dict[str, int] = {}
        self._peer_bytes: dict[str, int] = {}
        #: Whether the script's collectives go through this machine (for status).
        self.through_consumer = False
        #: How the script's job links its hosts, once its group has formed (for status).
        self.peer_links = ""
        self.session: Counted | None = None

    def count(
        self, opened: Opened, ticket: SessionTicket, *, peer_address: str | None = None
    ) -> CountingFrameChannel:
        """The channel ``opened``, counted under the lease ``ticket`` names; other hosts
        reach its host at ``peer_address`` (None: they cannot)."""
        lease_id = ticket.lease_id
        self._bytes.setdefault(lease_id, 0)
        self._peer_bytes.setdefault(lease_id, 0)

        def add(n: int) -> None:
            self._bytes[lease_id] += n

        def add_peer(n: int) -> None:
            self._peer_bytes[lease_id] += n

        def through() -> None:
            self.through_consumer = True

        def links(how: str) -> None:
            self.peer_links = how

        return CountingFrameChannel(
            opened.channel,
            add,
            peer_address=peer_address,
            on_peer_bytes=add_peer,
            on_through_consumer=through,
            on_peer_links=links,
        )

    def snapshot(self) -> Usage:
        """The counts now (safe from another thread)."""
        session = self.session
        # Copied in one step first (``list`` holds the GIL throughout): the script's
        # thread adds a lease at each failover, which would break a loop over the dict.
        peer = {lease: n for lease, n in list(self._peer_bytes.items()) if n}
        through, links = self.through_consumer, self.peer_links
        if session is None:
            return Usage(
                dict(self._bytes),
                peer_bytes_by_lease=peer,
                through_consumer=through,
                peer_links=links,
            )
        moving = session.transfer
        transfer = None
        if moving is not None:
            seconds = max(0.0, time.monotonic() - moving.started)
            transfer = Transfer(moving.what, moving.done, moving.total, seconds)
        return Usage(
            dict(self._bytes),
            session.ops_sent,
            transfer,
            peer,
            through_consumer=through,
            peer_links=links,
        )


#: This process's counts (one process, one script, one node).
USAGE = LeaseUsage()
