"""Specs for cumulus_p2p.market.intake: only valid, signed, fresh orders reach the book."""

import dataclasses

import pytest

from cumulus_p2p.envelope import Envelope, Rejected, Rejection, seal
from cumulus_p2p.identity import NodeIdentity
from cumulus_p2p.market.book import InsertStatus, OrderBook
from cumulus_p2p.market.intake import Admitted, MarketIntake
from cumulus_p2p.market.messages import (
    Bid,
    Offer,
    PriorityClass,
    Receipt,
    encode_message,
    seal_message,
)

NOW = 1_700_000_000.0
HOST, CONSUMER, MALLORY = (NodeIdentity.generate() for _ in range(3))
OFFER = Offer(
    HOST.peer_id.to_base58(), "gpu0", "RTX 4090", 24576, 100, 4, 1000, 60, "eu", NOW, NOW + 60, 1
)
BID = Bid(
    CONSUMER.peer_id.to_base58(),
    "b1",
    0,
    (),
    0,
    1,
    2000,
    PriorityClass.ON_DEMAND,
    600,
    NOW,
    NOW + 60,
    1,
)


def offer_raw():
    return seal_message(HOST, OFFER, now=NOW).to_bytes()


def bid_raw():
    return seal_message(CONSUMER, BID, now=NOW).to_bytes()


def wrongly_signed(raw):
    envelope = Envelope.from_bytes(raw)
    forged = dataclasses.replace(envelope, signature=MALLORY.sign(envelope.signing_bytes()))
    return forged.to_bytes()


def unsigned(raw):
    return dataclasses.replace(Envelope.from_bytes(raw), signature=bytes(64)).to_bytes()


def test_a_valid_offer_and_bid_are_admitted_to_the_book():
    intake = MarketIntake(OrderBook())
    for raw in (offer_raw(), bid_raw()):
        result = intake.receive(raw, now=NOW)
        assert isinstance(result, Admitted) and result.status is InsertStatus.ADDED
    assert intake.book.statistics().offers == 1 and intake.book.statistics().bids == 1


@pytest.mark.parametrize("make_raw", [offer_raw, bid_raw], ids=["offer", "bid"])
@pytest.mark.parametrize(
    ("corrupt", "now", "reason"),
    [
        (lambda raw: raw[:-5], NOW, Rejection.MALFORMED),
        (lambda raw: b"\x00" + raw, NOW, Rejection.MALFORMED),
        (unsigned, NOW, Rejection.BAD_SIGNATURE),
        (wrongly_signed, NOW, Rejection.BAD_SIGNATURE),
        (lambda raw: raw, NOW + 60, Rejection.EXPIRED),
    ],
    ids=["truncated", "garbage", "unsigned", "wrongly-signed", "expired"],
)
def test_bad_orders_are_rejected_with_a_reason_and_the_book_is_unchanged(
    make_raw, corrupt, now, reason
):
    intake = MarketIntake(OrderBook())
    result = intake.receive(corrupt(make_raw()), now=now)
    assert isinstance(result, Rejected) and result.reason is reason
    assert intake.book.snapshot() == ()


@pytest.mark.parametrize("make_raw", [offer_raw, bid_raw], ids=["offer", "bid"])
def test_a_replayed_order_is_rejected_and_the_book_is_unchanged(make_raw):
    intake = MarketIntake(OrderBook())
    assert isinstance(intake.receive(make_raw(), now=NOW), Admitted)
    intake.book.match(now=NOW)
    before = intake.book.snapshot()
    result = intake.receive(make_raw(), now=NOW + 1)
    assert isinstance(result, Rejected) and result.reason is Rejection.REPLAYED
    assert intake.book.snapshot() == before


def test_an_order_signed_by_someone_other_than_its_author_is_malformed():
    raw = seal(MALLORY, Offer.KIND, encode_message(OFFER), now=NOW, ttl=60.0, nonce=1).to_bytes()
    intake = MarketIntake(OrderBook())
    result = intake.receive(raw, now=NOW)
    assert isinstance(result, Rejected) and result.reason is Rejection.MALFORMED
    assert intake.book.snapshot() == ()


def test_a_non_order_kind_is_rejected():
    receipt = Receipt("L1", HOST.peer_id.to_base58(), 0, NOW, NOW + 1, 1, 0, NOW + 60, 1)
    result = MarketIntake(OrderBook()).receive(
        seal_message(HOST, receipt, now=NOW).to_bytes(), now=NOW
    )
    assert isinstance(result, Rejected) and result.reason is Rejection.UNKNOWN_KIND
