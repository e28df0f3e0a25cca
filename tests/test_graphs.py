"""The executor's graph programs (``graphs.py``), sans-IO: built from data, run on CPU."""

from __future__ import annotations

import pytest
import torch

from cumulus_p2p.host.graphs import GraphError, NodeFailed, ProgramCache, build_program
from cumulus_p2p.wire.protocol import GraphValue

CPU = torch.device("cpu")
INPUT = GraphValue(GraphValue.INPUT, 0, -1)


def node(i: int, item: int = -1) -> GraphValue:
    return GraphValue(GraphValue.NODE, i, item)


def chain(length: int) -> list:
    """``x * 2 * 2 ...``: each value is read by the next node only."""
    nodes = [["aten.mul.Tensor", [INPUT if i == 0 else node(i - 1), 2], {}] for i in range(length)]
    return [1, nodes, [node(length - 1)]]


def test_a_program_computes_what_its_nodes_compute():
    program = build_program(
        [
            1,
            [
                ["aten.var_mean.correction", [INPUT], {}],
                ["aten.add.Tensor", [node(0, 0), node(0, 1)], {}],
            ],
            [node(1)],
        ],
        CPU,
    )
    x = torch.arange(4.0)
    (out,) = program.run([x], budget=1 << 20)
    var, mean = torch.var_mean(x)
    assert torch.equal(out, var + mean)


def test_a_chain_holds_two_values_at_a_time_not_all_of_them():
    x = torch.ones(2**16)  # 256 KiB a value
    program = build_program(chain(8), CPU)
    (out,) = program.run([x], budget=2 * x.nbytes)
    assert torch.equal(out, x * 256)
    with pytest.raises(NodeFailed) as info:
        program.run([x], budget=x.nbytes)
    assert isinstance(info.value.error, torch.OutOfMemoryError)


def test_an_output_is_kept_however_early_it_was_computed():
    program = build_program([1, chain(3)[1], [node(0), node(2)]], CPU)
    first, last = program.run([torch.ones(3)], budget=1 << 20)
    assert first.tolist() == [2.0] * 3 and last.tolist() == [8.0] * 3


def test_a_call_with_the_wrong_number_of_inputs_is_refused():
    with pytest.raises(GraphError, match="takes 1 inputs, not 2"):
        build_program(chain(2), CPU).run([torch.ones(1), torch.ones(1)], budget=1 << 20)


def test_programs_are_built_once_per_content_and_device():
    cache = ProgramCache(capacity=2)
    key, first = cache.get(chain(2), CPU)
    assert cache.get(chain(2), CPU) == (key, first)
    assert cache.builds == 1
    cache.get(chain(3), CPU)
    cache.get(chain(4), CPU)  # evicts chain(2), the least recently used
    assert cache.get(chain(2), CPU)[1] is not first
    assert cache.builds == 4


def test_a_constant_size_factory_counts_its_bytes_before_it_runs():
    graph = [0, [["aten.zeros.default", [[1000, 1000]], {"dtype": torch.float32}]], [node(0)]]
    assert build_program(graph, CPU).factory_bytes == 4_000_000


def test_an_element_of_a_value_that_has_none_is_an_error_naming_the_node():
    graph = [1, [["aten.neg.default", [GraphValue(GraphValue.INPUT, 0, 2)], {}]], [node(0)]]
    with pytest.raises(NodeFailed) as info:
        build_program(graph, CPU).run([torch.ones(3)], budget=1 << 20)
    assert (info.value.op, info.value.index) == ("aten.neg.default", 0)
    assert "has no element 2" in str(info.value)


def test_a_write_copies_an_output_into_its_input_after_the_run():
    graph = [1, [["aten.add.Tensor", [INPUT, 1], {}]], [node(0)], [[0, 0]]]
    x = torch.zeros(3)
    build_program(graph, CPU).run([x], budget=1 << 20)
    assert x.tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("writes", [[[1, 0]], [[0, 1]], [[0, 0], [0, 0]], [[0]], "all"], ids=str)
def test_a_write_naming_no_output_or_no_input_or_twice_is_refused(writes):
    graph = [1, [["aten.add.Tensor", [INPUT, 1], {}]], [node(0)], writes]
    with pytest.raises(GraphError):
        build_program(graph, CPU)


def test_a_write_of_another_shape_is_refused_when_it_runs():
    graph = [1, [["aten.sum.default", [INPUT], {}]], [node(0)], [[0, 0]]]
    with pytest.raises(GraphError, match="shapes differ"):
        build_program(graph, CPU).run([torch.ones(3)], budget=1 << 20)


def test_in_place_ops_update_inputs_and_earlier_results_as_eager_code_would():
    second = GraphValue(GraphValue.INPUT, 1, -1)
    graph = [
        2,
        [
            ["aten._foreach_mul_.Scalar", [[INPUT, second], 2.0], {}],
            ["aten.sqrt.default", [INPUT], {}],
            ["aten.add_.Tensor", [node(1), 1.0], {}],
            ["aten.copy_.default", [second, node(1)], {}],
        ],
        [],
    ]
    x, y = torch.full((3,), 8.0), torch.ones(3)
    assert build_program(graph, CPU).run([x, y], budget=1 << 20) == []
    assert x.tolist() == [16.0] * 3
    assert y.tolist() == [5.0] * 3


def test_a_write_to_an_out_argument_is_refused():
    graph = [1, [["aten.neg.out", [INPUT], {"out": INPUT}]], []]
    with pytest.raises(GraphError, match="writes to its out= argument"):
        build_program(graph, CPU)


def test_an_in_place_write_to_a_constant_is_refused():
    graph = [1, [["aten._foreach_add_.Scalar", [[INPUT, 3.0], 1.0], {}]], []]
    with pytest.raises(GraphError, match="not a graph value"):
        build_program(graph, CPU)
