"""A host that overcharges is refused, and both ledgers keep the dispute (issue 16).

Real py-libp2p hosts on loopback: the host asks over ``/cumulus/receipt/1.0.0`` with
``settle_receipt`` (what the provider node runs), the consumer answers from a
``ReceiptDesk`` (what the consumer node runs).
"""

import time

import pytest

from cumulus_p2p._errors import ReceiptRejectedError
from cumulus_p2p.identity import NodeIdentity
from cumulus_p2p.market.ledger import Ledger
from cumulus_p2p.market.messages import LeaseProposal, Receipt, seal_message
from cumulus_p2p.market.metering import Meter
from cumulus_p2p.market.settlement import ReceiptDesk, serve_receipts, settle_receipt
from cumulus_p2p.testing.hosts import connect, noise_hosts
from cumulus_p2p.testing.market import lease_proposal


def lease(consumer: NodeIdentity, host: NodeIdentity, start: float) -> LeaseProposal:
    return lease_proposal(consumer, host, start_at=start, duration_s=600)


def overcharge(host: NodeIdentity, terms: LeaseProposal, **claims) -> Receipt:
    now = time.time()
    fair = dict(share_seconds=int(now - terms.start_at), bytes_moved=0)
    receipt = Receipt(
        "L1", terms.host, 0, terms.start_at, now, *(fair | claims).values(), now + 600, 5
    )
    return seal_message(host, receipt, now=now)


@pytest.mark.parametrize(
    "claims, why",
    [({"share_seconds": 10_000}, "share-seconds"), ({"bytes_moved": 2**30}, "counted 4096")],
    ids=["share-seconds", "bytes"],
)
async def test_an_inflated_receipt_is_refused_and_both_ledgers_hold_the_dispute(
    tmp_path, claims, why
):
    host_id, consumer_id = NodeIdentity.generate(), NodeIdentity.generate()
    terms = lease(consumer_id, host_id, time.time() - 20)
    with (
        Ledger.open(tmp_path / "host") as host_books,
        Ledger.open(tmp_path / "consumer") as consumer_books,
    ):
        desk = ReceiptDesk(consumer_id, consumer_books)
        desk.open_account(terms, counts_bytes=True)
        desk.count_bytes("L1", 4096)
        async with noise_hosts([host_id, consumer_id]) as (host, consumer):
            serve_receipts(consumer, desk, clock=time.time)
            await connect(host, consumer)
            with pytest.raises(ReceiptRejectedError, match=why):
                await settle_receipt(
                    host,
                    consumer.get_id(),
                    overcharge(host_id, terms, **claims),
                    host_books,
                    now=time.time(),
                )
        for books in (host_books, consumer_books):
            (dispute,) = books.disputes()
            assert dispute.receipt_id == "L1/0" and why in dispute.reason
            assert len(books) == 0


async def test_a_fair_receipt_is_settled_into_both_ledgers(tmp_path):
    host_id, consumer_id = NodeIdentity.generate(), NodeIdentity.generate()
    terms = lease(consumer_id, host_id, time.time() - 20)
    receipt = Meter(host_id, terms, interval=10).issue(time.time(), nonce=3)
    with (
        Ledger.open(tmp_path / "host") as host_books,
        Ledger.open(tmp_path / "consumer") as consumer_books,
    ):
        desk = ReceiptDesk(consumer_id, consumer_books)
        desk.open_account(terms, counts_bytes=True)
        async with noise_hosts([host_id, consumer_id]) as (host, consumer):
            serve_receipts(consumer, desk, clock=time.time)
            await connect(host, consumer)
            await settle_receipt(host, consumer.get_id(), receipt, host_books, now=time.time())
        assert [e.receipt_id for e in host_books.entries()] == ["L1/0"]
        assert [e.receipt_id for e in consumer_books.entries()] == ["L1/0"]


async def test_the_consumer_hears_which_host_sent_a_refused_receipt(tmp_path):
    host_id, consumer_id = NodeIdentity.generate(), NodeIdentity.generate()
    terms = lease(consumer_id, host_id, time.time() - 20)
    refused: list[tuple[str, str]] = []
    with (
        Ledger.open(tmp_path / "host") as host_books,
        Ledger.open(tmp_path / "consumer") as consumer_books,
    ):
        desk = ReceiptDesk(consumer_id, consumer_books)
        desk.open_account(terms)
        async with noise_hosts([host_id, consumer_id]) as (host, consumer):
            serve_receipts(
                consumer,
                desk,
                clock=time.time,
                on_refused=lambda who, why: refused.append((who, why)),
            )
            await connect(host, consumer)
            with pytest.raises(ReceiptRejectedError):
                await settle_receipt(
                    host,
                    consumer.get_id(),
                    overcharge(host_id, terms, share_seconds=10_000),
                    host_books,
                    now=time.time(),
                )
    assert [who for who, _ in refused] == [host_id.peer_id.to_base58()]
    assert "share-seconds" in refused[0][1]
