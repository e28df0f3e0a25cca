"""A fast slice of the OpInfo sweep (``benchmarks/opinfo_sweep.py`` runs all of op_db)."""

from __future__ import annotations

import pytest

from cumulus_p2p.testing.scripts import load_script

opinfo_sweep = load_script("benchmarks/opinfo_sweep.py", "opinfo_sweep")

SUBSET = [
    "add",
    "mul",
    "div",
    "sub",
    "matmul",
    "mm",
    "bmm",
    "addmm",
    "sum",
    "mean",
    "amax",
    "softmax",
    "log_softmax",
    "nn.functional.layer_norm",
    "nn.functional.embedding",
    "nn.functional.cross_entropy",
    "nn.functional.gelu",
    "nn.functional.relu",
    "index_select",
    "gather",
    "scatter_add",
    "cat",
    "stack",
    "where",
    "nonzero",
    "masked_select",
    "topk",
    "sort",
    "cumsum",
    "transpose",
    "permute",
    "reshape",
    "expand",
    "clamp",
    "pow",
    "exp",
    "tanh",
    "sigmoid",
]


@pytest.fixture(scope="module")
def op_table():
    from torch.testing._internal.common_methods_invocations import op_db

    return {op.name: op for op in op_db}


@pytest.mark.parametrize("name", SUBSET)
def test_opinfo_samples_match_cpu(cumulus, op_table, name):
    failures: dict = {}
    variants = [op for op in op_table.values() if op.name == name]
    assert variants, f"{name} is not in op_db"
    passed, total = opinfo_sweep.run_op(variants[0], failures)
    assert total > 0
    assert passed == total, failures
