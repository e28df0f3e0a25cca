"""What storing gradients directly saves a compiled backward on the client.

A compiled backward stores each parameter's new gradient as its ``.grad`` itself
(``compiled._accumulate_directly``) where autograd's ``AccumulateGrad`` would do the same
with a ``detach`` per parameter, a dispatch into Python each on cumulus. This trains each
workload with the model and the optimizer step compiled (``step_bench``'s loop, CPU
executor in another process) and alternates rounds with direct accumulation on and off
(autograd's own) in one process, so that drift on this small machine falls on both.
Prints JSON and writes ``benchmarks/results/accumulate.json``::

    python benchmarks/accumulate_bench.py [--quick] [--workloads a,b]

Per workload and arm (``direct`` / ``autograd``): ``<name>_<arm>_client_ms`` (the step's
build, median) and ``<name>_<arm>_backward_ms`` (its backward phase, median).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import step_bench  # noqa: E402

WORKLOADS = ["transformer_tiny", "transformer_bench", "gpt"]


def measure(name: str, rounds: int, steps: int) -> dict:
    from cumulus_p2p.remote import compiled

    arms = {"direct": compiled._accumulate_directly, "autograd": lambda _edges, grads: grads}
    builds: dict[str, list[float]] = {arm: [] for arm in arms}
    backwards: dict[str, list[float]] = {arm: [] for arm in arms}
    far = step_bench.trainer(name, "cumulus", "step")
    for _ in range(4):  # captures and optimizer state
        far()
    try:
        for _ in range(rounds):
            for arm, accumulate in arms.items():
                compiled._accumulate_directly = accumulate
                for _ in range(steps):
                    builds[arm].append(far()[0])
                    backwards[arm].append(far.phases[step_bench.PHASES.index("backward")])
    finally:
        compiled._accumulate_directly = arms["direct"]
    out = {}
    for arm in arms:
        out[f"{name}_{arm}_client_ms"] = round(statistics.median(builds[arm]) * 1e3, 3)
        out[f"{name}_{arm}_backward_ms"] = round(statistics.median(backwards[arm]) * 1e3, 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (within 60 s)")
    parser.add_argument("--workloads", help="comma-separated subset of " + ",".join(WORKLOADS))
    args = parser.parse_args()
    names = args.workloads.split(",") if args.workloads else WORKLOADS
    rounds, steps = (2, 3) if args.quick else (6, 8)

    import cumulus_p2p.remote as remote
    from cumulus_p2p.testing.executor import executor_process

    result: dict = {"rounds": rounds, "steps_per_round": steps}
    with executor_process(quota="64GiB") as (address, _):
        with remote.attach(address):
            for name in names:
                result.update(measure(name, rounds, steps))
                print(f"accumulate_bench: {name} done", file=sys.stderr, flush=True)
    print(json.dumps(result, indent=2))
    if not args.quick:
        out = Path(__file__).parent / "results" / "accumulate.json"
        out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
