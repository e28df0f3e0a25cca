"""The shim's side of a leased session: ask the node, open the secure channel, attach.

In the script's process ``attach_leased()`` asks the consumer node (over the control
channel in ``control``) for the lease it matched, opens the authenticated, encrypted
session channel to that provider, and attaches the ``cumulus`` device with failover:
when the provider vanishes past the channel's resume grace period, the session asks
the node for another host and restores itself there from its last checkpoint.

Before the script runs, the device is probed (``probe``): a host that misrepresents it
is dropped at once, the node leases another, and the session starts there instead.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, NamedTuple

from .. import remote
from .._errors import (
    CumulusError,
    HandshakeError,
    PeerAuthenticationError,
    PeerUnreachableError,
)
from ..channel.secure import connect_secure
from ..channel.transport import CountingFrameChannel
from ..identity import NodeIdentity
from ..remote.blobservice import Source
from ..remote.checkpoint import DirectoryCheckpointStore
from ..remote.standby import CheckpointPlacement
from .control import ENV_CHECKPOINT_TO, ENV_PRIVATE, ControlClient, SessionTicket, Transfer, Usage
from .datadir import DataDir, default_data_dir
from .probe import measure

#: Hosts probed before giving up when each one misrepresents its device.
MAX_PROBED_HOSTS = 4

log = logging.getLogger("cumulus_p2p.node.attach")


#: Seconds a direct dial may take before the next address is tried.
DIAL_TIMEOUT = 3.0


class Opened(NamedTuple):
    """A session channel, which path it took (for the node's status), and where other
    hosts reach its host (None: only through this node's door)."""

    channel: Any
    path: str
    address: str | None


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
        The channel, which path it took, and the host's address for other hosts.

    Raises:
        PeerUnreachableError: no path reached the provider; the message names each.
    """
    keys = {"identity": identity, "expected_peer_public_key": ticket.provider_key}
    keys |= {"lease": ticket.lease, "resume_timeout": resume_timeout}
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
            address = Source.secure_address(ticket.provider_key, endpoint)
            return Opened(channel, f"direct to {endpoint}", address)
        log.warning("provider's session port unreachable; going through libp2p")
        why = "; ".join(failures)
        return Opened(channel, f"libp2p door (no direct address answered: {why})", None)
    raise PeerUnreachableError(
        "could not reach the provider on any path (" + "; ".join(failures) + "). "
        "The provider may be offline, or unreachable from here: a provider behind NAT "
        "should forward its session port and set --advertise-host."
    )


class LeaseUsage:
    """The bytes this process's session channels carried, per lease: what the node
    checks its hosts' receipts against; and the ops its session sent, for the job's
    status. The shim reports both over the control channel."""

    def __init__(self) -> None:
        self._bytes: dict[str, int] = {}
        self.session: remote.RemoteSession | None = None

    def count(self, opened: Opened, ticket: SessionTicket) -> CountingFrameChannel:
        """The channel ``opened``, counted under the lease ``ticket`` names."""
        lease_id = ticket.lease_id
        self._bytes.setdefault(lease_id, 0)

        def add(n: int) -> None:
            self._bytes[lease_id] += n

        return CountingFrameChannel(opened.channel, add, peer_address=opened.address)

    def snapshot(self) -> Usage:
        """The counts now (safe from another thread)."""
        session = self.session
        if session is None:
            return Usage(dict(self._bytes))
        moving = session.transfer
        transfer = None
        if moving is not None:
            seconds = max(0.0, time.monotonic() - moving.started)
            transfer = Transfer(moving.what, moving.done, moving.total, seconds)
        return Usage(dict(self._bytes), session.ops_sent, transfer)


#: This process's counts (one process, one script, one node).
USAGE = LeaseUsage()


def attach_leased(client: ControlClient):
    """Attach the ``cumulus`` device to the provider the node leased; returns ``attach``'s
    handle. From the environment: ``CUMULUS_CHECKPOINT_INTERVAL`` (seconds between
    checkpoints), ``CUMULUS_CHECKPOINT_TO`` (``standby``, ``consumer`` or ``both``: with a
    standby, the node leases a second host to keep them) and ``CUMULUS_RESUME_TIMEOUT``
    (how long a dropped connection is retried before the host counts as gone)."""
    data = DataDir(default_data_dir())
    identity = data.identity()
    # On disk, shared by this consumer's runs: a second run of a script on the same model
    # reads back only what changed, and the consumer's memory stays free.
    store = DirectoryCheckpointStore(
        data.path / "checkpoints", name=f"run-{os.getpid()}", keep_others=1
    )
    interval = float(os.environ.get("CUMULUS_CHECKPOINT_INTERVAL", "30"))
    placement = CheckpointPlacement(os.environ.get(ENV_CHECKPOINT_TO, "standby"))
    resume = float(os.environ.get("CUMULUS_RESUME_TIMEOUT", "10"))

    def reconnect():
        lost = remote.current_session().lost_because or "provider unreachable past resume"
        log.warning("lost the provider (%s); asking the node for another host", lost)
        return _open(client.failover(lost))

    def _open(ticket: SessionTicket):
        opened = open_channel(ticket, identity, resume_timeout=resume)
        client.report_path(ticket, opened.path)
        return USAGE.count(opened, ticket)

    def _standby(lost: str = "", gib: int = 0):
        if not placement.on_standby:
            return None
        ticket, why = client.standby(lost, gib)
        if ticket is None:
            log.warning("no standby (%s): checkpoints go to this machine's disk", why)
            return None
        return _open(ticket)

    def _first(ticket: SessionTicket):
        try:
            return ticket, _open(ticket)
        except (OSError, CumulusError) as exc:
            # A short lease can run out before its session opens on a busy machine: the
            # node then leases again without blame (the term is over); a host that
            # refused a live lease is failed over.
            log.warning("cannot open the leased session (%s); asking the node again", exc)
            ticket = client.failover(f"the session could not open: {exc}")
            return ticket, _open(ticket)

    for _ in range(MAX_PROBED_HOSTS):
        ticket, channel = _first(client.session())
        standby = _standby()
        attached = remote.attach(
            channel=channel,
            reconnect=reconnect,
            checkpoint_interval=interval,
            checkpoint_store=store,
            standby=standby,
            checkpoint_to=None if standby is None else placement.value,
            replace_standby=_standby,
            fetch_elsewhere=client.fetch,
            private=os.environ.get(ENV_PRIVATE) == "1",
        )
        why = client.probe(measure(attached.session, ticket.claimed_perf).to_wire())
        if why is None:
            USAGE.session = attached.session
            return attached
        log.warning("host %s misrepresents its device (%s); moving on", ticket.host[:12], why)
        remote.detach()
    raise PeerUnreachableError(
        f"{MAX_PROBED_HOSTS} hosts in a row misrepresented their device; the last: {why}"
    )
