"""Moving a tensor between two ``cumulus`` devices of one process, host to host.

Theory of operation
-------------------
A process that attached several executors (``attach(["a:1", "b:2"])``) has the devices
``cumulus:0`` to ``cumulus:N-1``, each a session on its own host. A model split across
them (a pipeline: layers on ``cumulus:0``, the rest on ``cumulus:1``) moves its
activations forward and its gradients back with ``t.to("cumulus:1")``; autograd's
backward of that move is the move back.

The two hosts move the bytes between themselves, never through this process. The
first move between two devices forms a group of two between their executors, as a job
of two ranks does (``host/collectives.py``): the lower device's host serves the store,
under a prefix drawn here. A move is then a broadcast from the source's rank: one small
record in each session's op stream, queued like any op. Both sessions send at once, so
neither host waits on a record still held here.

Moves cannot deadlock: every session's stream is a part of this process's one order of
ops, so the earliest move not yet done has both its hosts at it.

Where a host takes no links from other hosts (``--no-peer-links``, or a session reached
through a relay), a move between it and another device goes through this process: read
back, then written to the other host, as ``.cpu().to(...)`` would.

Not yet: failover. A move in a session's replay log would run again alone on a new host,
so ``attach`` refuses failover's options with several devices.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from .client import CURRENT, RemoteSession
from .regroup import peer_links, reachable_host
from .tensor import RemoteTensor, contiguous_strides, download, new_empty, upload_into

#: How long a move may wait for the other device's host to reach it: the ops queued
#: before it on either side run first, as long as they take.
MOVE_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class _Pair:
    """The group of two devices' hosts: ``name`` on both; ``None`` where one host cannot
    be reached by the other, and moves go through this process."""

    name: str | None
    first: RemoteSession  # rank 0 of the group


def move(tensor: RemoteTensor, to: RemoteSession) -> RemoteTensor:
    """A contiguous copy of ``tensor`` on ``to``'s device (``tensor.to("cumulus:i")``)."""
    source = tensor._rs.session
    dense = tensor.contiguous()
    out = new_empty(dense.shape, contiguous_strides(dense.shape), dense.dtype, to)
    pair = _pair(source, to)
    if pair.name is None:
        upload_into(out, download(dense))
        return out
    root = 0 if source is pair.first else 1
    for session, sent in ((source, dense), (to, out)):
        session.submit(["@pg_broadcast", [pair.name, sent._wire(), root], {}, None])
        session.count_peer_bytes(dense.nbytes)
        session.flush()
    return out


def _pair(a: RemoteSession, b: RemoteSession) -> _Pair:
    """The group of ``a``'s and ``b``'s hosts, formed at their first move."""
    first, second = sorted((a, b), key=lambda s: s.device.index)
    key = (first.device.index, second.device.index)
    pair = CURRENT.pairs.get(key)
    if pair is None:
        pair = CURRENT.pairs[key] = _form(first, second)
    return pair


def _form(first: RemoteSession, second: RemoteSession) -> _Pair:
    hosts = [reachable_host(s.info, s._channel) for s in (first, second)]
    if None in hosts:
        return _Pair(None, first)
    name = f"devices/{first.device.index}-{second.device.index}"
    prefix = secrets.token_hex(16)  # also the key of the hosts' link (``host/peerlinks.py``)
    links = peer_links()
    port = first.call(["@pg_store", [hosts[0], 2, prefix, links], {}, None])
    for rank, (session, host) in enumerate(zip((first, second), hosts, strict=True)):
        join = [name, hosts[0], port, prefix, rank, 2, host, MOVE_TIMEOUT_S, links]
        session.submit(["@pg_join", join, {}, None])
        session.flush()  # both joins leave before either is waited on: each waits for the other
    for session in (first, second):
        session.synchronize()
    return _Pair(name, first)
