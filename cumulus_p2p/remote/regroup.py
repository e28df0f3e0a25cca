"""A job's collective group among its hosts, and how it outlives losing one of them.

Theory of operation
-------------------
A rank's session can rebuild its executor's state anywhere from a checkpoint and the
frames sent since (``failover.py``). A frame holding a collective, though, can only run
again if every other rank runs its own again too, in a group that has all its members.
So when a job's host is lost, every rank goes back, not only the one that lost its host:

1. **Checkpoints are taken together.** Before every 8th collective of the job, rank 0
   asks its session's policy (the interval, the log's size) whether to checkpoint there,
   and says so in the launcher's store; the other ranks read it. Every rank then takes its
   checkpoint at the same point of its stream, and holds it: it is committed (becomes
   the one a failover restores) only once every rank holds one. A host lost in the
   middle leaves every rank its previous checkpoint, and the log since.
2. **A loss opens a new generation of the group.** A rank whose host is lost (a
   failover that cannot resume the session from the host's cache), or whose collective
   fails because a peer's host is (``ErrorKind.GROUP``), moves the store's generation on
   by one. A rank waiting on the store (for rank 0's word, or for the others' checkpoints)
   sees the new generation and goes back too.
3. **Every rank rebuilds and meets again.** Each rebuilds its session from its last
   committed checkpoint, on its own host or a new one; in the fresh session, before the
   log is replayed, the ranks meet in the new generation's group (a new store on rank
   0's host, a new secret prefix). Then each replays its log: the collectives in it run
   again, in the same order, on the same inputs, so every executor's state is what it
   was before the loss.

The ranks' own processes never go back: the script sees a pause, and nothing else. Every
exchange goes through the launcher's store (the consumer's, which only the job's processes
see); a wait on it that outlasts the group's timeout raises ``TimeoutError``.

The meeting is the one place that knows how a group is formed; the first one (generation
0) runs outside the replay log too, so a rank rebuilt from the session's start, with no
checkpoint yet, forms its group the same way.
"""

from __future__ import annotations

import os
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .._errors import FailoverError
from ..channel.transport import FrameChannel
from ..wire.links import PEER_LINKS, PLAIN, TLS
from .client import RemoteSession

#: The group's generation: moved on by one each time a host is lost.
GENERATION = "cumulus/generation"
#: Set when a rank's failover gave up: the others stop waiting to meet it.
GAVE_UP = "cumulus/gave-up"
#: Collectives between two of rank 0's words on whether to checkpoint: each costs every
#: rank a round trip to the launcher's store, and a checkpoint waits for the next word.
DECIDE_EVERY = 8
#: Seconds between two looks at the store while waiting on the other ranks.
POLL_S = 0.002

Ask = Callable[[list, list], Any]


def peer_links() -> str:
    """How the job's hosts link to each other: ``CUMULUS_PEER_LINKS``, "tls" (encrypted
    and authenticated by the group's secret, the default) or "plain" (gloo's own TCP, for
    hosts on one network the job's owner trusts: faster, not encrypted)."""
    links = os.environ.get("CUMULUS_PEER_LINKS", TLS)
    if links not in PEER_LINKS:
        raise ValueError(
            f"CUMULUS_PEER_LINKS is 'tls' (the default) or 'plain' (hosts on one network "
            f"you trust), not {links!r}"
        )
    return links


@dataclass
class Regroup:
    """One rank's part in its job's group among hosts (see the module's docstring).

    Args:
        store: the launcher's store, shared by the job's processes.
        rank, size: this process's rank and the job's size.
        timeout: how long a wait on the other ranks may last.
        session: the rank's session.
        name: the group's name on the hosts (the collectives' records name it).
    """

    store: dist.Store
    rank: int
    size: int
    timeout: timedelta
    session: RemoteSession
    name: str = "default"
    generation: int = 0
    #: Collectives this rank has started: the point of the stream every rank agrees on.
    collectives: int = 0
    #: Whether the group outlives its hosts: the session fails over (``reconnect=``).
    recovers: bool = False
    #: The point of the last checkpoint: rank 0's words before it are deleted.
    swept: int = 0

    def form(self, host: str) -> None:
        """Join the first generation's group; with failover, take over the session's
        checkpoints and cold failovers, so that the group outlives its hosts."""
        if self.rank == 0:
            self.store.set(GENERATION, "0")
        self.meet(self.session.unlogged, host)
        try:
            self.session.join_group_recovery(self.rejoin, self.gave_up)
        except ValueError:
            return  # no failover, or a standby: a lost host ends the job, as before
        self.recovers = True

    def meet(self, ask: Ask, host: str) -> None:
        """Form this generation's group: rank 0's host serves its store; every rank's
        host joins it (blocks until all have). ``ask`` runs records on the session."""
        generation = self.generation
        if self.rank == 0:
            secret = secrets.token_hex(16)  # the prefix also keys the hosts' links
            links = peer_links()
            port = ask([["@pg_store", [host, self.size, secret, links], {}, None]], ["call"])
            self.store.set(f"cumulus/prefix/{generation}", secret)
            self.store.set(f"cumulus/links/{generation}", links)
            if links == PLAIN and generation == 0:
                print(
                    "cumulus: this job's hosts link in plain TCP (CUMULUS_PEER_LINKS=plain): "
                    "gradients cross between them unencrypted",
                    file=sys.stderr,
                    flush=True,
                )
            self.store.set(f"cumulus/hosts-store/{generation}", f"{host}:{port}")
        self._all_present(generation)
        where = self._wait_for(f"cumulus/hosts-store/{generation}", any_generation=True)
        store_host, _, store_port = where.decode().rpartition(":")
        prefix = self.store.get(f"cumulus/prefix/{generation}").decode()
        links = self.store.get(f"cumulus/links/{generation}").decode()  # rank 0's choice
        join = [self.name, store_host, int(store_port), prefix, self.rank, self.size, host]
        join += [self.timeout.total_seconds(), links]
        ask([["@pg_join", join, {}, None]], ["sync"])
        self.session.peer_links(links)

    def _all_present(self, generation: int) -> None:
        """Wait until every rank has come to this generation's meeting (its host's join
        would wait out the group's timeout for a rank that never comes).

        Raises:
            FailoverError: a rank's failover gave up (``gave_up``): the job cannot go on.
        """
        present = f"cumulus/present/{generation}"
        self.store.add(present, 1)
        deadline = time.monotonic() + self.timeout.total_seconds()
        while self.store.add(present, 0) < self.size:
            if self.store.check([GAVE_UP]):
                why = self.store.get(GAVE_UP).decode()
                raise FailoverError(f"the job's group cannot re-form: {why}")
            _wait_until(deadline, present)

    def gave_up(self) -> None:
        """This rank's failover gave up: tell the others, who wait for it to meet."""
        self.store.set(GAVE_UP, f"rank {self.rank} lost its host and found no other")

    def rejoin(self, ask: Ask, channel: FrameChannel, info: dict) -> None:
        """The session was rebuilt from its checkpoint (``RemoteSession``): open the next
        generation, or follow the one another rank opened, and meet there."""
        current = str(self.generation)
        self.generation = int(self.store.compare_set(GENERATION, current, str(int(current) + 1)))
        self.meet(ask, reachable_host(info, channel) or "")

    def before_collective(self) -> None:
        """Called before each collective: at every ``DECIDE_EVERY``-th, take a checkpoint
        there if rank 0 says so."""
        if not self.recovers:
            return
        point, self.collectives = self.collectives, self.collectives + 1
        if point % DECIDE_EVERY:
            return
        key = f"cumulus/checkpoint-at/{point}"
        if self.rank == 0:
            self.store.set(key, "1" if self.session.checkpoint_due() else "0")
        if self._wait_for(key) == b"1":
            self._checkpoint_together(point)
            self._sweep(point)

    def _sweep(self, point: int) -> None:
        """Every rank has passed ``point``: rank 0 deletes the words before it, so that a
        long job does not fill the launcher's store."""
        if self.rank == 0:
            for passed in range(self.swept, point, DECIDE_EVERY):
                self.store.delete_key(f"cumulus/checkpoint-at/{passed}")
        self.swept = point

    def _checkpoint_together(self, point: int) -> None:
        """Take and hold a checkpoint; commit it once every rank of this generation holds
        theirs. A new generation meanwhile: go back, and take it again."""
        while True:
            self.session.checkpoint()  # held; a host lost inside moves the generation on
            held = f"cumulus/checkpoint-held/{point}/{self.generation}"
            self.store.add(held, 1)
            if self._all_hold(held):
                self.session.commit_checkpoint()
                return
            self.session.roll_back("the job's group is re-forming: a host was lost")

    def _all_hold(self, key: str) -> bool:
        """Wait until every rank counted itself under ``key`` (True), or a new generation
        began (False)."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        while self.store.add(key, 0) < self.size:
            if self._newer_generation():
                return False
            _wait_until(deadline, key)
        return True

    def _wait_for(self, key: str, *, any_generation: bool = False) -> bytes:
        """``key``'s value once set. A new generation meanwhile: this rank goes back
        first, then keeps waiting (unless ``any_generation``: it is meeting)."""
        if not any_generation and not self.store.check([key]):
            # What this rank queued may be what another rank's host waits for, before
            # that rank can get here: send it, or the job waits on itself. (Not while
            # meeting: the session is being rebuilt, and sends nothing but the meeting.)
            self.session.flush()
        deadline = time.monotonic() + self.timeout.total_seconds()
        while not self.store.check([key]):
            if not any_generation and self._newer_generation():
                self.session.roll_back("the job's group is re-forming: a host was lost")
                deadline = time.monotonic() + self.timeout.total_seconds()
                continue
            _wait_until(deadline, key)
        return self.store.get(key)

    def _newer_generation(self) -> bool:
        return self.recovers and int(self.store.get(GENERATION)) > self.generation


def _wait_until(deadline: float, key: str) -> None:
    if time.monotonic() > deadline:
        raise TimeoutError(
            f"the job's other ranks did not reach {key!r} within the group's timeout: "
            "a rank's process may have ended (see its output)"
        )
    time.sleep(POLL_S)


def reachable_host(info: dict, channel: FrameChannel) -> str | None:
    """The executor's address as the other hosts reach it: the one this process reached;
    None where they cannot (it takes no peer links, or the session came through a relay
    and names no address)."""
    if info.get("peer_links") is False:
        return None
    address = getattr(channel, "peer_address", None)
    # A leased session's channel names its host as ``provider_key@host:port``.
    host, sep, port = (address or "").rpartition("@")[2].rpartition(":")
    if not (sep and host and port.isdigit()):
        return None
    return host.strip("[]")
