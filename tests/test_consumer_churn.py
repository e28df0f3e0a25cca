"""Churn the mesh survives (issue 37): hosts that fail are set aside, not banned.

Real ``cumulus-node`` processes on loopback: a bootstrap node, three CPU providers and a
consumer training through them. Six times over, the provider holding the lease is
SIGKILLed and restarted with the same data directory, as a rebooted rig would be. A
consumer that banned each host after one failure ran out of hosts at the fourth kill;
this one sets a failed host aside for a backoff and takes it back once it announces
again, so the job finishes with the loss of a local run, and every receipt a provider
kept is in the consumer's ledger.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cumulus_p2p.market.ledger import Ledger
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

pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).parent / "scripts"
PRICES = {"a": "0.4", "b": "0.5", "c": "0.6"}
STEPS = 40
#: The job is held after each of these steps while the test kills its host.
HOLDS = (10, 15, 20, 25, 30, 35)


def receipts(data_dir: Path) -> dict[str, str]:
    """Receipt id -> the host that issued it, from a node's ledger."""
    with Ledger.open(data_dir) as ledger:
        return {e.receipt_id: e.host for e in ledger.entries()}


def restart(tmp_path: Path, boot: NodeProcess, name: str) -> NodeProcess:
    """A provider on ``name``'s data directory (the same key, the same ledger), as
    ``start_provider`` starts one, given longer to start: on a loaded machine a node
    may take over 30 s to import torch and join."""
    command = node_command(
        "--data-dir", str(tmp_path / name), "--provide", "--listen", LOOPBACK_LISTEN,
        "--bootstrap", boot.addr, "--announce-interval", "1", "--receipt-interval", "1s",
        "--bench-seconds", "0.1", "--no-live", "--price", PRICES[name],
    )  # fmt: skip
    node = start_process(command, tmp_path / name, listens=False)
    node.addr = node.wait_for("listening on", timeout=180).split()[-1]
    return node


def test_a_job_survives_each_of_its_hosts_killed_and_restarted_twice(tmp_path):
    boot = start_node(tmp_path / "boot", "--listen", LOOPBACK_LISTEN)
    providers = {name: restart(tmp_path, boot, name) for name in PRICES}
    consumer = None
    killed: list[str] = []
    try:
        for node in providers.values():
            node.wait_for("providing", timeout=180)
        name_of = {node.wait_for_state(lambda s: "peer_id" in s)["peer_id"]: name
                   for name, node in providers.items()}  # fmt: skip
        gates = tmp_path / "gates"
        gates.mkdir()
        script = [str(SCRIPTS / "multi_gated_train.py"), str(STEPS),
                  ",".join(map(str, HOLDS)), str(gates)]  # fmt: skip
        consumer = start_consumer(
            tmp_path / "consumer", boot.addr, "--checkpoint-interval", "1s",
            command=script, env={"CUMULUS_RESUME_TIMEOUT": "1"},
        )  # fmt: skip
        for step in HOLDS:
            consumer.wait_for(f"holding at step {step}", timeout=180)
            # The failover from the last kill is done: state.json, rewritten every
            # second, may still show the host killed then.
            done = len(killed)
            state = consumer.wait_for_state(
                lambda s, n=done: s.get("failovers") == n and s.get("status") == "running"
            )
            name = name_of[state["leases"][-1]["host"]]
            providers[name].proc.kill()
            providers[name].proc.wait()
            killed.append(name)
            providers[name] = restart(tmp_path, boot, name)
            providers[name].wait_for("providing", timeout=180)
            (gates / str(step)).touch()
        assert consumer.proc.wait(timeout=600) == 0, consumer.output()
    finally:
        for node in [*([consumer] if consumer else []), *providers.values(), boot]:
            node.stop()
    assert len(killed) == 6 and set(killed) == set(PRICES), killed
    # A host was leased again after it had failed: failure set it aside, it was no ban.
    assert len(set(killed)) < len(killed)
    assert final_json(consumer.lines)["final_loss"] == local_final_loss(
        ["-m", "cumulus_p2p.demo_train", "--steps", str(STEPS), "--log-every", "5"]
    )
    state = consumer.state()
    assert state["failovers"] == 6
    assert [lease["state"] for lease in state["leases"]] == ["failed"] * 6 + ["held"]
    assert [name_of[lease["host"]] for lease in state["leases"][:6]] == killed
    # The ledgers agree: each receipt a provider kept, the consumer countersigned and
    # kept; the consumer kept none from anyone else.
    mine = receipts(tmp_path / "consumer")
    theirs = {rid: host for name in PRICES for rid, host in receipts(tmp_path / name).items()}
    assert theirs and theirs.items() <= mine.items()
    assert set(mine.values()) <= set(name_of)
