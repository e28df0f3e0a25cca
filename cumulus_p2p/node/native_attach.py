"""The shim's side of a leased session on the native device: ask the node, dial, probe.

``attach_native_leased`` does what ``attach.attach_leased`` does for the Python device,
less what the native device cannot do yet: it asks the consumer node for the lease it
matched, opens the secure session channel to that provider (``dial``), opens a native
session over it and probes the device, moving on to the next host the node leases
while one misrepresents its device. When the host is lost past the channel's resume
grace period, the node leases another and the session is rebuilt there from its last
checkpoint and the batches sent since (``native.checkpoint``, ``native.replaylog``).
Checkpoints go where ``CUMULUS_CHECKPOINT_TO`` says, as for the Python device: by
default to a standby host the node leases (``blobs.standby``), which pulls them from
the session's host, so a model's state does not cross this machine's link; without one
(``consumer``, or none to be had), to this machine's disk, under the data directory, for
the run's life. ``both`` keeps them on the standby only. Uploads the host already holds
go by digest (``native.named``), unless the job is ``--private``. Importing this module
never imports the Python device (``cumulus_p2p.remote``), which cannot share a process
with the native one.
"""

from __future__ import annotations

import logging
import os
from functools import partial

from .._errors import CumulusError, PeerUnreachableError
from ..blobs.standby import CheckpointPlacement, StandbyLink
from ..channel.transport import CountingFrameChannel
from ..native.session import NativeSession
from .control import ENV_CHECKPOINT_TO, ENV_PRIVATE, ControlClient, SessionTicket
from .datadir import DataDir, default_data_dir
from .dial import USAGE, dial_leased, open_first, standby_ticket
from .probe import MAX_PROBED_HOSTS, measure

log = logging.getLogger("cumulus_p2p.node.native_attach")


def attach_native_leased(client: ControlClient) -> NativeSession:
    """A native session with the provider the node leased, its device probed.

    ``CUMULUS_RESUME_TIMEOUT`` (seconds) is how long a dropped connection is retried
    before the session is lost; ``CUMULUS_CHECKPOINT_INTERVAL`` (seconds, default 30)
    how often a checkpoint is taken at a sync point.

    Raises:
        PeerUnreachableError: the provider cannot be reached, or ``MAX_PROBED_HOSTS``
            hosts in a row misrepresented their device.
    """
    data = DataDir(default_data_dir())
    identity = data.identity()
    # On disk, not in memory: a model's pieces would otherwise double the script's RAM.
    checkpoints = data.path / "native-checkpoints" / f"run-{os.getpid()}"
    resume = float(os.environ.get("CUMULUS_RESUME_TIMEOUT", "10"))
    interval = float(os.environ.get("CUMULUS_CHECKPOINT_INTERVAL", "30"))
    placement = CheckpointPlacement(os.environ.get(ENV_CHECKPOINT_TO, "standby"))

    def dial(ticket: SessionTicket) -> CountingFrameChannel:
        return dial_leased(client, ticket, identity, resume_timeout=resume)

    def standby(lost: str = "", gib: int = 0) -> StandbyLink | None:
        ticket = standby_ticket(client, placement, lost, gib)
        if ticket is None:
            return None
        try:
            channel = dial(ticket)
            if channel.peer_address is None:  # reached through a relay: no host can pull
                channel.close()
                log.warning("the standby has no direct address: checkpoints go to this disk")
                return None
            return StandbyLink(channel, address=channel.peer_address)
        except (OSError, CumulusError) as exc:
            log.warning("the standby cannot be reached (%s): checkpoints go to this disk", exc)
            return None

    def reconnect(lost: str) -> CountingFrameChannel:
        log.warning("%s; asking the node for another host", lost)
        return dial(client.failover(lost))

    def opened(link: StandbyLink | None, ticket: SessionTicket) -> NativeSession:
        return NativeSession(
            dial(ticket),
            reconnect=reconnect,
            checkpoint_interval=interval,
            checkpoint_dir=checkpoints,
            standby=link,
            replace_standby=standby,
            private=os.environ.get(ENV_PRIVATE) == "1",
            fetch_elsewhere=client.fetch,
        )

    why = None
    for _ in range(MAX_PROBED_HOSTS):
        ticket = client.session()
        link = standby()  # after the session's lease: the standby is another host
        ticket, session = open_first(client, ticket, partial(opened, link))
        why = client.probe(measure(session, ticket.claimed_perf).to_wire())
        if why is None:
            USAGE.session = session
            return session
        log.warning("host %s misrepresents its device (%s); moving on", ticket.host[:12], why)
        session.close()
    raise PeerUnreachableError(
        f"{MAX_PROBED_HOSTS} hosts in a row misrepresented their device; the last: {why}"
    )
