"""Chaos soak: a job on a pool of three providers whose lease holder is killed every N s.

Real ``cumulus-node`` processes on loopback: a bootstrap node, three CPU providers
(prices 0.4, 0.5, 0.6) and a consumer training the demo model with checkpoints. Every
``--every`` seconds the provider holding the lease is SIGKILLed and restarted
``--restart-after`` seconds later on the same data directory, as a rebooted rig would be,
until ``--kills`` kills. Then the job runs to its end.

Prints JSON: ``kills`` done, ``job_completed`` (1 or 0), ``loss_matches_local`` (1 or 0:
the final loss equals a local CPU run's), and ``max_failover_s``: the longest time from a
kill to the session running on a new lease (it includes the resume timeout, after which
a silent host counts as gone, and any wait for a usable host; the consumer's state,
which this reads, is rewritten every second).

Usage: python benchmarks/chaos_bench.py [--quick] [--kills 6] [--every 45]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from cumulus_p2p.testing.nodes import (
    LOOPBACK_LISTEN,
    NodeProcess,
    final_json,
    local_final_loss,
    node_command,
    start_consumer,
    start_node,
    start_process,
)

PRICES = {"a": "0.4", "b": "0.5", "c": "0.6"}


def soak(root: Path, *, steps: int, kills: int, every: float, restart_after: float,
         checkpoint_interval: str, resume_timeout: str) -> dict:  # fmt: skip
    boot = start_node(root / "boot", "--listen", LOOPBACK_LISTEN)

    def provider(name: str) -> NodeProcess:
        # As ``start_provider`` starts one, given longer to start on a loaded machine.
        command = node_command(
            "--data-dir", str(root / name), "--provide", "--listen", LOOPBACK_LISTEN,
            "--bootstrap", boot.addr, "--announce-interval", "1", "--receipt-interval", "1s",
            "--bench-seconds", "0.1", "--no-live", "--price", PRICES[name],
        )  # fmt: skip
        return start_process(command, root / name, listens=False)

    providers = {name: provider(name) for name in PRICES}
    consumer: NodeProcess | None = None
    failovers_s: list[float] = []
    try:
        for node in providers.values():
            node.wait_for("providing", timeout=120)
        name_of = {node.wait_for_state(lambda s: "peer_id" in s)["peer_id"]: name
                   for name, node in providers.items()}  # fmt: skip
        script = ["-m", "cumulus_p2p.demo_train", "--steps", str(steps), "--log-every", "5"]
        consumer = start_consumer(
            root / "consumer", boot.addr, "--checkpoint-interval", checkpoint_interval,
            command=script, env={"CUMULUS_RESUME_TIMEOUT": resume_timeout},
        )  # fmt: skip
        consumer.wait_for_state(lambda s: _running(s, 1), timeout=180)
        next_kill = time.monotonic() + every
        while len(failovers_s) < kills:
            if not _sleep_until(next_kill, consumer):
                break  # the job finished first
            # Read afresh: a probe may have moved the job since (a host judged short of
            # its offer is replaced at once, without a failover).
            state = consumer.wait_for_state(lambda s: _running(s, 1), timeout=600)
            leases = len(state["leases"])
            name = name_of[state["leases"][-1]["host"]]
            providers[name].proc.kill()
            killed_at = time.monotonic()
            providers[name].proc.wait()
            _sleep_until(killed_at + restart_after, consumer)
            providers[name] = provider(name)
            try:
                consumer.wait_for_state(lambda s, n=leases + 1: _running(s, n), timeout=600)
            except TimeoutError:
                break  # the job died or finished without a new lease
            failovers_s.append(time.monotonic() - killed_at)
            next_kill = killed_at + every
        completed = consumer.proc.wait(timeout=900) == 0
    finally:
        for node in [*([consumer] if consumer else []), *providers.values(), boot]:
            node.stop()
    matches = completed and final_json(consumer.lines)["final_loss"] == local_final_loss(script)
    return {
        "kills": len(failovers_s),
        "job_completed": int(completed),
        "loss_matches_local": int(matches),
        "max_failover_s": round(max(failovers_s), 2) if failovers_s else None,
        "failover_s": [round(s, 2) for s in failovers_s],
        "steps": steps,
        "every_s": every,
        "restart_after_s": restart_after,
        "resume_timeout_s": float(resume_timeout),
        "final_failovers": consumer.state().get("failovers") if consumer else None,
    }


def _running(state: dict, leases: int) -> bool:
    """The session runs on lease number ``leases`` (the shim reported its path)."""
    rows = state.get("leases", [])
    return len(rows) >= leases and rows[-1]["state"] == "held" and bool(rows[-1]["path"])


def _sleep_until(when: float, consumer: NodeProcess) -> bool:
    """Wait until ``when``; False at once if the consumer's job ended first."""
    while time.monotonic() < when:
        if consumer.proc.poll() is not None:
            return False
        time.sleep(0.1)
    return True


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="3 kills 8 s apart, restarts after 2 s, a 1 s resume timeout",
    )
    parser.add_argument("--kills", type=int, default=6)
    parser.add_argument("--every", type=float, default=45.0, help="seconds between kills")
    parser.add_argument("--restart-after", type=float, default=10.0)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--checkpoint-interval", default="5s")
    parser.add_argument(
        "--resume-timeout",
        default="10",
        help="seconds a silent host is retried before it counts as gone",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.kills, args.every, args.restart_after = 3, 8.0, 2.0
        args.steps, args.checkpoint_interval, args.resume_timeout = 150, "1s", "1"
    with tempfile.TemporaryDirectory(prefix="chaos-") as root:
        result = soak(
            Path(root), steps=args.steps, kills=args.kills, every=args.every,
            restart_after=args.restart_after, checkpoint_interval=args.checkpoint_interval,
            resume_timeout=args.resume_timeout,
        )  # fmt: skip
    result["quick"] = args.quick
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
