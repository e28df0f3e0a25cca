"""The batches a native session keeps to replay itself on another host."""

from __future__ import annotations

import pytest

from cumulus_p2p.native.replaylog import ReplayLog
from cumulus_p2p.wire import native as wire


def _batches(log: ReplayLog) -> list[tuple[list[str], bytes, bool]]:
    out = []
    for frame in log.frames():
        kind, reply, names, batch = wire.parse_request(b"".join(frame))
        assert kind == wire.BATCH
        out.append((names, bytes(batch), reply))
    return out


def test_the_log_replays_each_batch_in_order_with_the_names_it_introduced():
    log = ReplayLog(limit_bytes=1024)
    log.keep(["aten::add.Tensor"], b"\x01first")
    log.keep([], b"\x01second")
    assert _batches(log) == [
        (["aten::add.Tensor"], b"\x01first", False),
        ([], b"\x01second", False),
    ]
    assert log.lost_because is None


def test_a_log_past_its_limit_is_dropped_and_says_why_it_cannot_replay():
    log = ReplayLog(limit_bytes=64)
    log.keep([], b"x" * 32)
    log.keep([], b"y" * 32)
    assert log.lost_because is not None
    assert "outgrew the 64 bytes" in log.lost_because
    with pytest.raises(ValueError, match="outgrew"):
        log.frames()
    log.keep([], b"z")  # nothing comes back once the start is gone
    assert log.lost_because is not None


def test_a_cut_drops_the_batches_before_its_mark_and_their_bytes():
    log = ReplayLog(limit_bytes=1024)
    log.keep([], b"\x01before")
    mark = log.mark()
    log.keep([], b"\x01after")
    after_bytes = log.nbytes - sum(len(part) for part in log.frames()[0])
    log.keep([], b"\x01later")
    log.cut(mark)
    assert [batch for _, batch, _ in _batches(log)] == [b"\x01after", b"\x01later"]
    assert log.nbytes == after_bytes + sum(len(part) for part in log.frames()[1])


def test_marks_count_from_the_start_across_cuts():
    log = ReplayLog(limit_bytes=1024)
    log.keep([], b"\x01a")
    log.cut(log.mark())
    log.keep([], b"\x01b")
    second = log.mark()
    log.keep([], b"\x01c")
    log.cut(second)
    assert [batch for _, batch, _ in _batches(log)] == [b"\x01c"]


def test_a_resumed_session_sends_again_only_the_batches_its_executor_did_not_receive():
    log = ReplayLog(limit_bytes=1024)
    log.keep([], b"\x01zero", counted=0)
    log.keep([], b"\x01two", counted=2)  # count 1 was a read that is not logged
    log.keep([], b"\x01three", counted=3)
    again = [wire.parse_request(b"".join(f))[3].tobytes() for f in log.unreceived(2)]
    assert again == [b"\x01two", b"\x01three"]
    assert log.last_counted == 3


def test_a_fresh_executor_counts_the_replayed_batches_from_where_the_restore_left_off():
    log = ReplayLog(limit_bytes=1024)
    log.keep([], b"\x01a", counted=7)
    log.keep([], b"\x01b", counted=9)
    assert len(log.frames(first=3)) == 2
    assert log.last_counted == 4
    assert len(log.unreceived(4)) == 1
