"""The sans-IO record layer and session core: what a tamperer, replayer or reorderer gets."""

from __future__ import annotations

import array
import os

import msgpack
import pytest

from cumulus_p2p._errors import (
    FrameTooLargeError,
    LocalProtocolError,
    RecordAuthenticationError,
    RemoteProtocolError,
)
from cumulus_p2p.channel.secure.record import HEADER, RecordOpener, RecordSealer
from cumulus_p2p.channel.secure.resume import Closed, SessionCore


def core_pair(**kw) -> tuple[SessionCore, SessionCore]:
    k1, k2 = os.urandom(32), os.urandom(32)
    kw.setdefault("max_frame", 1 << 24)
    return SessionCore(k1, k2, **kw), SessionCore(k2, k1, **kw)


def deliver(receiver: SessionCore, record: tuple[bytes, bytes]):
    header, ct = record
    n = receiver.receive_header(header)
    assert n == len(ct)
    return receiver.receive_body(header, ct)


def send_frame(sender: SessionCore, receiver: SessionCore, parts) -> bytearray | None:
    out = None
    for record in sender.seal_frame(parts):
        event = deliver(receiver, record)
        if event is not None:
            out = event
    return out


def test_frames_of_any_shape_round_trip():
    a, b = core_pair(max_record=1000)
    blob = os.urandom(5000)
    for parts in ([b"hello"], [b""], [b"ab", memoryview(blob), b"cd"], [blob[:999], blob[999:]]):
        assert send_frame(a, b, parts) == b"".join(bytes(p) for p in parts)


def test_single_record_fast_path_matches_the_general_path():
    a, b = core_pair(max_record=1000)
    words = memoryview(array.array("I", range(200)))  # 800 bytes, 4-byte items
    for parts in ([b"hello"], [b""], [words], [b"ab", words, b"cd"], [bytearray(1000)]):
        record = a.seal_single(parts)
        assert record is not None
        assert deliver(b, record) == b"".join(bytes(p) for p in parts)
    assert a.seal_single([b"x" * 1001]) is None  # two records: the caller uses seal_frame
    assert a.seal_single([b"x" * 600, b"y" * 600]) is None
    with pytest.raises(FrameTooLargeError):
        core_pair(max_frame=10)[0].seal_single([b"x" * 11])


def test_tampered_ciphertext_is_rejected():
    a, b = core_pair()
    header, ct = next(a.seal_frame([b"transfer 10 credits"]))
    forged = bytearray(ct)
    forged[3] ^= 0x01
    b.receive_header(header)
    with pytest.raises(RecordAuthenticationError):
        b.receive_body(header, bytes(forged))


def test_tampered_header_is_rejected():
    a, b = core_pair()
    header, ct = next(a.seal_frame([b"x" * 40]))
    ct_len, kind, ack, arg = HEADER.unpack(header)
    # Claim a longer frame: the header is associated data, so this fails authentication.
    forged = HEADER.pack(ct_len, kind, ack, arg + 1)
    b.receive_header(forged)
    with pytest.raises(RecordAuthenticationError):
        b.receive_body(forged, ct)


def test_replayed_record_is_rejected():
    a, b = core_pair()
    record = next(a.seal_frame([b"run op 7"]))
    assert deliver(b, record) == b"run op 7"
    with pytest.raises(RecordAuthenticationError):
        deliver(b, record)


def test_reordered_records_are_rejected():
    a, b = core_pair()
    first = next(a.seal_frame([b"first"]))
    second = next(a.seal_frame([b"second"]))
    with pytest.raises(RecordAuthenticationError):
        deliver(b, second)
    del first


def test_records_from_another_session_are_rejected():
    a, _ = core_pair()
    _, other = core_pair()
    with pytest.raises(RecordAuthenticationError):
        deliver(other, next(a.seal_frame([b"hi"])))


def test_rekey_happens_on_both_sides_after_the_byte_bound():
    a, b = core_pair(max_record=1024, rekey_bytes=4096)
    blob = os.urandom(64 * 1024)
    assert send_frame(a, b, [blob]) == blob
    assert a._sealer.rekeys == b._opener.rekeys >= 15
    assert send_frame(a, b, [b"still in step"]) == b"still in step"


def test_opener_that_missed_the_rekey_rejects_later_records():
    key = os.urandom(32)
    sealer, opener = RecordSealer(key, 100), RecordOpener(key, 10**9, 1 << 20)
    opener.open(*sealer.seal(1, 0, 200, b"y" * 200))  # crosses the bound: both rekey
    assert sealer.rekeys == 1
    with pytest.raises(RecordAuthenticationError):
        opener.open(*sealer.seal(1, 0, 200, b"y" * 200))


def test_oversized_record_is_refused_from_its_header():
    a, b = core_pair(max_record=1024)
    with pytest.raises(RemoteProtocolError):
        b.receive_header(HEADER.pack(10**9, 1, 0, 10**9))


def test_oversized_frame_is_refused_before_allocation():
    a, b = core_pair(max_frame=1000)
    big = SessionCore(os.urandom(32), os.urandom(32), max_frame=1 << 20)
    header, _ = next(big.seal_frame([b"z" * 2000]))
    with pytest.raises(FrameTooLargeError):
        b.receive_header(header)
    with pytest.raises(FrameTooLargeError):
        next(a.seal_frame([b"z" * 2000]))


def test_acknowledged_records_leave_the_retransmit_buffer():
    a, b = core_pair(max_record=1000)
    send_frame(a, b, [os.urandom(10_000)])
    assert a.buffer.end - a.buffer.base == 10
    deliver(a, b.seal_ack())
    assert a.buffer.base == a.buffer.end == 10


def test_resend_after_drop_completes_a_torn_frame_exactly_once():
    a, b = core_pair(max_record=1000)
    blob = os.urandom(5500)
    records = list(a.seal_frame([blob]))
    for record in records[:3]:  # the connection drops after three records
        assert deliver(b, record) is None
    resend = a.resend_from(b.received)
    assert len(resend) == 3
    events = [deliver(b, r) for r in resend]
    assert events[-1] == blob and events[:-1] == [None, None]


def test_resume_point_outside_the_buffer_is_a_protocol_error():
    a, b = core_pair()
    send_frame(a, b, [b"x"])
    with pytest.raises(RemoteProtocolError):
        a.resend_from(5)


def test_close_record_reports_the_reason():
    a, b = core_pair()
    assert deliver(b, a.seal_close("bye")) == Closed("bye")


# --- handing a session to another process ----------------------------------------------


def continued(core: SessionCore, **kw) -> SessionCore:
    """``core`` as another process continues it, from its exported state alone."""
    state = msgpack.unpackb(msgpack.packb(core.export()))  # what crosses the link
    return SessionCore.continued(state, **kw)


def test_a_continued_core_carries_on_both_directions_across_rekeys():
    limits = {"max_frame": 1 << 24, "max_record": 1024, "rekey_bytes": 4096}
    a, b = core_pair(**limits)
    send_frame(a, b, [os.urandom(20_000)])  # past several rekeys in a -> b
    send_frame(b, a, [b"welcome"])
    moved = continued(b, **limits)
    blob = os.urandom(20_000)
    assert send_frame(a, moved, [blob]) == blob
    assert send_frame(moved, a, [b"reply"]) == b"reply"
    assert moved._opener.rekeys == a._sealer.rekeys > 0


def test_a_continued_core_resends_what_the_peer_had_not_acknowledged():
    a, b = core_pair(max_record=1000)
    records = list(b.seal_frame([b"lost on the way"]))  # sealed, never delivered
    moved = continued(b, max_frame=1 << 24, max_record=1000)
    (resent,) = moved.resend_from(a.received)
    assert resent == records[0]
    assert deliver(a, resent) == b"lost on the way"


def test_a_core_cannot_be_handed_over_mid_frame():
    a, b = core_pair(max_record=1000)
    first = next(a.seal_frame([os.urandom(3000)]))
    deliver(b, first)
    with pytest.raises(LocalProtocolError, match="between frames"):
        b.export()


@pytest.mark.parametrize(
    "state", [[], [1, 2, 3, 4, 5, 6, 7], None, "core", [[b"k", 0, 0, 0]] * 2 + [0, 0, 0, 0, []]]
)
def test_a_state_that_is_not_an_exported_core_is_refused(state):
    with pytest.raises(ValueError):
        SessionCore.continued(state, max_frame=1024)
