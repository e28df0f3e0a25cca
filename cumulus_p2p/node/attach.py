"""The shim's side of a leased session: ask the node, open the secure channel, attach.

In the script's process ``attach_leased()`` asks the consumer node (over the control
channel in ``control``) for the lease it matched, opens the authenticated, encrypted
session channel to that provider, and attaches the ``cumulus`` device with failover:
when the provider vanishes past the channel's resume grace period, the session asks
the node for another host and restores itself there from its last checkpoint.

In a rank of a torchrun job the session's collective group takes over its failover
(``remote/regroup.py``): when one rank's host is lost, that rank moves (the node is told
the group goes back with it), and every other rank rebuilds its session on its own host,
under the same lease, from the checkpoint the ranks took together.

Before the script runs, the device is probed (``probe``): a host that misrepresents it
is dropped at once, the node leases another, and the session starts there instead.
"""

from __future__ import annotations

import functools
import logging
import os

from .. import remote
from .._errors import CumulusError, PeerUnreachableError
from ..blobs.standby import CheckpointPlacement
from ..remote.checkpoint import DirectoryCheckpointStore
from .control import ENV_CHECKPOINT_TO, ENV_PRIVATE, ControlClient, SessionTicket
from .datadir import DataDir, default_data_dir
from .dial import USAGE, dial_leased, open_first, standby_ticket
from .probe import MAX_PROBED_HOSTS, measure

log = logging.getLogger("cumulus_p2p.node.attach")


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
        session = remote.current_session()
        if session.going_back:  # the group goes back; this rank's host is alive
            try:
                return _open(client.session())
            except (OSError, CumulusError) as exc:
                log.warning("cannot go back on the same host (%s); asking for another", exc)
        lost = session.lost_because or "provider unreachable past resume"
        log.warning("lost the provider (%s); asking the node for another host", lost)
        return _open(client.failover(lost, regroups=session.regroups))

    def _open(ticket: SessionTicket):
        return dial_leased(client, ticket, identity, resume_timeout=resume)

    def _standby(lost: str = "", gib: int = 0):
        ticket = standby_ticket(client, placement, lost, gib)
        return None if ticket is None else _open(ticket)

    for _ in range(MAX_PROBED_HOSTS):
        ticket, channel = open_first(client, client.session(), _open)
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


def attach_leased_devices(clients: list[ControlClient]):
    """Attach the providers the node leased for one process's devices (``--gpus N --
    python train.py``), ``clients[i]``'s as ``cumulus:i``; returns ``attach``'s handle.

    Each device is probed as a single one is. Failover is for one device per process
    yet: a lost host ends the script, saying so.

    Raises:
        PeerUnreachableError: a host misrepresents its device (the node moves on from it
            for the next job; this one ends).
    """
    identity = DataDir(default_data_dir()).identity()
    resume = float(os.environ.get("CUMULUS_RESUME_TIMEOUT", "10"))
    opened = []
    for client in clients:
        dial = functools.partial(dial_leased, client, identity=identity, resume_timeout=resume)
        opened.append(open_first(client, client.session(), dial))
    attached = remote.attach(
        channel=[channel for _, channel in opened],
        private=os.environ.get(ENV_PRIVATE) == "1",
    )
    for client, (ticket, _), session in zip(clients, opened, attached.sessions, strict=True):
        why = client.probe(measure(session, ticket.claimed_perf).to_wire())
        if why is not None:
            remote.detach()
            raise PeerUnreachableError(f"host {ticket.host[:12]} misrepresents its device: {why}")
    USAGE.session = attached.session
    return attached
