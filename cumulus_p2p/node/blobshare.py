"""Hosts fetch public blobs from hosts, as IPFS peers do, instead of over the consumer's link.

Theory of operation
-------------------
A model's weights reach a host as 16 MiB pieces named by digest (``blobs/names.py``);
the host's blob store keeps them. The second user of a popular model on a host uploads
nothing. This module lets the first user on *another* host upload nothing either:

1. **Announce.** Each provider node announces the public blobs its store holds (pieces of
   uploads from sessions that are not private: ``BlobStore.public``) as DHT provider
   records under ``blob_key(digest)``, a few seconds after they arrive.
2. **Ask.** A consumer whose session's host lacks pieces of a tensor being uploaded asks
   that host's node to fetch them first (``FETCH_PROTOCOL``, by the lease it holds there;
   from the shim through its own node: ``consumer.py``). It then asks the host again and
   sends only what is still missing: the consumer is always the fallback.
3. **Fetch.** The host's node looks each piece up in the DHT and reads it from a provider
   over libp2p (``BLOB_PROTOCOL``: one piece per stream, several at once). Each answer
   carries the provider's signed statement of what it sent (``reputation/served.py``).
   Its store checks every piece against its digest: a provider that sends other bytes,
   or an answer it did not sign, is dropped, never asked again, and the next is asked.
   A provider that signed that it sent other bytes is also reported: its statement is
   ``BadBlob`` evidence, gossiped to every node's reputation.

A private session's uploads never enter the store, so they are never announced or served,
and its consumer asks for no fetch (a lookup would tell the DHT what it trains). A peer
asking for a blob that is not public here (a checkpoint's piece, or none at all) gets an
empty answer, the same as for a blob this host never had.
"""

from __future__ import annotations

import functools
import logging
import struct
import time
from collections.abc import Awaitable, Callable

import msgpack
import trio
from libp2p.abc import IHost
from libp2p.custom_types import TProtocol
from libp2p.exceptions import BaseLibp2pError

from .._errors import BlobMismatchError, CumulusError, EnvelopeRejectedError, MalformedMessageError
from ..blobs.names import MAX_HAVE, PIECE, is_digest
from ..blobs.service import Pulled
from ..blobs.store import BlobStore
from ..dht.node import MeshNode
from ..dht.records import NAMESPACE
from ..envelope import Envelope
from ..market.rpc import call_rpc, serve_rpc
from ..reputation.served import BlobServed, open_served, seal_served

log = logging.getLogger(__name__)

BLOB_PROTOCOL = TProtocol("/cumulus/blob/2.0.0")
FETCH_PROTOCOL = TProtocol("/cumulus/fetch/1.0.0")
#: Seconds between looks at the store for blobs to announce.
ANNOUNCE_EVERY_S = 5.0
#: Pieces fetched at once, and providers asked per piece before the consumer sends it.
PARALLEL = 4
PROVIDERS_PER_PIECE = 4
#: Seconds one piece may take from one provider; a whole fetch.
PIECE_TIMEOUT_S = 60.0
FETCH_TIMEOUT_S = 900.0

_ERRORS = (BaseLibp2pError, CumulusError, OSError, trio.TooSlowError, ValueError)
#: An answer: the statement's length, the signed statement, then the piece's bytes.
_HEAD = struct.Struct(">I")
_MAX_STATEMENT = 1024


def blob_key(name: str) -> str:
    """The DHT key a blob's providers are recorded under."""
    return f"/{NAMESPACE}/blob/{name}"


class BlobSharing:
    """A provider node's side: announce its public blobs, serve them, fetch from others.

    Args:
        node: The node's mesh node (its libp2p host, its DHT, and the identity that
            signs what it serves).
        store: The host's blob store (shared with its executors, through the disk).
        report: Called with the signed statement of a peer that admitted sending other
            bytes than asked for (gossip it as evidence); None: only drop that peer.
        clock: The time the statements it signs carry.
    """

    def __init__(
        self,
        node: MeshNode,
        store: BlobStore,
        *,
        report: Callable[[Envelope], Awaitable[None]] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._node = node
        self._host: IHost = node.host
        self._dht = node.dht
        self.store = store
        self._report = report
        self._clock = clock
        self.announced: set[str] = set()
        #: Peers that sent bytes other than the digest named: never asked again.
        self.distrusted: set = set()

    def serve(self) -> None:
        """Answer other hosts' requests for public blobs."""
        serve_rpc(self._host, BLOB_PROTOCOL, self._answer_blob, timeout=PIECE_TIMEOUT_S)

    async def announce_forever(self) -> None:
        """Announce each public blob once it is in the store (and again after a restart:
        the DHT keeps provider records for hours, a node's set starts empty)."""
        while True:
            for name in sorted(self.store.public() - self.announced):
                try:
                    await self._dht.provide(blob_key(name))
                except _ERRORS as exc:
                    log.info("could not announce blob %s: %s", name[:16], exc)
                    break  # the DHT is not ready: next round
                self.announced.add(name)
            await trio.sleep(ANNOUNCE_EVERY_S)

    async def _answer_blob(self, request: bytes, requester: str) -> bytes:
        name = request.decode("ascii", "replace")
        if not is_digest(name) or not self.store.is_public(name):
            return b""
        pinned = self.store.pin(name)
        if pinned is None:
            return b""
        try:
            data = await trio.to_thread.run_sync(pinned.read)
        except BlobMismatchError:
            return b""  # damaged on disk: dropped by the read, not served
        finally:
            pinned.close()
        raw_name = bytes.fromhex(name)
        served = BlobServed(raw_name, raw_name, requester, float(self._clock()))
        statement = seal_served(self._node.identity, served, nonce=self._node.next_nonce())
        return answer_bytes(statement, data)

    async def fetch(self, names: list[str]) -> Pulled:
        """Fetch into the store every piece of ``names`` it lacks, from the peers that
        announce it; the pieces none could give stay missing (the consumer sends them)."""
        fetched = Pulled()
        missing = [n for n in dict.fromkeys(names) if n not in self.store]
        limiter = trio.CapacityLimiter(PARALLEL)
        started = trio.current_time()
        with trio.move_on_after(FETCH_TIMEOUT_S):
            async with trio.open_nursery() as nursery:
                for name in missing:
                    nursery.start_soon(self._fetch_one, name, limiter, fetched)
        log.info(
            "fetched %d of %d blobs (%.1f MB) from other hosts in %.2f s%s",
            fetched.fetched, len(missing), fetched.fetched_bytes / 1e6,
            trio.current_time() - started,
            "; dropped " + "; ".join(fetched.dropped[:3]) if fetched.dropped else "",
        )  # fmt: skip
        return fetched

    async def _fetch_one(self, name: str, limiter: trio.CapacityLimiter, out: Pulled) -> None:
        async with limiter:
            started = trio.current_time()
            try:
                providers = await self._dht.find_providers(blob_key(name), PROVIDERS_PER_PIECE)
            except _ERRORS as exc:
                log.info("no providers found for blob %s: %s", name[:16], exc)
                return
            log.info(
                "blob %s: %d providers in %.2f s",
                name[:16], len(providers), trio.current_time() - started,
            )  # fmt: skip
            skip = {self._host.get_id(), *self.distrusted}
            peers = {p.peer_id: p for p in providers if p.peer_id not in skip}
            for info in peers.values():
                if await self._from(info, name, out):
                    return

    async def _from(self, info, name: str, out: Pulled) -> bool:
        """One piece from one provider, checked and kept; False to try the next one."""
        peer = info.peer_id
        try:
            if peer not in self._host.get_connected_peers():
                await self._host.connect(info)
            answer = await call_rpc(
                self._host,
                peer,
                BLOB_PROTOCOL,
                name.encode(),
                timeout=PIECE_TIMEOUT_S,
                max_response=_HEAD.size + _MAX_STATEMENT + PIECE,
            )
            if not answer:
                raise CumulusError("it does not hold the piece")
            statement, served, data = self._opened(answer, peer, name)
            if not await self._keep(name, data, statement, served):
                return True  # no room here: the consumer's bytes will do, once
        except BlobMismatchError as exc:
            log.warning("peer %s %s", peer.to_base58()[:12], exc)
            self.distrusted.add(peer)
            out.dropped.append(f"{peer.to_base58()[:12]}: {exc}")
            return False
        except _ERRORS as exc:
            out.dropped.append(f"{peer.to_base58()[:12]}: {exc}")
            return False
        out.fetched += 1
        out.fetched_bytes += len(data)
        return True

    def _opened(self, answer: bytes, peer, name: str) -> tuple[Envelope, BlobServed, memoryview]:
        """The signed statement (as sent, and checked) and the bytes of ``peer``'s answer
        for ``name``.

        Raises:
            BlobMismatchError: It is not an answer ``peer`` signed for ``name`` to us.
        """
        try:
            statement, data = split_answer(answer)
            served = open_served(statement)
        except (EnvelopeRejectedError, MalformedMessageError) as exc:
            raise BlobMismatchError(f"sent an answer that is not a signed piece: {exc}") from exc
        me = self._host.get_id().to_base58()
        if statement.author_peer_id != peer or served.requester != me:
            raise BlobMismatchError("sent a statement that is not its own, to us")
        if served.name.hex() != name:
            raise BlobMismatchError(f"answered for another piece than {name[:16]}")
        return statement, served, data

    async def _keep(
        self, name: str, data: memoryview, statement: Envelope, served: BlobServed
    ) -> bool:
        """Put a fetched piece in the store (``BlobStore.put``'s answer); a peer that
        signed that it sent other bytes is reported.

        Raises:
            BlobMismatchError: The bytes are not ``name``'s, whatever the peer signed.
        """
        put = functools.partial(self.store.put, name, data, public=True)
        try:
            return await trio.to_thread.run_sync(put)
        except BlobMismatchError:
            if served.sent == served.name:  # a lie in its signature: ours to know only
                raise BlobMismatchError(f"sent bytes that are not {name[:16]}") from None
            reported = ""
            if self._report is not None:
                await self._report(statement)
                reported = " (reported)"
            raise BlobMismatchError(
                f"sent bytes that are not {name[:16]}, and signed that it did{reported}"
            ) from None


def serve_fetches(host: IHost, sharing: BlobSharing, may_ask) -> None:
    """Answer fetch requests: from a consumer ``may_ask(requester, lease_id)`` admits
    (one holding a running lease here), at most ``MAX_HAVE`` pieces at a time."""

    async def answer(request: bytes, requester: str) -> bytes:
        try:
            lease_id, names = _parse_fetch(request)
        except ValueError as exc:
            return msgpack.packb({"error": f"malformed fetch request: {exc}"})
        why = may_ask(requester, lease_id)
        if why is not None:
            return msgpack.packb({"error": why})
        fetched = await sharing.fetch(names)
        wire = {"pieces": fetched.fetched, "bytes": fetched.fetched_bytes}
        return msgpack.packb(wire | {"dropped": fetched.dropped[:16]})

    request_bytes = 128 + MAX_HAVE * 66  # a lease id and MAX_HAVE digests, packed
    serve_rpc(host, FETCH_PROTOCOL, answer, timeout=FETCH_TIMEOUT_S, max_request=request_bytes)


async def call_fetch(host: IHost, peer, lease_id: str, names: list[str]) -> dict:
    """Ask ``peer`` (the host of lease ``lease_id``) to fetch ``names`` from other hosts.

    Raises:
        CumulusError: it refused; libp2p errors and ``trio.TooSlowError`` as ``call_rpc``.
    """
    request = msgpack.packb([lease_id, names])
    answer = msgpack.unpackb(
        await call_rpc(host, peer, FETCH_PROTOCOL, request, timeout=FETCH_TIMEOUT_S + 10),
        raw=False,
    )
    if not isinstance(answer, dict) or "error" in answer:
        why = answer.get("error") if isinstance(answer, dict) else "a malformed answer"
        raise CumulusError(f"the host would not fetch: {why}")
    return answer


def _parse_fetch(request: bytes) -> tuple[str, list[str]]:
    value = msgpack.unpackb(request, raw=False)
    if not (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str)):
        raise ValueError("expected [lease_id, [digest, ...]]")
    names = value[1]
    if not isinstance(names, list) or len(names) > MAX_HAVE:
        raise ValueError(f"expected a list of at most {MAX_HAVE} digests")
    if not all(isinstance(n, str) and is_digest(n) for n in names):
        raise ValueError("a piece is named by its digest")
    return value[0], names


def answer_bytes(statement: Envelope, data: memoryview | bytes) -> bytes:
    """A ``BLOB_PROTOCOL`` answer: the signed statement, then the piece."""
    raw = statement.to_bytes()
    return b"".join((_HEAD.pack(len(raw)), raw, data))


def split_answer(answer: bytes) -> tuple[Envelope, memoryview]:
    """The statement and the bytes of a ``BLOB_PROTOCOL`` answer.

    Raises:
        EnvelopeRejectedError: The statement does not decode.
        MalformedMessageError: The answer is shorter than its head says.
    """
    if len(answer) < _HEAD.size:
        raise MalformedMessageError("an answer shorter than its head")
    (length,) = _HEAD.unpack_from(answer)
    if length > _MAX_STATEMENT or _HEAD.size + length > len(answer):
        raise MalformedMessageError(f"a statement of {length} bytes")
    view = memoryview(answer)
    statement = Envelope.from_bytes(bytes(view[_HEAD.size : _HEAD.size + length]), _MAX_STATEMENT)
    return statement, view[_HEAD.size + length :]
