"""The demo: a whole Cumulus mesh on loopback, in one command.

Starts real ``cumulus-node`` processes on 127.0.0.1: a bootstrap node, two CPU providers
asking different prices (each also lends disk for standbys), and a consumer that bids,
matches the cheaper provider, leases it and runs an ordinary CUDA-style training script
(``cumulus_p2p.demo_train``) through the torch shim, with the other provider as the
standby that keeps its checkpoints. Midway the demo kills the provider the job runs on
(SIGKILL): the consumer re-matches to the other one and the job resumes from the
checkpoint that host already keeps. At
the end it shows the consumer's cost and receipts next to each provider's, and checks
that the loss equals a local CPU run of the same script.

    python -m cumulus_p2p.demo [--steps 60] [--no-kill]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from .market.ledger import Ledger
from .node import views
from .testing.nodes import (
    LOOPBACK_LISTEN,
    NodeProcess,
    start_consumer,
    start_node,
    start_provider,
)

PRICES = {"provider-a": "0.40", "provider-b": "0.60"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="cumulus-demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    parser.add_argument(
        "--no-kill", action="store_true", help="let the first provider live (no failover)"
    )
    args = parser.parse_args(argv)
    # Every process of the mesh shares this machine's cores: OpenMP's idle threads in
    # one torch process spinning would take the cores the others wait for (the tests
    # measured a load like this one run 2.7x faster passive). The nodes inherit it.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    console = Console()
    with tempfile.TemporaryDirectory(prefix="cumulus-demo-") as tmp:
        return Demo(Path(tmp), console, args.steps, kill=not args.no_kill).run()


class Demo:
    def __init__(self, root: Path, console: Console, steps: int, *, kill: bool) -> None:
        self.root, self.console, self.steps, self.kill = root, console, steps, kill
        self.nodes: dict[str, NodeProcess] = {}

    def run(self) -> int:
        try:
            local = self.train_locally()
            self.start_mesh()
            remote, failover_s = self.consume()
            self.show_books()
        finally:
            for node in self.nodes.values():
                node.stop()
        return self.verdict(local, remote, failover_s)

    def train_locally(self) -> dict:
        with self.console.status("training the script locally on the CPU, for reference..."):
            out = subprocess.run(self.script(), capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    def script(self) -> list[str]:
        return [sys.executable, "-m", "cumulus_p2p.demo_train", "--steps", str(self.steps)]

    def start_mesh(self) -> None:
        with self.console.status("starting a bootstrap node and two CPU providers..."):
            boot = start_node(self.root / "bootstrap", "--listen", LOOPBACK_LISTEN)
            self.nodes["bootstrap"] = boot
            for name, price in PRICES.items():
                self.nodes[name] = start_provider(
                    self.root / name,
                    boot.addr,
                    "--price",
                    price,
                    "--storage-gib",
                    "1",
                    "--storage-price",
                    "0.01",
                    receipt_interval="3s",
                    perf_units=None,  # the demo shows each node's own self benchmark
                    bench_seconds="0.2",
                )
            for name in PRICES:
                self.nodes[name].wait_for("providing")
        table = Table(title="the mesh (all on 127.0.0.1)")
        table.add_column("node")
        table.add_column("price/share-hour")
        table.add_column("address")
        table.add_row("bootstrap", "", boot.addr)
        for name, price in PRICES.items():
            table.add_row(name, price, self.nodes[name].addr)
        self.console.print(table)

    def consume(self) -> tuple[dict, float | None]:
        boot = self.nodes["bootstrap"].addr
        consumer = start_consumer(
            self.root / "consumer",
            boot,
            "--max-price",
            "1.0",
            "--checkpoint-interval",
            "2s",
            "--standby-gib",
            "1",
            command=self.script()[1:],
            env={"CUMULUS_RESUME_TIMEOUT": "2"},
        )
        self.nodes["consumer"] = consumer
        self.console.print(
            "consumer: bidding at most 1.0/share-hour, checkpoints to a standby host..."
        )
        leased = consumer.wait_for("leased", timeout=60)
        self.console.print(leased.strip(), highlight=False)
        self._printed = 0
        failover_s = None
        if self.kill:
            self._echo_until(consumer, f"step {self.steps // 2 - self.steps // 2 % 5:4d}")
            victim = next(n for n in PRICES if _short_in(self.nodes[n].addr, leased))
            self.console.print(f"[red]killing {victim} (SIGKILL) in the middle of training[/red]")
            killed_at = time.monotonic()
            self.nodes[victim].proc.send_signal(signal.SIGKILL)
            self.nodes[victim].proc.wait()
            self._echo_until(consumer, "step")
            failover_s = time.monotonic() - killed_at
            moved = next((x for x in consumer.lines if "session moved" in x), None)
            if moved is not None:
                self.console.print("  " + moved.strip(), highlight=False)
        self._echo_until(consumer, None)
        result = json.loads(next(x for x in reversed(consumer.lines) if x.startswith("{")))
        return result, failover_s

    def _echo_until(self, consumer: NodeProcess, text: str | None, timeout: float = 180) -> None:
        """Show the script's progress lines as they come, until one contains ``text``
        (``None``: until the consumer's output ends)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ended = consumer.drained.is_set()  # checked first: no line arrives after it
            for line in consumer.lines[self._printed :]:
                self._printed += 1
                if line.startswith("step"):
                    self.console.print("  " + line.rstrip(), highlight=False)
                if text is not None and text in line:
                    return
            if ended and text is None:
                return
            if ended:
                raise RuntimeError(f"the consumer ended early:\n{consumer.output()}")
            time.sleep(0.05)
        raise TimeoutError(f"the consumer stalled:\n{consumer.output()}")

    def show_books(self) -> None:
        with Ledger.open(self.root / "consumer") as ledger:
            entries = list(ledger.entries())
        self.console.print(views.ledger_table(entries))
        table = Table(title="receipts per node")
        table.add_column("node")
        table.add_column("receipts")
        table.add_column("share- or GiB-seconds")
        for name in ["consumer", *PRICES]:
            with Ledger.open(self.root / name) as ledger:
                mine = list(ledger.entries())
            table.add_row(name, str(len(mine)), str(sum(e.share_seconds for e in mine)))
        self.console.print(table)
        for line in self.nodes["consumer"].lines:
            if line.startswith("total cost"):
                self.console.print(line.rstrip(), highlight=False)

    def verdict(self, local: dict, remote: dict, failover_s: float | None) -> int:
        # The providers run here with --device auto: on CUDA when this machine has it.
        exact = not _cuda_here()
        same = losses_agree(local["final_loss"], remote["final_loss"], exact=exact)
        if failover_s is not None:
            self.console.print(f"failover: the job ran on within {failover_s:.1f}s of the kill")
        self.console.print(
            f"final loss: local CPU {local['final_loss']:.6f}, through the "
            f"mesh {remote['final_loss']:.6f}",
            highlight=False,
        )
        how = "exactly" if exact else f"within {LOSS_RTOL:.0%} (CPU against GPU)"
        self.console.print(
            f"[green]the job finished with a local run's loss, {how}[/green]"
            if same
            else f"[red]the losses differ (compared {how})[/red]"
        )
        return 0 if same else 1


#: How far a GPU provider's final loss may stray from the local CPU run's: the two devices
#: sum in different orders, and a few hundred steps of training magnify that.
LOSS_RTOL = 1e-2


def losses_agree(local: float, remote: float, *, exact: bool) -> bool:
    """Exactly equal when both ran on CPUs (the executor draws the CPU's random stream and
    runs the same kernels), within ``LOSS_RTOL`` when the provider computed on a GPU."""
    return local == remote if exact else math.isclose(local, remote, rel_tol=LOSS_RTOL)


def _cuda_here() -> bool:
    import torch

    return torch.cuda.is_available()


def _short_in(addr: str, line: str) -> bool:
    peer = addr.split("/")[-1]
    return views.short(peer) in line


if __name__ == "__main__":
    raise SystemExit(main())
