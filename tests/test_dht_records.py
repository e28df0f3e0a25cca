"""The mesh's sans-IO parts: offer sheets, record selection, the gossip gate, config."""

from __future__ import annotations

import pytest
from libp2p.pubsub.pb import rpc_pb2

from cumulus_p2p._errors import InvalidRecordError, MeshError
from cumulus_p2p.dht.gossip import GateDecision, TopicGate
from cumulus_p2p.dht.host import noise_only, yamux_only
from cumulus_p2p.dht.node import MeshConfig, mesh_validator
from cumulus_p2p.dht.records import (
    SHEET_KIND,
    LiveEnvelopes,
    check_sheet,
    decode_sheet_body,
    encode_sheet_body,
    offers_key,
    select_sheet,
)
from cumulus_p2p.envelope import Envelope, seal
from cumulus_p2p.identity import NodeIdentity

NOW = 1_000_000.0
OFFER = "market/offer"


@pytest.fixture
def host() -> NodeIdentity:
    return NodeIdentity.generate()


def offer(identity: NodeIdentity, nonce: int, *, now: float = NOW, ttl: float = 30.0) -> Envelope:
    return seal(identity, OFFER, b"offer-%d" % nonce, now=now, ttl=ttl, nonce=nonce)


def sheet(
    identity: NodeIdentity, offers: list[Envelope], nonce: int, *, now: float = NOW
) -> Envelope:
    body = encode_sheet_body(o.to_bytes() for o in offers)
    return seal(identity, SHEET_KIND, body, now=now, ttl=30.0, nonce=nonce)


def check(key: str, value: bytes, *, now: float = NOW) -> list[Envelope]:
    _sheet, offers = check_sheet(key, value, mesh_validator([OFFER]), now=now, max_offers=8)
    return offers


def test_offers_key_is_short_enough_for_py_libp2p_find_node(host: NodeIdentity) -> None:
    key = offers_key(host.peer_id)
    assert key.startswith("/cumulus/offers/")
    assert len(key.encode()) <= 50
    assert key == offers_key(host.peer_id)
    assert key != offers_key(NodeIdentity.generate().peer_id)


def test_valid_sheet_yields_its_offers(host: NodeIdentity) -> None:
    offers = [offer(host, 1), offer(host, 2)]
    value = sheet(host, offers, 3).to_bytes()
    assert check(offers_key(host.peer_id), value) == offers


def test_sheet_under_someone_elses_key_is_refused(host: NodeIdentity) -> None:
    other = NodeIdentity.generate()
    value = sheet(host, [offer(host, 1)], 2).to_bytes()
    with pytest.raises(InvalidRecordError, match="owner"):
        check(offers_key(other.peer_id), value)


def test_sheet_listing_a_foreign_offer_is_refused(host: NodeIdentity) -> None:
    foreign = offer(NodeIdentity.generate(), 1)
    value = sheet(host, [foreign], 2).to_bytes()
    with pytest.raises(InvalidRecordError, match="own author"):
        check(offers_key(host.peer_id), value)


def test_expired_sheet_is_refused(host: NodeIdentity) -> None:
    value = sheet(host, [offer(host, 1)], 2).to_bytes()
    with pytest.raises(InvalidRecordError, match="expired"):
        check(offers_key(host.peer_id), value, now=NOW + 31)


def test_sheet_with_an_expired_offer_is_refused(host: NodeIdentity) -> None:
    value = sheet(host, [offer(host, 1, ttl=1.0)], 2, now=NOW + 5).to_bytes()
    with pytest.raises(InvalidRecordError, match="offer refused: expired"):
        check(offers_key(host.peer_id), value, now=NOW + 5)


def test_forged_sheet_is_refused(host: NodeIdentity) -> None:
    good = sheet(host, [offer(host, 1)], 2)
    forged = Envelope(
        good.kind, good.author, encode_sheet_body([]), good.expires_at, good.nonce, good.signature
    )
    with pytest.raises(InvalidRecordError, match="bad signature"):
        check(offers_key(host.peer_id), forged.to_bytes())


def test_record_of_another_kind_is_refused(host: NodeIdentity) -> None:
    value = offer(host, 1).to_bytes()
    with pytest.raises(InvalidRecordError, match="kind"):
        check(offers_key(host.peer_id), value)


def test_malformed_sheet_body_is_refused(host: NodeIdentity) -> None:
    value = seal(host, SHEET_KIND, b"\xc1", now=NOW, ttl=30.0, nonce=1).to_bytes()
    with pytest.raises(InvalidRecordError, match="msgpack"):
        check(offers_key(host.peer_id), value)
    with pytest.raises(InvalidRecordError, match="byte strings"):
        decode_sheet_body(encode_sheet_body([]).replace(b"\x90", b"\x91\x01"), max_items=8)


def test_sheet_with_too_many_offers_is_refused(host: NodeIdentity) -> None:
    offers = [offer(host, n) for n in range(1, 11)]
    value = sheet(host, offers, 20).to_bytes()
    with pytest.raises(InvalidRecordError):
        check(offers_key(host.peer_id), value)


def test_a_record_read_again_stays_valid(host: NodeIdentity) -> None:
    # DHT records are read many times; already-seen nonces must not invalidate them.
    validator = mesh_validator([OFFER])
    offers = [offer(host, 1)]
    value = sheet(host, offers, 2).to_bytes()
    for raw in (offers[0].to_bytes(), value):
        assert isinstance(validator.validate(raw, now=NOW), Envelope)
    key = offers_key(host.peer_id)
    _sheet, got = check_sheet(key, value, validator, now=NOW, max_offers=8)
    assert got == offers


def test_select_prefers_the_freshest_sheet(host: NodeIdentity) -> None:
    old = sheet(host, [], 1).to_bytes()
    new = sheet(host, [], 2, now=NOW + 1).to_bytes()
    assert select_sheet([old, new]) == 1
    assert select_sheet([new, old]) == 0
    assert select_sheet([b"garbage", old]) == 1
    assert select_sheet([old, old]) == 0


def test_live_envelopes_expire_by_time(host: NodeIdentity) -> None:
    book = LiveEnvelopes()
    short, long_ = offer(host, 1, ttl=1.0), offer(host, 2, ttl=10.0)
    assert book.add(short, source="gossip", now=NOW)
    assert not book.add(short, source="dht", now=NOW)
    assert book.add(long_, source="dht", now=NOW)
    assert book.authors(NOW, kind=OFFER) == {host.public_key}
    assert book.expire(NOW + 1) == [short]
    assert [e.envelope for e in book.live(NOW + 1)] == [long_]
    assert book.authors(NOW + 10) == set()
    assert not book.add(offer(host, 3, ttl=1.0), source="gossip", now=NOW + 2)


def _msg(data: bytes, seqno: int) -> rpc_pb2.Message:
    return rpc_pb2.Message(data=data, from_id=b"peer", seqno=seqno.to_bytes(8, "big"))


def _gate(from_dht: set[bytes] | None = None) -> TopicGate:
    return TopicGate(
        mesh_validator([OFFER]),
        clock=lambda: NOW,
        message_id=lambda m: m.from_id + m.seqno,
        from_dht=(from_dht or set()).__contains__,
    )


def test_gate_delivers_a_valid_envelope_once(host: NodeIdentity) -> None:
    gate = _gate()
    env = offer(host, 1)
    msg = _msg(env.to_bytes(), 1)
    assert gate(None, msg) is True  # type: ignore[arg-type]
    assert gate.take(msg) == env
    assert gate.take(msg) is None


def test_gate_rejects_a_replay_in_a_new_pubsub_message(host: NodeIdentity) -> None:
    gate = _gate()
    raw = offer(host, 1).to_bytes()
    assert gate(None, _msg(raw, 1)) is True  # type: ignore[arg-type]
    assert gate(None, _msg(raw, 2)) is False  # type: ignore[arg-type]
    assert gate.rejections == {"REPLAYED": 1}


def test_gate_forwards_but_does_not_redeliver_what_the_dht_gave(host: NodeIdentity) -> None:
    env = offer(host, 1)
    gate = _gate({env.digest})
    assert gate.decide(env.to_bytes(), now=NOW)[0] is GateDecision.DELIVER
    decision, _ = gate.decide(env.to_bytes(), now=NOW)
    assert decision is GateDecision.FORWARD_ONLY


def test_gate_rejects_garbage_without_raising() -> None:
    gate = _gate()
    for seqno, junk in enumerate([b"", b"\xff" * 10, b"\x96" + b"\x00" * 5], start=1):
        assert gate(None, _msg(junk, seqno)) is False  # type: ignore[arg-type]
    assert gate.rejections == {"MALFORMED": 3}


def test_security_is_noise_only_and_muxer_is_yamux_only(host: NodeIdentity) -> None:
    assert list(noise_only(host.key_pair)) == ["/noise"]
    assert list(yamux_only()) == ["/yamux/1.0.0"]


def test_config_refuses_a_ttl_shorter_than_two_heartbeats() -> None:
    with pytest.raises(MeshError):
        MeshConfig(announce_interval=10.0, offer_ttl=15.0)
    MeshConfig(announce_interval=10.0, offer_ttl=20.0)
