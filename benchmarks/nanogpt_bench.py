"""nanoGPT under the shim against the same script run natively (issue 34).

``tests/scripts/nanogpt_train.py`` is written for CUDA the way nanoGPT's train.py is. This
runs it twice per arm: natively (a process that never imports cumulus: CUDA on a GPU
machine, the CPU elsewhere) and under ``python -m cumulus_p2p.shim`` against an executor
on the same device. Arms: eager and ``torch.compile(model)``, each in float32 and, on CUDA,
bfloat16 autocast.

Prints JSON and writes ``results/nanogpt[_cuda].json``. Keys, per arm
``<eager|compiled>_<dtype>``:
- ``_native_ms`` / ``_remote_ms``: median step (after two warm-ups, ``loss.item()`` each);
- ``_ratio``: remote over native;
- ``_max_loss_diff``: the largest difference between the two runs' losses.

    python benchmarks/nanogpt_bench.py [--quick] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from cumulus_p2p.shim import ENV_EXECUTOR

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "nanogpt_train.py"


def _run(cmd: list[str], env: dict[str, str]) -> dict:
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"nanogpt_bench: {' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def arm(address: str, steps: int, dtype: str, eager: bool) -> dict:
    """One arm, natively then under the shim; its keys without the arm's prefix."""
    argv = [str(SCRIPT), str(steps), dtype, *(["eager"] if eager else [])]
    env = {k: v for k, v in os.environ.items() if k != ENV_EXECUTOR}
    native = _run([sys.executable, *argv], env)
    remote = _run([sys.executable, "-m", "cumulus_p2p.shim", *argv], env | {ENV_EXECUTOR: address})
    diffs = [abs(a - b) for a, b in zip(native["losses"], remote["losses"], strict=True)]
    return {
        "native_device": native["device"],
        "remote_device": remote["device"],
        "native_ms": native["step_ms"],
        "remote_ms": remote["step_ms"],
        "ratio": round(remote["step_ms"] / native["step_ms"], 3),
        "max_loss_diff": max(diffs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (within 2 min)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    from cumulus_p2p.testing.executor import executor_process

    steps = 12 if args.quick else 50
    dtypes = ["float32", "bfloat16"] if args.device == "cuda" else ["float32"]
    result: dict = {"device": args.device, "steps": steps}
    with executor_process(device=args.device, quota="16GiB") as (address, _):
        for eager in (True, False):
            for dtype in dtypes:
                prefix = f"{'eager' if eager else 'compiled'}_{dtype}_"
                measured = {
                    prefix + key: value for key, value in arm(address, steps, dtype, eager).items()
                }
                result.update(measured)
                # Each arm as it ends: a run cut short still shows what it measured.
                print(f"nanogpt_bench: {json.dumps(measured)}", file=sys.stderr, flush=True)
    print(json.dumps(result, indent=2))
    suffix = "" if args.device == "cpu" else f"_{args.device}"
    out = Path(__file__).parent / "results" / f"nanogpt{suffix}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
