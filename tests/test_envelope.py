"""Specs for cumulus_p2p.envelope: signed envelopes and the single validator."""

import dataclasses

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cumulus_p2p._errors import EnvelopeRejectedError, InvalidMessageError
from cumulus_p2p.envelope import (
    Envelope,
    EnvelopeValidator,
    Rejected,
    Rejection,
    seal,
)
from cumulus_p2p.identity import NodeIdentity

ALICE = NodeIdentity.generate()
MALLORY = NodeIdentity.generate()
KIND = "test/note"
NOW = 1_700_000_000.0


def make(nonce=1, *, body=b"body", now=NOW, ttl=60.0, kind=KIND, identity=ALICE):
    return seal(identity, kind, body, now=now, ttl=ttl, nonce=nonce)


def reason(result):
    assert isinstance(result, Rejected), result
    return result.reason


def test_seal_then_decode_round_trips_and_verifies():
    envelope = make()
    decoded = Envelope.from_bytes(envelope.to_bytes())
    assert decoded == envelope
    assert decoded.has_valid_signature()
    assert decoded.expires_at == NOW + 60.0
    assert decoded.author_peer_id == ALICE.peer_id


def test_validator_accepts_a_fresh_envelope():
    validator = EnvelopeValidator([KIND])
    assert validator.validate(make().to_bytes(), now=NOW) == make()


@pytest.mark.parametrize("name", ["kind", "body", "expires_at", "nonce", "author"])
def test_changing_any_signed_field_breaks_the_signature(name):
    envelope = make()
    changed = {
        "kind": "test/other",
        "body": b"bodY",
        "expires_at": NOW + 61.0,
        "nonce": 2,
        "author": MALLORY.public_key,
    }[name]
    forged = dataclasses.replace(envelope, **{name: changed})
    validator = EnvelopeValidator([KIND, "test/other"])
    assert reason(validator.validate(forged.to_bytes(), now=NOW)) is Rejection.BAD_SIGNATURE


def test_unsigned_envelope_is_refused():
    unsigned = dataclasses.replace(make(), signature=b"\x00" * 64)
    assert reason(EnvelopeValidator([KIND]).validate(unsigned.to_bytes(), now=NOW)) is (
        Rejection.BAD_SIGNATURE
    )


def test_expired_envelope_is_refused():
    validator = EnvelopeValidator([KIND])
    assert reason(validator.validate(make(ttl=5).to_bytes(), now=NOW + 5)) is Rejection.EXPIRED


def test_envelope_expiring_too_far_ahead_is_refused():
    validator = EnvelopeValidator([KIND], max_ttl=100.0)
    result = validator.validate(make(ttl=101).to_bytes(), now=NOW)
    assert reason(result) is Rejection.TOO_FAR_IN_FUTURE


def test_second_delivery_is_refused_as_replayed():
    validator = EnvelopeValidator([KIND])
    raw = make().to_bytes()
    assert isinstance(validator.validate(raw, now=NOW), Envelope)
    assert reason(validator.validate(raw, now=NOW + 1)) is Rejection.REPLAYED


def test_remember_false_checks_without_recording():
    validator = EnvelopeValidator([KIND])
    raw = make().to_bytes()
    assert isinstance(validator.validate(raw, now=NOW, remember=False), Envelope)
    assert isinstance(validator.validate(raw, now=NOW, remember=False), Envelope)
    assert validator.statistics().tracked_nonces == 0


def test_nonce_far_below_the_high_water_mark_is_refused_as_stale():
    validator = EnvelopeValidator([KIND], nonce_window=10)
    assert isinstance(validator.validate(make(100).to_bytes(), now=NOW), Envelope)
    assert isinstance(validator.validate(make(91).to_bytes(), now=NOW), Envelope)
    assert reason(validator.validate(make(90).to_bytes(), now=NOW)) is Rejection.STALE_NONCE


def test_out_of_order_nonces_within_the_window_are_accepted_once():
    validator = EnvelopeValidator([KIND])
    for nonce in [5, 3, 4, 1]:
        assert isinstance(validator.validate(make(nonce).to_bytes(), now=NOW), Envelope)
    assert reason(validator.validate(make(3).to_bytes(), now=NOW)) is Rejection.REPLAYED


def test_memory_per_author_is_bounded_by_the_window():
    validator = EnvelopeValidator([KIND], nonce_window=8)
    for nonce in range(100):
        validator.validate(make(nonce).to_bytes(), now=NOW)
    assert validator.statistics().tracked_nonces == 8


def test_expire_forgets_expired_nonces_and_replays_stay_refused():
    validator = EnvelopeValidator([KIND], nonce_window=2)
    raws = [make(n, ttl=10 + n).to_bytes() for n in range(5)]
    for raw in raws:
        validator.validate(raw, now=NOW)
    assert validator.expire(NOW + 100) == 2
    assert validator.statistics().tracked_nonces == 0
    assert validator.statistics().tracked_authors == 0
    assert all(reason(validator.validate(raw, now=NOW + 100)) is Rejection.EXPIRED for raw in raws)


def test_author_record_outlives_forgotten_unexpired_nonces():
    validator = EnvelopeValidator([KIND], nonce_window=1)
    long_lived = make(1, ttl=1000).to_bytes()
    validator.validate(long_lived, now=NOW)
    validator.validate(make(2, ttl=10).to_bytes(), now=NOW)  # pushes nonce 1 out of the window
    validator.expire(NOW + 20)
    assert reason(validator.validate(long_lived, now=NOW + 20)) is Rejection.STALE_NONCE


def test_full_replay_cache_refuses_rather_than_forgets():
    validator = EnvelopeValidator([KIND], max_tracked_nonces=2)
    validator.validate(make(1).to_bytes(), now=NOW)
    validator.validate(make(2).to_bytes(), now=NOW)
    result = validator.validate(make(3).to_bytes(), now=NOW)
    assert reason(result) is Rejection.REPLAY_CACHE_FULL
    assert not result.reason.is_peer_fault
    assert reason(validator.validate(make(1).to_bytes(), now=NOW)) is Rejection.REPLAYED


def test_forgery_does_not_consume_the_authors_nonce():
    validator = EnvelopeValidator([KIND])
    forged = dataclasses.replace(make(7), body=b"evil")
    assert reason(validator.validate(forged.to_bytes(), now=NOW)) is Rejection.BAD_SIGNATURE
    assert isinstance(validator.validate(make(7).to_bytes(), now=NOW), Envelope)


def test_unknown_kind_is_refused():
    validator = EnvelopeValidator(["test/other"])
    assert reason(validator.validate(make().to_bytes(), now=NOW)) is Rejection.UNKNOWN_KIND


def test_oversized_envelope_is_refused_before_decoding():
    validator = EnvelopeValidator([KIND], max_size=200)
    raw = make(body=b"x" * 200).to_bytes()
    assert reason(validator.validate(raw, now=NOW)) is Rejection.OVERSIZED


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\xc1",
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"kind": KIND}),
        msgpack.packb([KIND, b"a" * 32, b"", 1.0, 1, b"s" * 64, "extra"], use_bin_type=True),
        msgpack.packb([KIND, b"a" * 32, b"", 1, 1, b"s" * 64], use_bin_type=True),
        msgpack.packb([KIND, b"a" * 32, b"", 1.0, -1, b"s" * 64], use_bin_type=True),
        msgpack.packb([KIND, "a" * 32, b"", 1.0, 1, b"s" * 64], use_bin_type=True),
    ],
)
def test_malformed_bytes_are_refused(raw):
    assert reason(EnvelopeValidator([KIND]).validate(raw, now=NOW)) is Rejection.MALFORMED


def test_non_canonical_encoding_is_refused():
    envelope = make()
    fields = [envelope.kind, envelope.author, envelope.body, envelope.expires_at]
    # The same values, but the expiry encoded as a float32.
    raw = msgpack.packb(fields + [envelope.nonce, envelope.signature], use_single_float=True)
    with pytest.raises(EnvelopeRejectedError) as info:
        Envelope.from_bytes(raw)
    assert info.value.reason is Rejection.MALFORMED
    with pytest.raises(EnvelopeRejectedError):
        Envelope.from_bytes(envelope.to_bytes() + b"\x00")


def test_check_raises_a_remote_protocol_error_with_the_reason():
    with pytest.raises(EnvelopeRejectedError) as info:
        EnvelopeValidator([KIND]).check(make(ttl=1).to_bytes(), now=NOW + 2)
    assert info.value.reason is Rejection.EXPIRED


@pytest.mark.parametrize(
    "changes",
    [
        {"kind": ""},
        {"kind": "k" * 65},
        {"author": b"short"},
        {"body": "text"},
        {"expires_at": float("nan")},
        {"expires_at": 5},
        {"nonce": 2**64},
        {"nonce": True},
        {"signature": b"short"},
    ],
)
def test_an_invalid_envelope_cannot_be_built(changes):
    with pytest.raises(InvalidMessageError):
        dataclasses.replace(make(), **changes)


def test_seal_refuses_non_positive_ttl():
    with pytest.raises(InvalidMessageError):
        make(ttl=0)


@given(st.binary(max_size=300))
def test_arbitrary_bytes_never_escape_the_validator(raw):
    result = EnvelopeValidator([KIND]).validate(raw, now=NOW)
    assert isinstance(result, Rejected)
