"""The shim's side of a leased session on the native device: ask the node, dial, probe.

``attach_native_leased`` does what ``attach.attach_leased`` does for the Python device,
less what the native device cannot do yet: it asks the consumer node for the lease it
matched, opens the secure session channel to that provider (``dial``), opens a native
session over it and probes the device, moving on to the next host the node leases
while one misrepresents its device. When the host is lost past the channel's resume
grace period, the node leases another and the session is rebuilt there from its last
checkpoint and the batches sent since (``native.checkpoint``, ``native.replaylog``);
checkpoints are kept on this machine's disk, under the data directory, for the run's
life. Importing this module never imports the
Python device (``cumulus_p2p.remote``), which cannot share a process with the native
one.
"""

from __future__ import annotations

import logging
import os

from .._errors import PeerUnreachableError
from ..channel.transport import CountingFrameChannel
from ..native.session import NativeSession
from .control import ControlClient, SessionTicket
from .datadir import DataDir, default_data_dir
from .dial import USAGE, open_channel
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

    def dial(ticket: SessionTicket) -> CountingFrameChannel:
        opened = open_channel(ticket, identity, resume_timeout=resume)
        client.report_path(ticket, opened.path)
        return USAGE.count(opened, ticket)

    def reconnect(lost: str) -> CountingFrameChannel:
        log.warning("%s; asking the node for another host", lost)
        return dial(client.failover(lost))

    why = None
    for _ in range(MAX_PROBED_HOSTS):
        ticket = client.session()
        session = NativeSession(
            dial(ticket),
            reconnect=reconnect,
            checkpoint_interval=interval,
            checkpoint_dir=checkpoints,
        )
        why = client.probe(measure(session, ticket.claimed_perf).to_wire())
        if why is None:
            USAGE.session = session
            return session
        log.warning("host %s misrepresents its device (%s); moving on", ticket.host[:12], why)
        session.close()
    raise PeerUnreachableError(
        f"{MAX_PROBED_HOSTS} hosts in a row misrepresented their device; the last: {why}"
    )
