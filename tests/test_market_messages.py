"""Specs for cumulus_p2p.market.messages: typed messages and their canonical encoding."""

import dataclasses

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cumulus_p2p._errors import (
    InvalidCountersignatureError,
    InvalidMessageError,
    MalformedMessageError,
)
from cumulus_p2p.envelope import seal
from cumulus_p2p.identity import NodeIdentity
from cumulus_p2p.market.messages import (
    Bid,
    Cancel,
    Lease,
    LeaseKind,
    LeaseProposal,
    Offer,
    PriorityClass,
    Receipt,
    Side,
    decode_message,
    encode_message,
    open_message,
    seal_message,
)

NOW = 1_700_000_000.0
HOST, CONSUMER = NodeIdentity.generate(), NodeIdentity.generate()
H, C = HOST.peer_id.to_base58(), CONSUMER.peer_id.to_base58()

OFFER = Offer(H, "gpu0", "RTX 4090", 24576, 100, 4, 1000, 60, "eu", NOW, NOW + 60, 1, 20, 500)
BID = Bid(
    C,
    "b1",
    16000,
    ("RTX 4090", "A100"),
    0,
    1,
    2000,
    PriorityClass.INTERRUPTIBLE,
    600,
    NOW,
    NOW + 60,
    2,
)
CANCEL = Cancel(H, Side.OFFER, "gpu0", NOW + 60, 3)
PROPOSAL = LeaseProposal(
    "L1", C, H, "gpu0", 1, 1, 1000, NOW, 600, PriorityClass.ON_DEMAND, NOW + 30, 4
)
STANDBY = LeaseProposal(
    "L2", C, H, "gpu0", 1, 0, 20, NOW, 600, PriorityClass.ON_DEMAND, NOW + 30, 6,
    LeaseKind.STANDBY, 64,
)  # fmt: skip
RECEIPT = Receipt("L1", H, 0, NOW, NOW + 60, 60, 123, NOW + 600, 5)
GANG_BID = dataclasses.replace(BID, bid_id="b4", gpus=4)
ALL = [OFFER, BID, GANG_BID, CANCEL, PROPOSAL, STANDBY, RECEIPT]


@pytest.mark.parametrize("message", ALL, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_through_its_canonical_encoding(message):
    assert decode_message(message.KIND, encode_message(message)) == message


@pytest.mark.parametrize("message", ALL, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_through_a_signed_envelope(message):
    signer = HOST if message in (OFFER, CANCEL, RECEIPT) else CONSUMER
    envelope = seal_message(signer, message, now=NOW)
    assert envelope.has_valid_signature()
    assert open_message(envelope) == message


@pytest.mark.parametrize(
    ("message", "changes"),
    [
        (OFFER, {"vram_mib": 0}),
        (OFFER, {"shares_free": 0}),
        (OFFER, {"price": -1}),
        (OFFER, {"price": 1.5}),
        (OFFER, {"host": ""}),
        (OFFER, {"offer_id": "x" * 65}),
        (OFFER, {"expires_at": NOW - 1}),
        (OFFER, {"created_at": float("inf")}),
        (OFFER, {"storage_price": -1}),
        (OFFER, {"storage_price": 2**48 + 1}),
        (OFFER, {"storage_price": 1.0}),
        (OFFER, {"storage_gib": -1}),
        (OFFER, {"storage_gib": True}),
        (OFFER, {"storage_gib": 2**20 + 1}),
        (OFFER, {"contend_price": -1}),
        (OFFER, {"contend_price": OFFER.price + 1}),  # a floor above the ask
        (OFFER, {"contend_price": 0.5}),
        (OFFER, {"contend_shares": 2}),  # contending shares with no contend price
        (OFFER, {"contend_shares": -1}),
        (OFFER, {"shares_free": 0}),  # nothing on sale
        (OFFER, {"overcommit_pct": 99}),  # sells less memory than it has: not an overcommit
        (OFFER, {"overcommit_pct": 201}),
        (OFFER, {"overcommit_pct": 1.5}),
        (BID, {"max_overcommit_pct": 0}),
        (BID, {"max_overcommit_pct": 300}),
        (BID, {"gpus": 0}),
        (BID, {"gpus": 65}),
        (BID, {"gpus": True}),
        (BID, {"priority": 7}),
        (BID, {"gpu_models": ("",)}),
        (BID, {"shares": True}),
        (BID, {"duration_s": 0}),
        (CANCEL, {"side": 2}),
        (PROPOSAL, {"shares": 0}),
        (PROPOSAL, {"kind": 2}),
        (PROPOSAL, {"kind": "standby"}),
        (PROPOSAL, {"storage_gib": 1}),
        (PROPOSAL, {"kind": LeaseKind.STANDBY}),
        (STANDBY, {"shares": 1}),
        (STANDBY, {"storage_gib": 0}),
        (STANDBY, {"storage_gib": -1}),
        (STANDBY, {"storage_gib": 2**20 + 1}),
        (RECEIPT, {"interval_end": NOW - 1}),
        (RECEIPT, {"share_seconds": -1}),
    ],
)
def test_an_invalid_message_cannot_be_built(message, changes):
    with pytest.raises(InvalidMessageError):
        dataclasses.replace(message, **changes)


def test_an_offer_may_sell_only_contending_shares_once_its_others_are_leased():
    offer = Offer(
        H,
        "gpu0",
        "RTX 4090",
        24576,
        100,
        0,
        1000,
        60,
        "eu",
        NOW,
        NOW + 60,
        1,
        contend_price=400,
        contend_shares=4,
    )
    assert decode_message(Offer.KIND, encode_message(offer)) == offer


def test_an_offer_without_storage_terms_keeps_no_standbys():
    offer = Offer(H, "gpu0", "RTX 4090", 24576, 100, 4, 1000, 60, "eu", NOW, NOW + 60, 1)
    assert (offer.storage_price, offer.storage_gib) == (0, 0)
    assert decode_message(Offer.KIND, encode_message(offer)) == offer


def test_a_lease_is_metered_in_shares_or_in_gib():
    assert PROPOSAL.kind is LeaseKind.COMPUTE and PROPOSAL.units == PROPOSAL.shares == 1
    assert STANDBY.units == STANDBY.storage_gib == 64
    # 64 GiB for an hour at 20 per GiB-hour.
    assert STANDBY.owed(64 * 3600) == 64 * 20
    assert PROPOSAL.owed(1800) == 500


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"kind": LeaseKind.STANDBY, "shares": 0}, "storage_gib must be at least 1"),
        ({"kind": LeaseKind.STANDBY, "storage_gib": 8}, "shares must be 0 for a standby"),
        ({"storage_gib": 8}, "storage_gib must be 0 for a compute lease"),
    ],
)
def test_an_inconsistent_lease_kind_is_refused_with_its_reason(changes, says):
    with pytest.raises(InvalidMessageError, match=says):
        dataclasses.replace(PROPOSAL, **changes)


def test_a_forged_standby_proposal_is_malformed_on_the_wire():
    # A standby that also claims GPU shares, encoded by hand as a peer would.
    body = encode_message(STANDBY)
    values = msgpack.unpackb(body)
    values[5] = 4
    with pytest.raises(MalformedMessageError, match="shares must be 0"):
        decode_message(LeaseProposal.KIND, msgpack.packb(values, use_bin_type=True))


def test_a_bid_for_one_gpu_is_the_array_nodes_read_before_bids_named_gpus():
    older = len(dataclasses.fields(Bid)) - 1
    assert len(msgpack.unpackb(encode_message(BID))) == older
    assert len(msgpack.unpackb(encode_message(GANG_BID))) == older + 1


def test_a_receipt_without_collectives_is_the_array_nodes_read_before_peer_bytes():
    receipt = Receipt(H, H, 0, NOW, NOW + 60, 60, 1000, NOW + 600, 1)
    older = len(dataclasses.fields(Receipt)) - 1
    assert len(msgpack.unpackb(encode_message(receipt))) == older
    between = dataclasses.replace(receipt, peer_bytes=4096)
    assert len(msgpack.unpackb(encode_message(between))) == older + 1
    assert decode_message(Receipt.KIND, encode_message(between)) == between


def test_a_receipt_claiming_negative_bytes_between_hosts_is_malformed():
    body = msgpack.unpackb(encode_message(Receipt(H, H, 0, NOW, NOW + 60, 60, 0, NOW + 600, 1)))
    with pytest.raises(MalformedMessageError, match="peer_bytes"):
        decode_message(Receipt.KIND, msgpack.packb([*body, -1]))


def test_a_bid_naming_one_gpu_outright_is_not_the_canonical_encoding():
    body = msgpack.packb([*msgpack.unpackb(encode_message(BID)), 1])
    with pytest.raises(MalformedMessageError, match="canonical"):
        decode_message(Bid.KIND, body)


def test_equal_requirements_encode_equally():
    shuffled = dataclasses.replace(BID, gpu_models=["A100", "RTX 4090", "A100"])
    assert encode_message(shuffled) == encode_message(BID)


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\xc1",
        msgpack.packb([1, 2]),
        msgpack.packb([H, "gpu0", "RTX 4090", 24576, 100, 4, 1000, 60, "eu", NOW, NOW + 60, 1]),
        msgpack.packb(
            [H, "gpu0", "RTX 4090", 24576, 100, 4, 1000, 60, "eu", NOW, NOW + 60, -1, 0, 0]
        ),
        msgpack.packb([H, "gpu0", "RTX 4090", 24576, 100, 4, 1000, 60, "eu", 1, NOW + 60, 1, 0, 0]),
        msgpack.packb(
            [H, "gpu0", "RTX 4090", 24576, 100, 4, 1000, 60, "eu", NOW, NOW + 60, 1, -5, 0]
        ),
        msgpack.packb(
            [H, "gpu0", "RTX 4090", 24576, 100, 4, 1000, 60, "eu", NOW, NOW + 60, 1, 0, 2.0]
        ),
        msgpack.packb(
            [H, "gpu0", "RTX 4090", 24576, 100, 4, 1000, 60, "eu", NOW, NOW + 60, 1, 0, "9"]
        ),
    ],
    # The host key in the bodies is fresh per process: stable ids let pytest-xdist's
    # workers agree on what they collected.
    ids=[
        "empty",
        "reserved-byte",
        "short-array",
        "without-storage-terms",
        "negative-nonce",
        "created-in-1970",
        "negative-storage-price",
        "float-storage-gib",
        "text-storage-gib",
    ],
)
def test_malformed_peer_bodies_raise_a_remote_error(body):
    with pytest.raises(MalformedMessageError):
        decode_message(Offer.KIND, body)


@given(st.binary(max_size=200), st.sampled_from([Offer.KIND, Bid.KIND, Receipt.KIND]))
def test_arbitrary_bodies_never_raise_anything_but_malformed(body, kind):
    try:
        decode_message(kind, body)
    except MalformedMessageError:
        pass


def test_signing_someone_elses_message_is_refused_locally():
    with pytest.raises(InvalidMessageError):
        seal_message(CONSUMER, OFFER, now=NOW)


def test_an_envelope_whose_body_names_another_author_is_malformed():
    envelope = seal(CONSUMER, Offer.KIND, encode_message(OFFER), now=NOW, ttl=60.0, nonce=1)
    with pytest.raises(MalformedMessageError, match="signed by"):
        open_message(envelope)


def test_an_envelope_whose_expiry_differs_from_its_body_is_malformed():
    envelope = seal(HOST, Offer.KIND, encode_message(OFFER), now=NOW, ttl=3600.0, nonce=1)
    with pytest.raises(MalformedMessageError, match="expiry"):
        open_message(envelope)


def test_a_lease_verifies_only_with_the_hosts_key():
    lease = Lease.countersign(HOST, seal_message(CONSUMER, PROPOSAL, now=NOW))
    assert Lease.from_bytes(lease.to_bytes()).verify(HOST.public_key) == PROPOSAL
    with pytest.raises(InvalidCountersignatureError):
        lease.verify(CONSUMER.public_key)
    forged = Lease.countersign(CONSUMER, lease.envelope)
    with pytest.raises(InvalidCountersignatureError):
        forged.verify(HOST.public_key)


def test_a_truncated_lease_is_malformed():
    lease = Lease.countersign(HOST, seal_message(CONSUMER, PROPOSAL, now=NOW))
    with pytest.raises(MalformedMessageError):
        Lease.from_bytes(lease.to_bytes()[:-1])
