"""The command line the scripts in ``simulations/`` share: run one scenario, write files."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.markdown import Markdown

from . import attacks, churn, pooling, priority, report, scale

SCENARIOS = {
    "pooling": pooling,
    "priority": priority,
    "churn": churn,
    "attacks": attacks,
    "scale": scale,
}
RESULTS = Path(__file__).resolve().parents[2] / "simulations" / "results"


def scenario_parser(doc: str) -> argparse.ArgumentParser:
    """The flags every scenario's script takes: ``--seed``, ``--quick`` and ``--out``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1, help="the run's seed (default 1)")
    parser.add_argument("--quick", action="store_true", help="the small run the tests use")
    parser.add_argument(
        "--out", type=Path, default=RESULTS, help=f"where results go (default {RESULTS})"
    )
    return parser


def timed(run: Callable[[], dict]) -> dict:
    """``run()``'s result, with the seconds it took as ``runtime_s``."""
    started = time.perf_counter()
    result = run()
    result["runtime_s"] = round(time.perf_counter() - started, 1)
    return result


def run_and_save(
    name: str, args: argparse.Namespace, run: Callable[[], dict], markdown: Callable[[dict], str]
) -> dict:
    """Run a standalone script's scenario (``run()``, ``timed``), write its result as
    ``<name>[_quick].json`` and ``.md`` under ``--out``, print the JSON; returns the result."""
    result = timed(run)
    name += "_quick" if args.quick else ""
    args.out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, indent=2) + "\n"
    (args.out / f"{name}.json").write_text(text)
    (args.out / f"{name}.md").write_text(markdown(result))
    sys.stdout.write(text)
    return result


def main(scenario: str, argv: list[str] | None = None) -> dict:
    """Run ``scenario`` from the command line; returns its result."""
    module = SCENARIOS[scenario]
    args = scenario_parser(module.__doc__).parse_args(argv)
    console = Console()
    with console.status(f"simulating {scenario} (seed {args.seed})..."):
        result = timed(lambda: module.run(args.seed, quick=args.quick))
    paths = report.write(result, args.out)
    console.print(Markdown(paths[-1].read_text().split("\n![")[0]))
    console.print(f"wrote {', '.join(str(p) for p in paths)} in {result['runtime_s']} s")
    return result
