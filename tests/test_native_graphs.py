"""Compiled graphs in native batches: GRAPH and RUN records on the executor.

The client's side (dynamo, AOT autograd, one RUN per call) is in
``test_native_session.py``; here batches are written with ``records.encode``, so that
the tests can feed the executor what the device never writes. The replay library
registers nothing with the dispatcher, so these tests run in the suite's own process.
"""

from __future__ import annotations

import pytest
import torch

from cumulus_p2p import native
from cumulus_p2p.host.graph_compiler import GraphRunner
from cumulus_p2p.host.options import GraphCompiler
from cumulus_p2p.native import records
from cumulus_p2p.native.records import Alloc, Graph, HostTensor, Readback, Run, TensorRef, Upload
from cumulus_p2p.wire import native as wire
from cumulus_p2p.wire.graph_def import pack_definition
from cumulus_p2p.wire.protocol import GraphValue

pytestmark = pytest.mark.native

_X, _Y = GraphValue(GraphValue.INPUT, 0, -1), GraphValue(GraphValue.INPUT, 1, -1)
#: (x * y) + x, its one output the second node's result.
_MUL_ADD = [
    2,
    [["aten.mul.Tensor", [_X, _Y], {}], ["aten.add.Tensor", [GraphValue(1, 0, -1), _X], {}]],
    [GraphValue(1, 1, -1)],
]


def _ref(handle: int, n: int = 4) -> TensorRef:
    return TensorRef(handle, 0, "float32", (n,), (1,))


def _host(t: torch.Tensor) -> HostTensor:
    return HostTensor("float32", tuple(t.shape), t.numpy().tobytes())


class _Session:
    """A native session on a CPU executor, as the host's executor makes one."""

    def __init__(self, quota_bytes: int = 1 << 20, runner: GraphRunner | None = None) -> None:
        from cumulus_p2p.native.executor import ReplaySession, new_replayer

        self.session = ReplaySession(new_replayer("cpu", quota_bytes), graphs=runner)
        self.names: list[str] = []
        self._sent = 0

    def run(self, *batch) -> list[bytes]:
        """The readbacks of ``batch``; raises the failure a record met."""
        new, self._sent = self.names[self._sent :], len(self.names)
        request = wire.request(wire.BATCH, new, records.encode(batch, self.names), reply=True)
        going, reply = self.session.run(b"".join(request))
        assert going
        parsed = wire.parse_reply(b"".join(reply))
        if isinstance(parsed, tuple):
            record, kind, message = parsed
            raise AssertionError(f"{kind}: {message}")
        return [bytes(part) for part in parsed]

    def failure(self, *batch) -> tuple[str, str]:
        """(kind, message) of the record ``batch`` fails on."""
        with pytest.raises(AssertionError) as failed:
            self.run(*batch)
        kind, _, message = str(failed.value).partition(": ")
        return kind, message

    def inputs(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.run(
            Alloc(1, x.nbytes),
            Upload(_ref(1), _host(x)),
            Alloc(2, y.nbytes),
            Upload(_ref(2), _host(y)),
        )


def _floats(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.float32)


X, Y = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([0.5, -1.0, 2.0, 0.0])


def test_a_defined_graph_runs_and_its_output_is_bound_to_the_clients_handle():
    s = _Session()
    s.inputs(X, Y)
    (out,) = s.run(
        Graph(7, pack_definition(_MUL_ADD)),
        Run(7, (_ref(1), _ref(2)), (_ref(3),)),
        Readback(_ref(3)),
    )
    assert torch.equal(_floats(out), X * Y + X)
    assert s.session._replayer.programs == 1  # its calls run in the C++ loop


def test_a_graph_is_defined_once_and_called_many_times():
    s = _Session()
    s.inputs(X, Y)
    s.run(Graph(7, pack_definition(_MUL_ADD)))
    for handle in (3, 4, 5):
        s.run(Run(7, (_ref(1), _ref(2)), (_ref(handle),)))
    (out,) = s.run(Run(7, (_ref(5), _ref(2)), (_ref(6),)), Readback(_ref(6)))
    assert torch.equal(_floats(out), (X * Y + X) * Y + (X * Y + X))


def test_defining_a_graph_again_with_the_same_definition_is_allowed():
    s = _Session()
    s.run(Graph(7, pack_definition(_MUL_ADD)))
    s.run(Graph(7, pack_definition(_MUL_ADD)))  # a moved session sends its graphs again


def test_redefining_a_graph_id_with_another_graph_is_refused():
    s = _Session()
    s.run(Graph(7, pack_definition(_MUL_ADD)))
    other = [2, _MUL_ADD[1][:1], [GraphValue(1, 0, -1)]]
    kind, message = s.failure(Graph(7, pack_definition(other)))
    assert kind == "invalid_graph" and "already defined otherwise" in message


def test_a_graph_never_defined_is_an_invalid_graph():
    s = _Session()
    s.inputs(X, Y)
    kind, message = s.failure(Run(9, (_ref(1), _ref(2)), (_ref(3),)))
    assert kind == "invalid_graph" and "no graph 9" in message


@pytest.mark.parametrize(
    ("definition", "why"),
    [
        (b"\xc1", "not msgpack"),  # a byte msgpack never writes
        (pack_definition([2, [["aten.mul.Tensor", [_X, _Y], {}]]]), ""),  # no outputs
        (pack_definition([1, [["aten.from_file.default", ["/etc/passwd"], {}]], []]), ""),
        (pack_definition([1, [["os.system", ["true"], {}]], []]), ""),
        (pack_definition([1, [], [GraphValue(1, 5, -1)]]), ""),  # a node that is not there
    ],
)
def test_a_malformed_or_forbidden_definition_is_an_invalid_graph(definition, why):
    s = _Session()
    kind, message = s.failure(Graph(1, definition))
    assert kind == "invalid_graph"
    assert why in message


def test_a_truncated_graph_record_is_malformed_and_runs_nothing():
    s = _Session()
    batch = records.encode([Graph(7, pack_definition(_MUL_ADD))], [])
    with pytest.raises(native.errors.ReplayError) as failed:
        s.session._replayer.replay(batch[:-3], [])
    assert failed.value.kind == "malformed"


def test_a_graph_called_with_the_wrong_number_of_outputs_fails():
    s = _Session()
    s.inputs(X, Y)
    s.run(Graph(7, pack_definition(_MUL_ADD)))
    kind, message = s.failure(Run(7, (_ref(1), _ref(2)), (_ref(3), _ref(4))))
    assert kind == "op_failed" and "the call declared 2" in message
    assert 3 not in s.session._replayer.handles()


def test_a_graph_called_with_the_wrong_number_of_inputs_is_an_invalid_graph():
    s = _Session()
    s.inputs(X, Y)
    s.run(Graph(7, pack_definition(_MUL_ADD)))
    kind, message = s.failure(Run(7, (_ref(1),), (_ref(3),)))
    assert kind == "invalid_graph" and "takes 2 inputs" in message


def test_a_graph_input_that_is_not_a_tensor_is_malformed():
    s = _Session()
    s.inputs(X, Y)
    s.run(Graph(7, pack_definition(_MUL_ADD)))
    kind, message = s.failure(Run(7, (_ref(1), 5), (_ref(3),)))
    assert kind == "malformed" and "not a tensor" in message


def test_a_graph_input_naming_a_storage_the_session_lacks_is_an_unknown_handle():
    s = _Session()
    s.inputs(X, Y)
    s.run(Graph(7, pack_definition(_MUL_ADD)))
    kind, _ = s.failure(Run(7, (_ref(1), _ref(99)), (_ref(3),)))
    assert kind == "unknown_handle"


def test_a_graph_whose_intermediates_exceed_the_free_quota_runs_out_of_memory():
    s = _Session(quota_bytes=1024)
    big = [0, [["aten.zeros.default", [[512]], {}]], [GraphValue(1, 0, -1)]]
    s.run(Graph(7, pack_definition(big)))
    kind, _ = s.failure(Run(7, (), (TensorRef(3, 0, "float32", (512,), (1,)),)))
    assert kind == "out_of_memory"
    assert s.session._replayer.live_bytes == 0


def test_an_output_the_client_did_not_expect_the_shape_of_is_poisoned_not_bound():
    s = _Session()
    s.inputs(X, Y)
    s.run(Graph(7, pack_definition(_MUL_ADD)))
    s.run(Run(7, (_ref(1), _ref(2)), (TensorRef(3, 0, "float32", (2, 2), (2, 1)),)))
    kind, _ = s.failure(Readback(_ref(3)))
    assert kind == "poisoned_handle"


def test_a_session_may_define_at_most_its_most_graphs():
    from cumulus_p2p.host.graphs import MAX_SESSION_GRAPHS

    s = _Session()
    s.run(*[Graph(i, pack_definition(_MUL_ADD)) for i in range(MAX_SESSION_GRAPHS)])
    kind, message = s.failure(Graph(MAX_SESSION_GRAPHS, pack_definition(_MUL_ADD)))
    assert kind == "invalid_graph" and f"at most {MAX_SESSION_GRAPHS}" in message


def test_a_replayer_with_no_graph_runner_refuses_graphs():
    from cumulus_p2p.native.executor import new_replayer

    bare = new_replayer("cpu", 1 << 20)
    with pytest.raises(native.errors.ReplayError) as failed:
        bare.replay(records.encode([Graph(1, pack_definition(_MUL_ADD))], []), [])
    assert failed.value.kind == "unknown_op" and "no compiled graphs" in str(failed.value)


def test_a_graphs_random_ops_draw_from_the_sessions_generator_and_leave_the_default_alone():
    rand = [0, [["aten.rand.default", [[4]], {}]], [GraphValue(1, 0, -1)]]
    drawn = []
    for _ in range(2):
        s = _Session()
        s.run(records.Seed(5), Graph(1, pack_definition(rand)))
        default = torch.default_generator.get_state()
        (out,) = s.run(Run(1, (), (_ref(3),)), Readback(_ref(3)))
        assert torch.equal(torch.default_generator.get_state(), default)
        drawn.append(_floats(out))
    torch.manual_seed(5)
    assert torch.equal(drawn[0], torch.rand(4))
    assert torch.equal(drawn[1], drawn[0])


@pytest.mark.slow  # inductor compiles the graph: seconds
def test_the_hosts_graph_compiler_runs_a_native_sessions_graph():
    s = _Session(runner=GraphRunner(GraphCompiler.INDUCTOR))
    s.inputs(X, Y)
    s.run(Graph(7, pack_definition(_MUL_ADD)))
    outputs = [s.run(Run(7, (_ref(1), _ref(2)), (_ref(h),)), Readback(_ref(h))) for h in (3, 4)]
    assert s.session.stats.compiled_graph_runs == 1  # the first call runs node by node
    assert all(torch.allclose(_floats(out), X * Y + X) for (out,) in outputs)


def test_graph_and_run_records_round_trip():
    batch = [Graph(3, b"\x93\x01\x02\x03"), Run(3, (_ref(1), None), (_ref(2), None))]
    names: list[str] = []
    assert records.decode(records.encode(batch, names), names) == batch


def test_a_small_batch_that_runs_a_graph_is_not_replayed_on_the_event_loop():
    session = _Session().session
    plain = wire.request(wire.BATCH, [], records.encode([Alloc(1, 16)], []), reply=False)
    graph = records.encode([Alloc(1, 16), Run(1, (_ref(1),), (_ref(2),))], [])
    calls = wire.request(wire.BATCH, [], graph, reply=False)
    assert session.runs_inline(b"".join(plain))
    assert not session.runs_inline(b"".join(calls))
