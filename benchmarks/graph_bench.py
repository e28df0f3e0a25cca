"""Executor graph programs: what running a compiled graph node by node costs (issue 13).

Captures the tiny transformer's forward and backward graphs (``capture.py``, on CPU
tensors), sends them through the wire codec, builds the executor's ``GraphProgram`` and
times it against the same graph run as FX-generated Python code (the fastest way to run
those nodes from Python). The difference per node is the program's own cost: argument
filling, intermediate release and quota accounting. It also times the program as
``cumulus-executor --graph-compiler inductor`` runs it (``graph_compiler.py``: compiled
with inductor for this CPU). Prints JSON and writes ``benchmarks/results/graph.json``::

    python benchmarks/graph_bench.py [--runs N]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import msgpack
import torch

from cumulus_p2p.host.graph_compiler import GraphRunner
from cumulus_p2p.host.graphs import build_program
from cumulus_p2p.host.options import GraphCompiler
from cumulus_p2p.remote.capture import capture
from cumulus_p2p.testing.benchargs import median_seconds
from cumulus_p2p.testing.models import TinyTransformer
from cumulus_p2p.wire.graph_def import encode_graph
from cumulus_p2p.wire.protocol import decode_ext, encode_value


def _graphs():
    torch.manual_seed(0)
    model = TinyTransformer(dropout=0.0)
    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    idx = torch.randint(0, 64, (8, 16))

    def step(*tensors):
        state = dict(zip(names, tensors[: len(names)], strict=True))
        return (torch.func.functional_call(model, state, (tensors[-1],)),)

    captured = capture(step, [*params, idx])
    return {"forward": captured.forward, "backward": captured.backward}


def _inputs(values) -> list[torch.Tensor]:
    """Real tensors laid out like the captured ones (saved values can be strided views)."""

    def real(v):
        base = torch.zeros(v.untyped_storage().nbytes() // v.element_size(), dtype=v.dtype)
        if v.dtype.is_floating_point:
            base.normal_()
        return base.as_strided(v.shape, v.stride(), v.storage_offset())

    return [real(v) for v in values]


def _median_us(fn, runs: int) -> float:
    return median_seconds(fn, runs, warmup=1) * 1e6


def _compare(name: str, gm: torch.fx.GraphModule, runs: int) -> dict:
    definition, values, _ = encode_graph(gm)
    wire = msgpack.packb(definition, default=encode_value, strict_types=True)
    program = build_program(msgpack.unpackb(wire, ext_hook=decode_ext), torch.device("cpu"))
    inputs = _inputs(values)
    ours = _median_us(lambda: program.run(inputs, budget=1 << 40), runs)
    fx = _median_us(lambda: gm(*inputs), runs)
    runner = GraphRunner(GraphCompiler.INDUCTOR)
    started = time.perf_counter()
    for _ in range(2):  # node by node first, then the compile and the first compiled run
        runner.run(name.encode(), program, inputs, budget=1 << 40)
    compile_s = time.perf_counter() - started
    inductor = _median_us(lambda: runner.run(name.encode(), program, inputs, 1 << 40), runs)
    nodes = len(program.nodes)
    return {
        f"{name}_inductor_us": round(inductor, 1),
        f"{name}_inductor_first_runs_s": round(compile_s, 2),
        f"{name}_nodes": nodes,
        f"{name}_program_us": round(ours, 1),
        f"{name}_fx_code_us": round(fx, 1),
        f"{name}_overhead_us_per_node": round((ours - fx) / nodes, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200, help="timed runs per graph")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result: dict = {"workload": "transformer_tiny", "threads": 1}
    for name, gm in _graphs().items():
        result |= _compare(name, gm, args.runs)
    print(json.dumps(result, indent=2))
    out = Path(__file__).parent / "results" / "graph.json"
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
