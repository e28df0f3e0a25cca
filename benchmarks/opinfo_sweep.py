"""Op coverage: run PyTorch's own OpInfo samples on ``cumulus`` and on the CPU, compare.

Every float32 sample of every op in ``op_db`` that runs on the CPU is run again on a
``cumulus`` device served by a CPU executor process, seeded the same way, and the results
are compared (same structure, dtypes and shapes; values equal within float32 tolerance,
NaNs equal). Writes ``benchmarks/results/opinfo.json`` with ``passed`` and ``total``
(samples) and ``failures`` (per op: count and first error)::

    python benchmarks/opinfo_sweep.py [--ops add,mul,...] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.utils._pytree import tree_flatten, tree_map

import cumulus_p2p.remote as remote
from cumulus_p2p.testing.executor import executor_process


def _to(device: str):
    def move(x):
        return x.to(device) if isinstance(x, torch.Tensor) else x

    return move


def _same(expected, got) -> str | None:
    """None when ``got`` matches ``expected``; otherwise why not."""
    exp_leaves, exp_spec = tree_flatten(expected)
    got_leaves, got_spec = tree_flatten(got)
    if exp_spec != got_spec:
        return f"output structure differs: {exp_spec} vs {got_spec}"
    for e, g in zip(exp_leaves, got_leaves, strict=True):
        if isinstance(e, torch.Tensor):
            if not isinstance(g, torch.Tensor):
                return f"expected a tensor, got {type(g).__name__}"
            if g.device.type != "cpu":
                g = g.cpu()
            try:
                torch.testing.assert_close(g, e, equal_nan=True, check_stride=False)
            except AssertionError as exc:
                return str(exc).splitlines()[0]
        elif e != g and not (e != e and g != g):  # NaN scalars compare equal
            return f"value differs: {e!r} vs {g!r}"
    return None


def run_op(op, failures: dict) -> tuple[int, int]:
    """Run every float32 CPU sample of ``op``; return (passed, total)."""
    passed = total = 0
    try:
        samples = list(op.sample_inputs("cpu", torch.float32, requires_grad=False))
    except Exception:  # an OpInfo that cannot build float32 samples is not a cumulus result
        return 0, 0
    for sample in samples:
        args = (sample.input, *sample.args)
        try:
            torch.manual_seed(0)
            expected = op(*args, **sample.kwargs)
        except Exception:
            continue  # the sample is invalid on the CPU too
        total += 1
        try:
            moved_args = tree_map(_to("cumulus"), args)
            moved_kwargs = tree_map(_to("cumulus"), sample.kwargs)
            torch.manual_seed(0)
            got = op(*moved_args, **moved_kwargs)
            why = _same(expected, tree_map(_to("cpu"), got))
        except Exception as exc:  # any failure on cumulus is a failed sample, with its reason
            why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if why is None:
            passed += 1
        else:
            entry = failures.setdefault(op.full_name, {"failed": 0, "first_error": why[:300]})
            entry["failed"] += 1
    return passed, total


def sweep(address: str, names: set[str] | None, progress: bool) -> dict:
    from torch.testing._internal.common_methods_invocations import op_db

    ops = [op for op in op_db if torch.float32 in op.supported_dtypes("cpu")]
    if names:
        ops = [op for op in ops if op.name in names or op.full_name in names]
    failures: dict = {}
    passed = total = 0
    started = time.perf_counter()
    with remote.attach(address):
        for i, op in enumerate(ops):
            p, t = run_op(op, failures)
            passed, total = passed + p, total + t
            if progress and (i % 25 == 0 or i == len(ops) - 1):
                print(
                    f"[{i + 1}/{len(ops)} ops] {passed}/{total} samples identical "
                    f"({time.perf_counter() - started:.0f}s)",
                    file=sys.stderr,
                    flush=True,
                )
    return {
        "passed": passed,
        "total": total,
        "pass_rate": round(passed / total, 4) if total else 0.0,
        "ops": len(ops),
        "failures": dict(sorted(failures.items())),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ops", help="comma-separated op names (default: all of op_db)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "opinfo.json"))
    args = parser.parse_args()
    names = set(args.ops.split(",")) if args.ops else None
    with executor_process(device="cpu") as (address, _):
        result = sweep(address, names, progress=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    summary = {k: result[k] for k in ("passed", "total", "pass_rate", "ops")}
    summary["failed_ops"] = len(result["failures"])
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
