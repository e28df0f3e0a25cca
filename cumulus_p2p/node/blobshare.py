"""Hosts fetch public blobs from hosts, as IPFS peers do, instead of over the consumer's link.

Theory of operation
-------------------
A model's weights reach a host as 16 MiB pieces named by digest (``remote/blobs.py``);
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
   over libp2p (``BLOB_PROTOCOL``: one piece per stream, several at once). Its store
   checks every piece against its digest: a provider that sends other bytes is dropped,
   never asked again, and the next is asked.

A private session's uploads never enter the store, so they are never announced or served,
and its consumer asks for no fetch (a lookup would tell the DHT what it trains). A peer
asking for a blob that is not public here (a checkpoint's piece, or none at all) gets an
empty answer, the same as for a blob this host never had.
"""

from __future__ import annotations

import logging

import msgpack
import trio
from libp2p.abc import IHost
from libp2p.custom_types import TProtocol
from libp2p.exceptions import BaseLibp2pError

from .._errors import BlobMismatchError, CumulusError
from ..dht.records import NAMESPACE
from ..market.rpc import call_rpc, serve_rpc
from ..remote.blobs import MAX_HAVE, PIECE, is_digest
from ..remote.blobservice import Pulled
from ..remote.blobstore import BlobStore

log = logging.getLogger(__name__)

BLOB_PROTOCOL = TProtocol("/cumulus/blob/1.0.0")
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


def blob_key(name: str) -> str:
    """The DHT key a blob's providers are recorded under."""
    return f"/{NAMESPACE}/blob/{name}"


class BlobSharing:
    """A provider node's side: announce its public blobs, serve them, fetch from others.

    Args:
        host: The node's libp2p host.
        dht: Its Kademlia DHT (``provide``, ``find_providers``).
        store: The host's blob store (shared with its executors, through the disk).
    """

    def __init__(self, host: IHost, dht, store: BlobStore) -> None:
        self._host = host
        self._dht = dht
        self.store = store
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
        return bytes(data)

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
            data = await call_rpc(
                self._host,
                peer,
                BLOB_PROTOCOL,
                name.encode(),
                timeout=PIECE_TIMEOUT_S,
                max_response=PIECE,
            )
            if not data:
                raise CumulusError("it does not hold the piece")
            if not await trio.to_thread.run_sync(self.store.put, name, memoryview(data)):
                return True  # no room here: the consumer's bytes will do, once
        except BlobMismatchError:
            log.warning("peer %s sent garbage for blob %s", peer.to_base58()[:12], name[:16])
            self.distrusted.add(peer)
            out.dropped.append(f"{peer.to_base58()[:12]}: sent bytes that are not {name[:16]}")
            return False
        except _ERRORS as exc:
            out.dropped.append(f"{peer.to_base58()[:12]}: {exc}")
            return False
        out.fetched += 1
        out.fetched_bytes += len(data)
        return True


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
