"""Hosts fetch public blobs from hosts: real libp2p nodes on loopback, real blob stores.

Node 0 and node 1 hold blobs; node 2 fetches. A provider that sends other bytes than the
digest names is dropped for the next (and reported, when it signed that it did), and a
blob that is not public is served to nobody.
"""

from __future__ import annotations

import msgpack
import pytest
import trio

from cumulus_p2p.blobs.names import digest
from cumulus_p2p.blobs.store import BlobStore
from cumulus_p2p.market.rpc import call_rpc, serve_rpc
from cumulus_p2p.node.blobshare import (
    BLOB_PROTOCOL,
    FETCH_PROTOCOL,
    BlobSharing,
    answer_bytes,
    blob_key,
    call_fetch,
    serve_fetches,
)
from cumulus_p2p.reputation import BadBlob, EvidenceKind
from cumulus_p2p.reputation.served import BlobServed, seal_served
from cumulus_p2p.testing.mesh import open_mesh

# Starts a mesh of libp2p nodes.
pytestmark = pytest.mark.slow

PIECE_A = bytes(range(256)) * 4096  # 1 MiB
PIECE_B = b"another piece" * 1000


def sharing_on(mesh, tmp_path, index: int, reported: list | None = None) -> BlobSharing:
    """Node ``index`` shares blobs; the statements it would report land in ``reported``."""
    node = mesh.nodes[index]
    store = BlobStore(tmp_path / f"store{index}", 64 * 2**20)

    async def report(statement) -> None:
        assert reported is not None, "nothing was to be reported"
        reported.append(statement)

    sharing = BlobSharing(node, store, report=report)
    sharing.serve()
    return sharing


async def announce(sharing: BlobSharing, data: bytes) -> str:
    name = digest(memoryview(data))
    assert sharing.store.put(name, memoryview(data), public=True)
    await sharing._dht.provide(blob_key(name))
    return name


GARBAGE = b"not what was asked for" * 100


def serve_garbage(node, *, signed_as: str | None = None) -> None:
    """``node`` answers every request for a blob with other bytes: unsigned (None), with
    a statement that they are the piece asked for (``"asked"``), or that they are the
    bytes it sent (``"sent"``)."""

    async def garbage(request: bytes, requester: str) -> bytes:
        if signed_as is None:
            return GARBAGE
        name = bytes.fromhex(request.decode())
        sent = name if signed_as == "asked" else bytes.fromhex(digest(memoryview(GARBAGE)))
        statement = seal_served(
            node.identity, BlobServed(name, sent, requester, 1.0e9), nonce=node.next_nonce()
        )
        return answer_bytes(statement, GARBAGE)

    serve_rpc(node.host, BLOB_PROTOCOL, garbage)


async def test_a_host_fetches_a_public_blob_that_another_announces(tmp_path):
    async with open_mesh(3) as mesh:
        holder, fetcher = sharing_on(mesh, tmp_path, 0), sharing_on(mesh, tmp_path, 2)
        name = await announce(holder, PIECE_A)
        fetched = await fetcher.fetch([name])
        assert (fetched.fetched, fetched.fetched_bytes) == (1, len(PIECE_A))
        assert name in fetcher.store


async def test_a_provider_sending_unsigned_garbage_is_dropped_and_never_asked_again(tmp_path):
    async with open_mesh(3) as mesh:
        honest, fetcher = sharing_on(mesh, tmp_path, 0), sharing_on(mesh, tmp_path, 2)
        liar = mesh.nodes[1]
        serve_garbage(liar)
        garbage_only = digest(memoryview(PIECE_B))
        await liar.dht.provide(blob_key(garbage_only))
        alone = await fetcher.fetch([garbage_only])
        assert alone.fetched == 0 and garbage_only not in fetcher.store  # never kept
        assert any("not a signed piece" in why for why in alone.dropped)

        name = await announce(honest, PIECE_A)
        await liar.dht.provide(blob_key(name))
        fetched = await fetcher.fetch([name])
        assert fetched.fetched == 1 and name in fetcher.store
        assert fetched.dropped == []  # the liar was not asked


async def test_a_provider_that_signs_for_the_piece_and_sends_other_bytes_is_dropped(tmp_path):
    async with open_mesh(3) as mesh:
        fetcher = sharing_on(mesh, tmp_path, 2, reported=[])
        liar = mesh.nodes[1]
        serve_garbage(liar, signed_as="asked")
        name = digest(memoryview(PIECE_B))
        await liar.dht.provide(blob_key(name))
        fetched = await fetcher.fetch([name])
        assert fetched.fetched == 0 and name not in fetcher.store
        assert any("sent bytes that are not" in why for why in fetched.dropped)
        assert liar.peer_id in fetcher.distrusted


async def test_a_provider_that_signs_it_sent_other_bytes_is_reported_with_its_statement(
    tmp_path,
):
    async with open_mesh(3) as mesh:
        reported: list = []
        fetcher = sharing_on(mesh, tmp_path, 2, reported=reported)
        liar = mesh.nodes[1]
        serve_garbage(liar, signed_as="sent")
        name = digest(memoryview(PIECE_B))
        await liar.dht.provide(blob_key(name))
        fetched = await fetcher.fetch([name])
        assert fetched.fetched == 0 and liar.peer_id in fetcher.distrusted
        (statement,) = reported
        finding = BadBlob(statement).check(mesh.nodes[2].peer_id.to_base58())
        assert (finding.kind, finding.host) == (EvidenceKind.BADBLOB, liar.peer_id.to_base58())


async def test_a_blob_that_is_not_public_is_served_to_nobody(tmp_path):
    async with open_mesh(3) as mesh:
        holder, fetcher = sharing_on(mesh, tmp_path, 0), sharing_on(mesh, tmp_path, 2)
        name = digest(memoryview(PIECE_B))
        assert holder.store.put(name, memoryview(PIECE_B))  # a standby's piece: not public
        await holder._dht.provide(blob_key(name))  # even if someone announced it
        answer = await call_rpc(
            mesh.nodes[2].host, mesh.nodes[0].host.get_id(), BLOB_PROTOCOL, name.encode()
        )
        assert answer == b""
        assert (await fetcher.fetch([name])).fetched == 0


@pytest.mark.parametrize(
    ("request_", "why"),
    [
        (msgpack.packb(["lease", ["not a digest"]]), "malformed fetch request"),
        (b"\xc1garbage", "malformed fetch request"),
        (msgpack.packb(["someone else's lease", [digest(memoryview(PIECE_A))]]), "no lease"),
    ],
    ids=["bad-digest", "not-msgpack", "not-its-lease"],
)
async def test_a_fetch_request_that_is_malformed_or_not_the_askers_is_refused(
    tmp_path, request_, why
):
    async with open_mesh(2) as mesh:
        sharing = sharing_on(mesh, tmp_path, 0)
        asker = mesh.nodes[1].host.get_id().to_base58()
        leases = {asker: "mine"}

        def may_ask(requester: str, lease_id: str) -> str | None:
            return None if leases.get(requester) == lease_id else "no lease of yours here"

        serve_fetches(mesh.nodes[0].host, sharing, may_ask)
        answer = await call_rpc(
            mesh.nodes[1].host, mesh.nodes[0].host.get_id(), FETCH_PROTOCOL, request_
        )
        assert why in msgpack.unpackb(answer, raw=False)["error"]
        with trio.fail_after(30):  # its own lease is served
            fetched = await call_fetch(mesh.nodes[1].host, mesh.nodes[0].host.get_id(), "mine", [])
        assert fetched["pieces"] == 0
