"""The demo: train a small transformer on a ``cumulus`` device served by a local executor.

Starts a real executor process on loopback, attaches to it, trains the same model on the
local CPU and on ``cumulus``, and shows both side by side. (The mesh demo, with providers,
bids and a market, grows from this one as those parts land.)
"""

from __future__ import annotations

import argparse
import time

from rich.console import Console
from rich.table import Table

import cumulus_p2p.remote as remote
from cumulus_p2p.testing.executor import executor_process
from cumulus_p2p.testing.models import train


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cumulus-demo", description=__doc__)
    parser.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    parser.add_argument("--task", choices=["mlp", "cnn", "transformer"], default="transformer")
    args = parser.parse_args(argv)
    console = Console()
    with console.status("starting a CPU executor on 127.0.0.1 ..."):
        ctx = executor_process(device="cpu")
        address, _ = ctx.__enter__()
    try:
        console.print(f"executor listening on [bold]{address}[/bold]")
        with remote.attach(address) as session:
            console.print(
                f"attached: session {session.info['session']} on {session.info['device']}"
            )
            with console.status(f"training {args.task} locally on the CPU ..."):
                t0 = time.perf_counter()
                local, _ = train(args.task, "cpu", steps=args.steps)
                local_s = time.perf_counter() - t0
            with console.status(f"training {args.task} on the cumulus device ..."):
                t0 = time.perf_counter()
                far, _ = train(args.task, "cumulus", steps=args.steps)
                far_s = time.perf_counter() - t0
            stats = session.stats()
    finally:
        ctx.__exit__(None, None, None)
    table = Table(title=f"{args.task}: {args.steps} Adam steps")
    table.add_column("step", justify="right")
    table.add_column("loss (local CPU)", justify="right")
    table.add_column("loss (cumulus)", justify="right")
    table.add_column("same", justify="center")
    for i, (a, b) in enumerate(zip(local, far, strict=True)):
        table.add_row(str(i + 1), f"{a:.6f}", f"{b:.6f}", "yes" if abs(a - b) <= 1e-5 else "NO")
    console.print(table)
    console.print(
        f"local {local_s:.2f}s, remote {far_s:.2f}s; executor ran {stats['ops']} ops, "
        f"peak {stats['peak_bytes'] / 1024**2:.1f} MiB"
    )
    same = all(abs(a - b) <= 1e-5 for a, b in zip(local, far, strict=True))
    console.print(
        "[green]remote training matches local training[/green]"
        if same
        else "[red]remote and local losses differ[/red]"
    )
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
