"""Graph programs compiled with inductor on the executor (``--graph-compiler inductor``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cumulus_p2p.remote as remote
from cumulus_p2p.host import graph_compiler
from cumulus_p2p.host.graph_compiler import GraphRunner
from cumulus_p2p.host.graphs import NodeFailed, build_program
from cumulus_p2p.host.options import GraphCompiler
from cumulus_p2p.testing.executor import executor_process
from cumulus_p2p.testing.models import TinyTransformer
from cumulus_p2p.wire.protocol import GraphValue

CPU = torch.device("cpu")


def _input(i: int) -> GraphValue:
    return GraphValue(GraphValue.INPUT, i, -1)


def _node(i: int) -> GraphValue:
    return GraphValue(GraphValue.NODE, i, -1)


#: ``tanh(x @ w) * 2``: one intermediate of x's rows by w's columns.
_MATMUL = [
    2,
    [
        ["aten.mm.default", [_input(0), _input(1)], {}],
        ["aten.tanh.default", [_node(0)], {}],
        ["aten.mul.Tensor", [_node(1), 2.0], {}],
    ],
    [_node(2)],
]


@pytest.mark.slow  # compiles graphs with inductor
def test_a_program_runs_node_by_node_first_then_compiled_with_the_same_results():
    program = build_program(_MATMUL, CPU)
    runner = GraphRunner(GraphCompiler.INDUCTOR)
    x, w = torch.randn(8, 16), torch.randn(16, 4)
    expected = torch.tanh(x @ w) * 2
    ran_compiled = []
    for _ in range(3):
        (out,), compiled = runner.run(b"matmul", program, [x, w], budget=1 << 20)
        assert torch.allclose(out, expected, atol=1e-6)
        ran_compiled.append(compiled)
    assert ran_compiled == [False, True, True]


def test_a_compiled_program_still_keeps_within_the_free_quota():
    program = build_program(_MATMUL, CPU)
    runner = GraphRunner(GraphCompiler.INDUCTOR)
    x, w = torch.randn(64, 16), torch.randn(16, 64)  # 16 KiB per intermediate
    for _ in range(2):
        runner.run(b"matmul", program, [x, w], budget=1 << 20)
    with pytest.raises(NodeFailed) as info:
        runner.run(b"matmul", program, [x, w], budget=1 << 12)
    assert isinstance(info.value.error, torch.OutOfMemoryError)


def test_a_failing_compiled_run_names_its_op_and_the_program_runs_node_by_node_after():
    program = build_program(
        [2, [["aten.embedding.default", [_input(0), _input(1)], {}]], [_node(0)]], CPU
    )
    runner = GraphRunner(GraphCompiler.INDUCTOR)
    weight = torch.randn(10, 4)
    for _ in range(2):
        runner.run(b"embedding", program, [weight, torch.tensor([1, 2])], budget=1 << 20)
    with pytest.raises(NodeFailed) as info:
        runner.run(b"embedding", program, [weight, torch.tensor([1, 99])], budget=1 << 20)
    assert info.value.op == "aten.embedding.default"
    _, compiled = runner.run(b"embedding", program, [weight, torch.tensor([3, 4])], budget=1 << 20)
    assert not compiled


def test_a_program_that_writes_in_place_always_runs_node_by_node():
    program = build_program([1, [["aten.add_.Tensor", [_input(0), 1.0], {}]], []], CPU)
    runner = GraphRunner(GraphCompiler.INDUCTOR)
    x = torch.zeros(3)
    ran_compiled = [runner.run(b"add_", program, [x], budget=1 << 20)[1] for _ in range(3)]
    assert x.tolist() == [3.0, 3.0, 3.0]
    assert ran_compiled == [False, False, False]


def _losses(address: str) -> tuple[list[float], int]:
    with remote.attach(address) as session:
        torch.manual_seed(0)
        model = TinyTransformer(dropout=0.1).to("cumulus")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        forward = torch.compile(model)
        gen = torch.Generator().manual_seed(2)
        losses = []
        for _ in range(4):
            idx = torch.randint(0, 64, (8, 16), generator=gen)
            idx, target = idx.to("cumulus"), torch.roll(idx, -1, dims=1).to("cumulus")
            logits = forward(idx)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, session.stats()["compiled_graph_runs"]


@pytest.mark.slow  # compiles graphs with inductor
@pytest.mark.parametrize("isolation", ["--shared-process", "--worker-per-session"])
def test_an_executor_compiling_its_graphs_trains_as_one_running_them_node_by_node(
    executor_address, isolation
):
    flags = ["--graph-compiler", "inductor", isolation]
    with executor_process(quota="2GiB", extra=flags) as (address, _):
        compiled, compiled_runs = _losses(address)
    node_by_node, no_runs = _losses(executor_address)
    assert compiled == pytest.approx(node_by_node, rel=1e-5)  # dropout draws the same masks
    assert (compiled_runs, no_runs) == (6, 0)  # forward and backward, from the second step


def test_compiled_outputs_laid_out_otherwise_fall_back_to_node_by_node(monkeypatch):
    # A stand-in compiler that returns a copy where the graph returns a view of its input.
    def copying_compiler(gm, **options):
        return lambda *inputs: [out.clone() for out in gm(*inputs)]

    monkeypatch.setattr(graph_compiler.torch, "compile", copying_compiler)
    program = build_program([1, [["aten.t.default", [_input(0)], {}]], [_node(0)]], CPU)
    runner = GraphRunner(GraphCompiler.INDUCTOR)
    x = torch.randn(2, 3)
    results = [runner.run(b"t", program, [x], budget=1 << 20) for _ in range(3)]
    assert [compiled for _, compiled in results] == [False, False, False]
    assert all(out.untyped_storage()._cdata == x.untyped_storage()._cdata for (out,), _ in results)
