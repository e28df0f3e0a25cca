"""The lease protocol over a direct libp2p stream: a thin trio shell around ``LeaseBook``.

One request, one response per stream (``rpc``). The request is the consumer's signed
proposal envelope. The response
is msgpack ``[True, lease_bytes, endpoints]`` or ``[False, reason_name, detail]``, where
``endpoints`` lists the ``"host:port"`` addresses of the host's direct session channel.

Server: ``LeaseServer(book)`` with ``rpc_propose_lease(request, context) -> bytes``;
``serve_leases(host, server)`` registers it under ``LEASE_PROTOCOL`` (``rpc.serve_rpc``
handles stream errors). ``rpc_propose_lease`` never awaits, so a check and its
reservation can never interleave with another proposal.

Client: ``call_propose_lease(host, peer, proposal) -> LeaseGrant``, which checks the
host's countersignature against the key inside ``peer`` before returning.

Use hosts built with Noise as their only security transport.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import msgpack
from libp2p.abc import IHost
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from .._errors import (
    InvalidCountersignatureError,
    LeaseRefusedError,
    MalformedMessageError,
)
from ..envelope import Envelope
from .lease import LeaseBook, Refusal, RefusalReason, Reservation
from .messages import Bid, Lease
from .rpc import call_rpc, serve_rpc

__all__ = [
    "LEASE_PROTOCOL",
    "LeaseGrant",
    "LeaseServer",
    "RpcContext",
    "call_propose_lease",
    "serve_leases",
]

LEASE_PROTOCOL = TProtocol("/cumulus/lease/1.0.0")
_MAX_ENDPOINTS = 8
_MAX_ENDPOINT_LEN = 128


@dataclass(frozen=True, slots=True)
class RpcContext:
    """Who a request came from: the Noise-authenticated peer ID (base58)."""

    peer: str


@dataclass(frozen=True, slots=True)
class LeaseGrant:
    """A countersigned lease and where to open its session channel.

    Attributes:
        lease: The lease, countersignature verified.
        endpoints: ``"host:port"`` addresses of the host's direct session channel, best
            first; empty when the host serves sessions over libp2p streams only.
    """

    lease: Lease
    endpoints: tuple[str, ...]


def _packb(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True, strict_types=True)


class LeaseServer:
    """Serves lease proposals from a ``LeaseBook``.

    Args:
        book: The host's lease book.
        clock: Returns the current Unix time; the only clock read on this path.
        timeout: Seconds a peer gets to send its request.
        endpoints: Returns the ``"host:port"`` addresses of the session channel sent
            with each granted lease.
        screen: Given the authenticated consumer, why the host will not lease to it
            now (shutting down, an unpaid record), or ``None``; asked before the book.
        on_preempted: Given the leases preempted to make room for one just granted
            (``LeaseBook.take_preempted``): tell their consumers, end their sessions.
        waiting: Returns the bids resting in the host's order book, so the best one
            waiting gets free shares first (``admission.py``).
    """

    def __init__(
        self,
        book: LeaseBook,
        *,
        clock: Callable[[], float] = time.time,
        timeout: float = 10.0,
        endpoints: Callable[[], list[str]] = list,
        screen: Callable[[str], str | None] = lambda consumer: None,
        on_preempted: Callable[[list[Reservation]], None] = lambda preempted: None,
        waiting: Callable[[], Iterable[Bid]] = tuple,
    ) -> None:
        self.book = book
        self._screen = screen
        self._waiting = waiting
        self._on_preempted = on_preempted
        self._clock = clock
        self.timeout = timeout
        self._endpoints = endpoints

    def rpc_propose_lease(self, request: bytes, context: RpcContext) -> bytes:
        """Decide one proposal and return the encoded response. Synchronous on purpose.

        Args:
            request: The proposal envelope's bytes.
            context: The authenticated sender.
        """
        refusal = self._screen(context.peer)
        if refusal is not None:
            return _packb([False, RefusalReason.CONSUMER_REFUSED.name, refusal])
        now = self._clock()
        self.book.expire(now)
        result = self.book.propose(request, now=now, sender=context.peer, waiting=self._waiting())
        if isinstance(result, Refusal):
            return _packb([False, result.reason.name, result.detail])
        preempted = self.book.take_preempted()
        if preempted:
            self._on_preempted(preempted)
        return _packb([True, result.to_bytes(), self._endpoints()[:_MAX_ENDPOINTS]])


def serve_leases(host: IHost, server: LeaseServer) -> None:
    """Register ``server`` on ``host`` under ``LEASE_PROTOCOL``."""

    async def answer(request: bytes, requester: str) -> bytes:
        return server.rpc_propose_lease(request, RpcContext(requester))

    serve_rpc(host, LEASE_PROTOCOL, answer, timeout=server.timeout)


async def call_propose_lease(
    host: IHost, peer: ID, proposal: Envelope, *, timeout: float = 10.0
) -> LeaseGrant:
    """Propose a lease to ``peer`` and return the countersigned lease and its endpoints.

    Args:
        host: This node's libp2p host, connected to (or able to dial) ``peer``.
        peer: The host that published the offer.
        proposal: The signed ``LeaseProposal`` envelope (see ``seal_message``).
        timeout: Seconds for the whole exchange.

    Returns:
        The grant: the lease, with the host's countersignature verified, and the
        session channel's endpoints.

    Raises:
        LeaseRefusedError: The host refused; ``reason`` is a ``RefusalReason``.
        MalformedMessageError: The host answered with something invalid.
        InvalidCountersignatureError: The host's countersignature does not verify, or
            it countersigned a different proposal.
        trio.TooSlowError: No answer within ``timeout``.
        libp2p.exceptions.BaseLibp2pError: The stream could not be opened or broke.
    """
    host_key = peer.extract_public_key()
    if host_key is None:
        raise ValueError(f"peer ID {peer} does not embed its public key")
    response = await call_rpc(host, peer, LEASE_PROTOCOL, proposal.to_bytes(), timeout=timeout)
    grant = _decode_response(response)
    if grant.lease.envelope != proposal:
        raise InvalidCountersignatureError("the host countersigned a different proposal")
    grant.lease.verify(host_key.to_bytes())
    return grant


def _decode_response(response: bytes) -> LeaseGrant:
    try:
        decoded = msgpack.unpackb(response, raw=False, use_list=True, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise MalformedMessageError(f"lease response is not msgpack: {exc}") from exc
    if type(decoded) is list and len(decoded) == 3 and decoded[0] is True:
        if type(decoded[1]) is not bytes:
            raise MalformedMessageError("lease response must carry the lease as bytes")
        return LeaseGrant(Lease.from_bytes(decoded[1]), _endpoints(decoded[2]))
    if (
        type(decoded) is list
        and len(decoded) == 3
        and decoded[0] is False
        and type(decoded[1]) is str
        and decoded[1] in RefusalReason.__members__
        and type(decoded[2]) is str
    ):
        raise LeaseRefusedError(RefusalReason[decoded[1]], decoded[2])
    raise MalformedMessageError(
        "lease response must be [True, lease, endpoints] or [False, reason, detail]"
    )


def _endpoints(value: object) -> tuple[str, ...]:
    if type(value) is not list or len(value) > _MAX_ENDPOINTS:
        raise MalformedMessageError(f"endpoints must be a list of at most {_MAX_ENDPOINTS}")
    for item in value:
        host, _, port = item.rpartition(":") if type(item) is str else ("", "", "")
        if not host or not port.isdigit() or len(item) > _MAX_ENDPOINT_LEN:
            raise MalformedMessageError(f"endpoint {item!r} is not host:port")
    return tuple(value)
