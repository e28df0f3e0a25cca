"""Specs for cumulus_p2p.market.negotiation: the lease protocol over real libp2p streams."""

import secrets
from contextlib import asynccontextmanager

import msgpack
import pytest
import trio
from libp2p.exceptions import BaseLibp2pError

from cumulus_p2p._errors import LeaseRefusedError, MalformedMessageError
from cumulus_p2p.identity import NodeIdentity
from cumulus_p2p.market.lease import LeaseBook, RefusalReason
from cumulus_p2p.market.messages import LeaseProposal, Offer, PriorityClass, seal_message
from cumulus_p2p.market.negotiation import (
    LEASE_PROTOCOL,
    LeaseServer,
    call_propose_lease,
    serve_leases,
)
from cumulus_p2p.testing.hosts import connect, noise_hosts

NOW = 1_700_000_000.0


def make_offer(host_identity, shares):
    return Offer(
        host_identity.peer_id.to_base58(),
        "gpu0",
        "RTX 4090",
        24576,
        100,
        shares,
        1000,
        60,
        "eu",
        NOW,
        NOW + 600,
        1,
    )


def make_proposal(consumer, host_identity, *, shares=1, price=1000, nonce=1):
    proposal = LeaseProposal(
        secrets.token_hex(8),
        consumer.peer_id.to_base58(),
        host_identity.peer_id.to_base58(),
        "gpu0",
        1,
        shares,
        price,
        NOW,
        3600,
        PriorityClass.ON_DEMAND,
        NOW + 30,
        nonce,
    )
    return seal_message(consumer, proposal, now=NOW)


def offering_book(host_id, shares=2):
    """The host's lease book with one offer of ``shares`` published."""
    book = LeaseBook(host_id)
    book.publish(make_offer(host_id, shares=shares))
    return book


@asynccontextmanager
async def lease_server_and_consumer(**server_options):
    """A host serving leases from an ``offering_book`` and a consumer connected to it.

    Yields ``(host_id, consumer_id, book, host, consumer)``.
    """
    host_id, consumer_id = NodeIdentity.generate(), NodeIdentity.generate()
    book = offering_book(host_id)
    async with noise_hosts([host_id, consumer_id]) as (host, consumer):
        serve_leases(host, LeaseServer(book, clock=lambda: NOW, **server_options))
        await connect(consumer, host)
        yield host_id, consumer_id, book, host, consumer


async def test_a_proposal_over_libp2p_returns_a_verified_lease():
    async with lease_server_and_consumer() as (host_id, consumer_id, book, host, consumer):
        proposal = make_proposal(consumer_id, host_id)
        grant = await call_propose_lease(consumer, host.get_id(), proposal)
    assert grant.lease.envelope == proposal
    assert grant.lease.verify(host_id.public_key).shares == 1
    assert book.free_shares("gpu0") == 1


async def test_a_granted_lease_names_the_session_endpoints():
    endpoints = lambda: ["127.0.0.1:7001", "127.0.0.2:7001"]  # noqa: E731
    async with lease_server_and_consumer(endpoints=endpoints) as (
        host_id,
        consumer_id,
        _,
        host,
        consumer,
    ):
        grant = await call_propose_lease(
            consumer, host.get_id(), make_proposal(consumer_id, host_id)
        )
    assert grant.endpoints == ("127.0.0.1:7001", "127.0.0.2:7001")


async def test_concurrent_consumers_lease_exactly_the_free_shares_and_the_rest_are_refused():
    host_id = NodeIdentity.generate()
    consumer_ids = [NodeIdentity.generate() for _ in range(3)]
    book = offering_book(host_id, shares=5)
    granted, refused = [], []
    async with noise_hosts([host_id, *consumer_ids]) as (host, *consumers):
        serve_leases(host, LeaseServer(book, clock=lambda: NOW))

        async def propose(consumer, identity, nonce):
            try:
                granted.append(
                    await call_propose_lease(
                        consumer, host.get_id(), make_proposal(identity, host_id, nonce=nonce)
                    )
                )
            except LeaseRefusedError as exc:
                refused.append(exc.reason)

        for consumer in consumers:
            await connect(consumer, host)
        async with trio.open_nursery() as nursery:
            for consumer, identity in zip(consumers, consumer_ids, strict=True):
                for nonce in range(4):
                    nursery.start_soon(propose, consumer, identity, nonce)
    assert len(granted) == 5
    assert refused == [RefusalReason.NO_CAPACITY] * 7
    assert book.free_shares("gpu0") == 0
    assert len({grant.lease.proposal.lease_id for grant in granted}) == 5
    assert {r.proposal.lease_id for r in book.leases()} == {
        g.lease.proposal.lease_id for g in granted
    }


async def test_a_proposal_relayed_by_another_peer_is_refused_as_wrong_sender():
    alice_id = NodeIdentity.generate()
    async with lease_server_and_consumer() as (host_id, _, book, host, mallory):
        with pytest.raises(LeaseRefusedError) as info:
            await call_propose_lease(mallory, host.get_id(), make_proposal(alice_id, host_id))
    assert info.value.reason is RefusalReason.WRONG_SENDER
    assert book.free_shares("gpu0") == 2


async def test_refusals_over_the_wire_carry_the_reason_and_change_nothing():
    async with lease_server_and_consumer() as (host_id, consumer_id, book, host, consumer):
        cheap = make_proposal(consumer_id, host_id, price=999, nonce=1)
        with pytest.raises(LeaseRefusedError) as info:
            await call_propose_lease(consumer, host.get_id(), cheap)
        assert info.value.reason is RefusalReason.PRICE_MISMATCH
        with pytest.raises(LeaseRefusedError) as info:
            await call_propose_lease(consumer, host.get_id(), cheap)
        assert info.value.reason is RefusalReason.REPLAYED
    assert book.free_shares("gpu0") == 2
    assert book.leases() == []


async def test_a_garbage_or_oversized_frame_drops_only_that_stream():
    async with lease_server_and_consumer() as (host_id, consumer_id, book, host, consumer):
        for frame in [b"\xff\xff\xff\xff", b"\x00\x00\x00\x03abc", b"\x00\x00"]:
            stream = await consumer.new_stream(host.get_id(), [LEASE_PROTOCOL])
            await stream.write(frame)
            await stream.close_write()
            with trio.fail_after(5):
                try:
                    answer = await stream.read(4096)
                except BaseLibp2pError:  # reset by the server: the expected answer
                    answer = b""
            assert answer == b"" or b"MALFORMED" in answer
        grant = await call_propose_lease(
            consumer, host.get_id(), make_proposal(consumer_id, host_id)
        )
    assert grant.lease.verify(host_id.public_key).shares == 1


@pytest.mark.parametrize(
    "endpoints", [["no-port"], ["host:port"], [7], "127.0.0.1:1", ["h:1"] * 9, ["x" * 200 + ":1"]]
)
def test_a_grant_with_malformed_endpoints_is_refused(endpoints):
    from cumulus_p2p.market.negotiation import _decode_response

    host_id, consumer_id = NodeIdentity.generate(), NodeIdentity.generate()
    book = offering_book(host_id)
    lease = book.propose(make_proposal(consumer_id, host_id).to_bytes(), now=NOW)
    response = msgpack.packb([True, lease.to_bytes(), endpoints])
    with pytest.raises(MalformedMessageError, match="endpoint"):
        _decode_response(response)


async def test_a_screened_out_consumer_is_refused_with_the_hosts_reason_and_nothing_reserved():
    host_id, consumer_id = NodeIdentity.generate(), NodeIdentity.generate()
    book = offering_book(host_id)
    screened = consumer_id.peer_id.to_base58()
    server = LeaseServer(
        book,
        clock=lambda: NOW,
        screen=lambda peer: "unpaid leases on record" if peer == screened else None,
    )
    async with noise_hosts([host_id, consumer_id]) as (host, consumer):
        serve_leases(host, server)
        await connect(consumer, host)
        with pytest.raises(LeaseRefusedError) as refused:
            await call_propose_lease(consumer, host.get_id(), make_proposal(consumer_id, host_id))
    assert refused.value.reason is RefusalReason.CONSUMER_REFUSED
    assert refused.value.detail == "unpaid leases on record"
    assert book.free_shares("gpu0") == 2
