"""Op coverage: run PyTorch's own OpInfo samples on ``cumulus`` and natively, compare.

Every float32 sample of every op in ``op_db`` that runs on the reference device is run
again on a ``cumulus`` device served by an executor process on that device, seeded the
same way, and the results are compared (same structure, dtypes and shapes; values equal
within float32 tolerance, NaNs equal). ``--device cuda`` puts both the executor and the
reference on CUDA. Writes ``benchmarks/results/opinfo[_cuda].json`` with ``passed`` and
``total`` (samples), ``ops_swept`` (``--budget-s`` can stop early) and ``failures`` (per
op: count and first error). ``--native`` runs the samples on the native C++ device
(``cumulus_p2p.native``) instead of the Python one, and writes ``opinfo_native.json``;
a native session replays nothing after a failed record, so each failure opens a fresh
one::

    python benchmarks/opinfo_sweep.py [--device cpu|cuda] [--native] [--ops add,mul,...]
                                      [--budget-s SECONDS] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.utils._pytree import tree_flatten, tree_map

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
            try:
                torch.testing.assert_close(g.cpu(), e.cpu(), equal_nan=True, check_stride=False)
            except AssertionError as exc:
                return str(exc).splitlines()[0]
        elif e != g and not (e != e and g != g):  # NaN scalars compare equal
            return f"value differs: {e!r} vs {g!r}"
    return None


def _to_cumulus(x):
    # Through the CPU: the client uploads host memory, whatever device a sample was built on.
    return x.cpu().to("cumulus") if isinstance(x, torch.Tensor) else x


class _Attached:
    """The ``cumulus`` device's session with the executor at ``address``: the Python
    device's, or with ``native`` a native one, opened afresh after each failure."""

    def __init__(self, address: str, native: bool) -> None:
        self.address, self.native = address, native
        if native:
            from cumulus_p2p import native as native_device

            native_device.load()
        else:
            import cumulus_p2p.remote as remote

            remote.attach(address)
        self.session = self._open() if native else None

    def _open(self):
        from cumulus_p2p.native.session import NativeSession

        host, _, port = self.address.rpartition(":")
        return NativeSession.connect(host, int(port))

    def failed(self) -> None:
        """A sample failed: a native session starts over (its executor stopped)."""
        if self.native:
            self.session.close()
            self.session = self._open()


def run_op(op, failures: dict, reference: str = "cpu", attached=None) -> tuple[int, int]:
    """Run every float32 sample of ``op`` on ``reference`` and on cumulus; (passed, total)."""
    passed = total = 0
    try:
        samples = list(op.sample_inputs(reference, torch.float32, requires_grad=False))
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
            moved_args = tree_map(_to_cumulus, args)
            moved_kwargs = tree_map(_to_cumulus, sample.kwargs)
            torch.manual_seed(0)
            got = op(*moved_args, **moved_kwargs)
            why = _same(expected, tree_map(_to("cpu"), got))
        except Exception as exc:  # any failure on cumulus is a failed sample, with its reason
            why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if why is None:
            passed += 1
        else:
            if attached is not None:
                attached.failed()
            entry = failures.setdefault(op.full_name, {"failed": 0, "first_error": why[:300]})
            entry["failed"] += 1
    return passed, total


def sweep(
    address: str,
    names: set[str] | None,
    progress: bool,
    reference: str = "cpu",
    budget_s=None,
    native: bool = False,
) -> dict:
    """Every op's samples on ``reference`` and on the session at ``address``; stops at the
    first op that starts after ``budget_s`` seconds (``ops_swept`` says how far it got)."""
    from torch.testing._internal.common_methods_invocations import op_db

    ops = [op for op in op_db if torch.float32 in op.supported_dtypes(reference)]
    if names:
        ops = [op for op in ops if op.name in names or op.full_name in names]
    failures: dict = {}
    passed = total = swept = 0
    started = time.perf_counter()
    attached = _Attached(address, native)
    for i, op in enumerate(ops):
        if budget_s is not None and time.perf_counter() - started > budget_s:
            break
        p, t = run_op(op, failures, reference, attached)
        passed, total, swept = passed + p, total + t, swept + 1
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
        "ops_swept": swept,
        "reference_device": reference,
        "device": "native" if native else "python",
        "failures": dict(sorted(failures.items())),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ops", help="comma-separated op names (default: all of op_db)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--native", action="store_true", help="the native C++ device")
    parser.add_argument("--budget-s", type=float, help="start no new op after this many seconds")
    parser.add_argument("--out", help="default: results/opinfo[_cuda].json")
    args = parser.parse_args()
    names = set(args.ops.split(",")) if args.ops else None
    suffix = ("" if args.device == "cpu" else f"_{args.device}") + (
        "_native" if args.native else ""
    )
    out = args.out or str(Path(__file__).parent / "results" / f"opinfo{suffix}.json")
    with executor_process(device=args.device) as (address, _):
        result = sweep(
            address, names, True, args.device, budget_s=args.budget_s, native=args.native
        )
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    summary = {k: result[k] for k in ("passed", "total", "pass_rate", "ops", "ops_swept")}
    summary["failed_ops"] = len(result["failures"])
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
