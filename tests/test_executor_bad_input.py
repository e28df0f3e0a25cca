"""Bad input to an executor: a clear error for that session, nothing else changes.

Every test keeps a second, honest session open on the same executor process and checks
that its tensors are still correct afterwards.
"""

from __future__ import annotations

import random
import socket
import struct

import msgpack
import pytest
import torch

import cumulus_p2p.remote as remote
from cumulus_p2p._errors import RemoteExecutionError
from cumulus_p2p.channel.transport import SocketFrameChannel
from cumulus_p2p.remote.client import RemoteSession
from cumulus_p2p.wire.protocol import (
    PROTOCOL_VERSION,
    GraphValue,
    TensorRef,
    decode_frame,
    encode_frame,
)


@pytest.fixture
def honest(executor_address):
    """An honest session holding a known tensor; check it with ``honest_ok()``."""
    with remote.attach(executor_address) as session:
        witness = torch.arange(10.0, device="cumulus")
        yield session, witness


def honest_ok(honest) -> bool:
    _session, witness = honest
    return (witness * 2).sum().item() == 90.0


def raw_socket(address: str) -> socket.socket:
    host, port = address.split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def send_hello(sock: socket.socket) -> None:
    parts = encode_frame(["hello", PROTOCOL_VERSION, {}])
    body = b"".join(parts)
    sock.sendall(struct.pack(">I", len(body)) + body)
    SocketFrameChannel(sock).recv_frame()  # the welcome


def read_fatal(sock: socket.socket) -> str:
    header, _ = decode_frame(SocketFrameChannel(sock).recv_frame())
    assert header[0] == "fatal"
    return header[1]


def second_session(address: str) -> RemoteSession:
    host, port = address.split(":")
    return RemoteSession(SocketFrameChannel.connect(host, int(port)))


def test_truncated_frame_ends_only_that_connection(executor_address, honest):
    sock = raw_socket(executor_address)
    send_hello(sock)
    sock.sendall(struct.pack(">I", 1000) + b"only a few bytes")
    sock.close()
    assert honest_ok(honest)


def test_oversized_frame_is_refused_before_allocation(executor_address, honest):
    sock = raw_socket(executor_address)
    send_hello(sock)
    sock.sendall(struct.pack(">I", 0xFFFFFFFF))
    assert "limit is" in read_fatal(sock)
    sock.close()
    assert honest_ok(honest)


def test_garbage_header_gets_a_fatal_reply_naming_the_problem(executor_address, honest):
    sock = raw_socket(executor_address)
    send_hello(sock)
    body = struct.pack("<I", 5) + b"\xc1\xc1\xc1\xc1\xc1"  # 0xc1 is never valid msgpack
    sock.sendall(struct.pack(">I", len(body)) + body)
    assert "malformed header" in read_fatal(sock)
    sock.close()
    assert honest_ok(honest)


@pytest.mark.parametrize("grows", [-1, "lots", 1.5, [4096]])
def test_a_batch_whose_growth_is_not_a_byte_count_is_refused(executor_address, honest, grows):
    sock = raw_socket(executor_address)
    send_hello(sock)
    body = b"".join(encode_frame(["batch", 1, [], [], ["sync"], [], grows]))
    sock.sendall(struct.pack(">I", len(body)) + body)
    assert "growth must be a byte count" in read_fatal(sock)
    sock.close()
    assert honest_ok(honest)


def test_wrong_protocol_version_is_refused_with_advice(executor_address, honest):
    sock = raw_socket(executor_address)
    body = b"".join(encode_frame(["hello", 999, {}]))
    sock.sendall(struct.pack(">I", len(body)) + body)
    assert "Upgrade" in read_fatal(sock)
    sock.close()
    assert honest_ok(honest)


def _fails_with(session: RemoteSession, record: list, kind: str) -> RemoteExecutionError:
    session.submit(record)
    with pytest.raises(RemoteExecutionError) as info:
        session.synchronize()
    assert info.value.remote_type == kind
    session.synchronize()  # the error was reported once; the session is healthy again
    return info.value


def test_unknown_op_name_is_an_error_for_that_op(executor_address, honest):
    attacker = second_session(executor_address)
    err = _fails_with(attacker, ["aten.no_such_op.default", [], {}, None], "UnknownOpError")
    assert "no aten op" in str(err)
    assert honest_ok(honest)


@pytest.mark.parametrize(
    "name",
    [
        "os.system.default",
        "builtins.eval.default",
        "aten.from_file.default",
        "aten.squeeze_.default",  # layout changes in place would make reused views lie
        "aten.transpose_.default",
    ],
)
def test_ops_outside_aten_or_blocked_are_refused(executor_address, honest, name):
    attacker = second_session(executor_address)
    _fails_with(attacker, [name, ["/etc/passwd"], {}, None], "UnknownOpError")
    assert honest_ok(honest)


def test_forged_handle_is_an_error_not_a_lookup(executor_address, honest):
    attacker = second_session(executor_address)
    forged = TensorRef(1, torch.float32, 0, (10,), (1,))  # the honest session's handle 1
    err = _fails_with(
        attacker, ["aten.neg.default", [forged], {}, [[5, [10], [1], 0]]], "InvalidHandleError"
    )
    assert "no tensor with handle 1" in str(err)
    assert honest_ok(honest)


def test_wrong_argument_types_are_reported(executor_address, honest):
    attacker = second_session(executor_address)
    record = ["aten.add.Tensor", ["not a tensor", 3], {}, [[1, [], [], 0]]]
    err = _fails_with(attacker, record, "RuntimeError")  # torch's own type check
    assert "Expected a value of type 'Tensor'" in str(err)
    assert honest_ok(honest)


def test_out_of_bounds_view_is_refused(executor_address, honest):
    attacker = second_session(executor_address)
    attacker.submit(["aten.empty_strided.default", [[4], [1]], {}, [[1, [4], [1], 0]]])
    too_far = TensorRef(1, torch.float32, 2, (4,), (1,))
    err = _fails_with(
        attacker, ["aten.neg.default", [too_far], {}, [[2, [4], [1], 0]]], "IndexError"
    )
    assert "out of bounds" in str(err)
    assert honest_ok(honest)


def test_a_freed_handle_reused_for_a_smaller_storage_checks_views_again(executor_address, honest):
    attacker = second_session(executor_address)
    view = TensorRef(1, torch.float32, 0, (8,), (1,))
    attacker.submit(["aten.empty_strided.default", [[8], [1]], {}, [[1, [8], [1], 0]]])
    attacker.submit(["aten.neg.default", [view], {}, [[2, [8], [1], 0]]])
    attacker.synchronize()  # the executor has now built and kept a view for ``view``
    attacker.free(1, 0)
    attacker.synchronize()  # frees apply after their batch's ops
    attacker.submit(["aten.empty_strided.default", [[4], [1]], {}, [[1, [4], [1], 0]]])
    err = _fails_with(attacker, ["aten.neg.default", [view], {}, [[3, [8], [1], 0]]], "IndexError")
    assert "out of bounds" in str(err)
    assert honest_ok(honest)


def test_reusing_a_live_handle_is_refused(executor_address, honest):
    attacker = second_session(executor_address)
    attacker.submit(["aten.empty_strided.default", [[4], [1]], {}, [[1, [4], [1], 0]]])
    _fails_with(
        attacker,
        ["aten.empty_strided.default", [[4], [1]], {}, [[1, [4], [1], 0]]],
        "InvalidHandleError",
    )
    assert honest_ok(honest)


def _random_value(rng: random.Random, depth: int = 0):
    choice = rng.randrange(9 if depth < 3 else 6)
    if choice == 0:
        return rng.randrange(-(2**40), 2**40)
    if choice == 1:
        return rng.random() * 1e6
    if choice == 2:
        return rng.choice([None, True, False, "mean", ""])
    if choice == 3:
        return TensorRef(
            rng.randrange(0, 8),
            torch.float32,
            rng.randrange(-2, 8),
            (rng.randrange(-1, 6),),
            (rng.randrange(-1, 3),),
        )
    if choice == 4:
        return torch.float64
    if choice == 5:
        return rng.randrange(0, 4)
    return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]


def test_fuzzed_op_records_never_break_the_session(executor_address, honest):
    """Thousands of random (often nonsensical) op records: each fails or runs, cleanly."""
    rng = random.Random(1234)
    names = [
        "aten.add.Tensor",
        "aten.mul.Tensor",
        "aten.index_select.default",
        "aten.cat.default",
        "aten.view.default",
        "aten.as_strided.default",
        "aten.empty_strided.default",
        "aten.zeros.default",
        "aten.sum.dim_IntList",
        "aten.bogus.default",
        42,
        None,
    ]
    attacker = second_session(executor_address)
    attacker.submit(["aten.empty_strided.default", [[8], [1]], {}, [[1, [8], [1], 0]]])
    for _ in range(40):
        for _ in range(100):
            outs = rng.choice([None, [[rng.randrange(2, 10), [8], [1], 0]], ["dyn", 100], "junk"])
            record = [
                rng.choice(names),
                [_random_value(rng) for _ in range(rng.randrange(4))],
                {},
                outs,
            ]
            if rng.random() < 0.05:
                record = rng.choice([[], ["x"], "not a list", [1, 2, 3, 4, 5]])
            attacker.submit(record)
        try:
            attacker.synchronize()
        except RemoteExecutionError:
            pass
    # The session still runs ops after the fuzz: a valid record counts as one more op.
    ran = attacker.stats()["ops"]
    assert ran > 1, "some fuzzed records were valid and ran between the failures"
    attacker.submit(["aten.zeros.default", [[4]], {}, [[10_000, [4], [1], 0]]])
    attacker.synchronize()
    assert attacker.stats()["ops"] == ran + 1
    assert honest_ok(honest)


def test_random_bytes_frames_never_take_the_executor_down(executor_address, honest):
    rng = random.Random(99)
    for _ in range(200):
        sock = raw_socket(executor_address)
        if rng.random() < 0.5:
            send_hello(sock)
        blob = rng.randbytes(rng.randrange(0, 200))
        framed = rng.random() < 0.8
        sock.sendall((struct.pack(">I", len(blob)) if framed else b"") + blob)
        sock.close()
    assert honest_ok(honest)


def test_sans_io_core_survives_many_thousands_of_random_frames():
    """The decode path itself, fed 20,000 random and mutated frames in-process."""
    from cumulus_p2p._errors import RemoteProtocolError
    from cumulus_p2p.host.session import DeviceContext, ExecutorSession, parse_batch

    rng = random.Random(7)
    session = ExecutorSession(DeviceContext(torch.device("cpu")), quota_bytes=1 << 24)
    valid = b"".join(
        encode_frame(
            ["batch", 1, [["aten.zeros.default", [[2]], {}, [[1, [2], [1], 0]]]], [], ["sync"], []]
        )
    )
    rejected = 0
    for i in range(20_000):
        if i % 2:
            frame = bytearray(valid)
            for _ in range(rng.randrange(1, 6)):
                frame[rng.randrange(len(frame))] = rng.randrange(256)
        else:
            frame = rng.randbytes(rng.randrange(0, 64))
        try:
            header, area = decode_frame(frame)
            if header[0] == "batch":
                session.run_batch(parse_batch(header, area))
        except RemoteProtocolError:
            rejected += 1
    assert rejected > 10_000
    reply = session.run_batch(parse_batch(*decode_frame(valid)))
    assert reply is not None


def test_msgpack_bombs_are_rejected_cheaply(executor_address, honest):
    sock = raw_socket(executor_address)
    send_hello(sock)
    bomb = msgpack.packb(["batch", 1, [[]] * 10, [], None, [2**40]])
    body = struct.pack("<I", len(bomb)) + bomb
    sock.sendall(struct.pack(">I", len(body)) + body)
    assert "blob lengths" in read_fatal(sock)
    sock.close()
    assert honest_ok(honest)


# --- compiled graphs (``@graph`` / ``@run``, graphs.py) --------------------------------


def _input(i: int) -> GraphValue:
    return GraphValue(GraphValue.INPUT, i, -1)


def _node(i: int) -> GraphValue:
    return GraphValue(GraphValue.NODE, i, -1)


#: ``neg(x) * 2``: one input, two nodes, one output.
_GOOD_GRAPH = [
    1,
    [["aten.neg.default", [_input(0)], {}], ["aten.mul.Tensor", [_node(0), 2], {}]],
    [_node(1)],
]


def _with_tensor(session: RemoteSession) -> TensorRef:
    session.submit(["aten.empty_strided.default", [[4], [1]], {}, [[1, [4], [1], 0]]])
    return TensorRef(1, torch.float32, 0, (4,), (1,))


def test_a_good_graph_runs_after_a_bad_one_in_the_same_session(executor_address, honest):
    attacker = second_session(executor_address)
    bad = [1, [["aten.neg.default", [_node(0)], {}]], [_node(0)]]  # refers to itself
    _fails_with(attacker, ["@graph", [1, bad], {}, None], "InvalidGraphError")
    x = _with_tensor(attacker)
    attacker.submit(["@graph", [2, _GOOD_GRAPH], {}, None])
    attacker.submit(["@run", [2, [x]], {}, [[2, [4], [1], 0]]])
    attacker.synchronize()
    assert honest_ok(honest)


@pytest.mark.parametrize(
    ("nodes", "why"),
    [
        ([["aten.from_file.default", ["/etc/passwd"], {}]], "not allowed"),
        ([["os.system.default", ["true"], {}]], "not an aten op"),
        ([["aten.neg.out", [_input(0)], {"out": _input(0)}]], "writes to its out= argument"),
        ([["aten.neg.default", [_node(1)], {}], ["aten.neg.default", [_node(0)], {}]], "earlier"),
        ([["aten.neg.default", [_input(3)], {}]], "input 3"),
        ([["aten.neg.default"]], "not [op_name, args, kwargs]"),
        ([["aten.neg.default", [GraphValue(7, 0, -1)], {}]], "kind 7"),
    ],
    ids=["blocked", "outside-aten", "out-argument", "cyclic", "input-range", "short-node", "kind"],
)
def test_a_bad_graph_is_refused_for_that_session_only(executor_address, honest, nodes, why):
    attacker = second_session(executor_address)
    err = _fails_with(
        attacker, ["@graph", [1, [1, nodes, [_node(0)]]], {}, None], "InvalidGraphError"
    )
    assert why in str(err)
    assert honest_ok(honest)


def test_a_graph_may_not_name_a_stored_tensor_of_any_session(executor_address, honest):
    attacker = second_session(executor_address)
    honest_handle = TensorRef(1, torch.float32, 0, (10,), (1,))
    graph = [0, [["aten.neg.default", [honest_handle], {}]], [_node(0)]]
    err = _fails_with(attacker, ["@graph", [1, graph], {}, None], "InvalidGraphError")
    assert "passed to a graph as its inputs" in str(err)
    assert honest_ok(honest)


def test_a_graph_call_cannot_take_another_sessions_tensor(executor_address, honest):
    attacker = second_session(executor_address)
    attacker.submit(["@graph", [1, _GOOD_GRAPH], {}, None])
    honest_handle = TensorRef(1, torch.float32, 0, (10,), (1,))
    record = ["@run", [1, [honest_handle]], {}, [[5, [10], [1], 0]]]
    err = _fails_with(attacker, record, "InvalidHandleError")
    assert "no tensor with handle 1" in str(err)
    assert honest_ok(honest)


def test_a_huge_graph_is_refused_before_it_is_built(executor_address, honest):
    attacker = second_session(executor_address)
    nodes = [["aten.neg.default", [_input(0)], {}]] * 50_001
    err = _fails_with(
        attacker, ["@graph", [1, [1, nodes, [_node(0)]]], {}, None], "InvalidGraphError"
    )
    assert "at most 50000 nodes" in str(err)
    assert honest_ok(honest)


def test_a_graph_id_never_sent_is_an_error(executor_address, honest):
    attacker = second_session(executor_address)
    x = _with_tensor(attacker)
    err = _fails_with(attacker, ["@run", [9, [x]], {}, [[2, [4], [1], 0]]], "InvalidGraphError")
    assert "no graph 9" in str(err)
    assert honest_ok(honest)


def test_redefining_a_graph_id_with_another_graph_is_refused(executor_address, honest):
    attacker = second_session(executor_address)
    attacker.submit(["@graph", [1, _GOOD_GRAPH], {}, None])
    attacker.submit(["@graph", [1, _GOOD_GRAPH], {}, None])  # the same again: a failover does
    attacker.synchronize()
    other = [1, [["aten.neg.default", [_input(0)], {}]], [_node(0)]]
    err = _fails_with(attacker, ["@graph", [1, other], {}, None], "InvalidGraphError")
    assert "already defined" in str(err)
    assert honest_ok(honest)


def test_a_graph_run_with_the_wrong_output_count_is_refused(executor_address, honest):
    attacker = second_session(executor_address)
    x = _with_tensor(attacker)
    attacker.submit(["@graph", [1, _GOOD_GRAPH], {}, None])
    err = _fails_with(attacker, ["@run", [1, [x]], {}, []], "RemoteProtocolError")
    assert "1 outputs" in str(err)
    assert honest_ok(honest)


def test_a_graph_holding_more_than_the_quota_at_once_runs_out_of_memory(executor_address, honest):
    host, port = executor_address.split(":")
    attacker = RemoteSession(SocketFrameChannel.connect(host, int(port)), quota_bytes=1 << 20)
    x = _with_tensor(attacker)
    half_quota = [
        ["aten.expand.default", [_input(0), [2**15, 4]], {}],  # a view: no memory
        ["aten.clone.default", [_node(0)], {}],  # 512 KiB
        ["aten.mul.Tensor", [_node(1), 2], {}],  # 512 KiB more while node 1 is still held
        ["aten.sum.default", [_node(2)], {}],
    ]
    attacker.submit(["@graph", [1, [1, half_quota, [_node(3)]]], {}, None])
    err = _fails_with(attacker, ["@run", [1, [x]], {}, [[2, [], [], 0]]], "OutOfMemoryError")
    assert "aten.mul.Tensor (node 2 of compiled graph 1)" in str(err)
    assert "exceed the free quota" in str(err)
    assert honest_ok(honest)


def test_an_in_place_graph_writing_an_overlapping_view_fails_naming_its_node(
    executor_address, honest
):
    attacker = second_session(executor_address)
    x = _with_tensor(attacker)
    writes = [
        ["aten.expand.default", [_input(0), [3, 4]], {}],  # every row is the same memory
        ["aten.add_.Tensor", [_node(0), 1], {}],
    ]
    attacker.submit(["@graph", [1, [1, writes, []]], {}, None])
    err = _fails_with(attacker, ["@run", [1, [x]], {}, []], "RuntimeError")
    assert "aten.add_.Tensor (node 1 of compiled graph 1)" in str(err)
    assert honest_ok(honest)
