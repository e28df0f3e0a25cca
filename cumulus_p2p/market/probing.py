"""Liveness probes over a direct libp2p stream: the thin trio shell around ``liveness``.

One request, one response per stream (``rpc``), under ``LIVENESS_PROTOCOL``. The request
is the prober's challenge (``Liveness.challenge``); the response is the host's signed
answer (``liveness.answer_probe``), or an empty frame if the request was malformed.

Host: ``serve_liveness(host, identity, ...)`` registers the answer; signing one costs an
ed25519 signature, and ``rpc.serve_rpc`` bounds the request's size and time.

Prober: ``call_probe(host, peer, liveness, nonce=...)`` sends one challenge and feeds the
answer, or its absence, to the ``Liveness`` core; it returns the evidence or raises.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import trio
from libp2p.abc import IHost
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from .._errors import MalformedMessageError
from ..identity import NodeIdentity
from .liveness import Liveness, LivenessEvidence, answer_probe
from .rpc import call_rpc, serve_rpc

__all__ = ["LIVENESS_PROTOCOL", "call_probe", "serve_liveness"]

LIVENESS_PROTOCOL = TProtocol("/cumulus/liveness/1.0.0")


def serve_liveness(
    host: IHost,
    identity: NodeIdentity,
    *,
    free_shares: Callable[[], int],
    next_nonce: Callable[[], int],
    clock: Callable[[], float] = time.time,
) -> None:
    """Answer liveness probes on ``host``, signed with ``identity``.

    Args:
        host: The libp2p host the offers name.
        identity: The node key the offers are signed with.
        free_shares: Share units free over this host's offers (the capacity claim).
        next_nonce: A fresh per-author envelope nonce.
        clock: The current Unix time.
    """

    async def answer(request: bytes, requester: str) -> bytes:
        try:
            return answer_probe(
                identity, request, prober=requester, now=clock(),
                free_shares=free_shares(), nonce=next_nonce(),
            )  # fmt: skip
        except MalformedMessageError:
            return b""

    serve_rpc(host, LIVENESS_PROTOCOL, answer, timeout=5.0)


async def call_probe(
    host: IHost,
    peer: ID,
    liveness: Liveness,
    *,
    nonce: bytes,
    clock: Callable[[], float] = time.time,
    reach: Callable[[ID], Awaitable[None]] | None = None,
) -> LivenessEvidence:
    """Probe ``peer`` once, within ``liveness.policy.timeout_s``, dialing included.

    Args:
        host: This node's libp2p host.
        peer: The host to probe (unproven in ``liveness``).
        liveness: The prober's core; the verdict is fed to it.
        nonce: ``CHALLENGE_SIZE`` fresh random bytes.
        clock: The current Unix time.
        reach: ``await reach(peer)`` connects to the host first (a relay, a DHT lookup).

    Returns:
        The checked evidence: ``peer`` is now alive in ``liveness``.

    Raises:
        LivenessProofError: the answer was refused (``reason`` says why).
        trio.TooSlowError, libp2p.exceptions.BaseLibp2pError, OSError,
        cumulus_p2p.CumulusError: no answer (unreachable, no such protocol, too slow).
        In every case but success the probe counts as missed.
    """
    name = peer.to_base58()
    probe = liveness.challenge(name, nonce=nonce, now=clock())
    raw: bytes | None = None
    try:
        with trio.fail_after(liveness.policy.timeout_s):
            if reach is not None:
                await reach(peer)
            raw = await call_rpc(
                host, peer, LIVENESS_PROTOCOL, probe.request, timeout=liveness.policy.timeout_s
            )
    finally:
        if raw is None:  # unreachable, no such protocol, too slow, or cancelled
            liveness.missed(name, now=clock())
    return liveness.answered(name, raw, now=clock())  # a refused answer counts as missed
