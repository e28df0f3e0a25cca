"""Churn the mesh survives (issue 37): hosts that fail are set aside, not banned.

Real ``cumulus-node`` processes on loopback: a bootstrap node, three CPU providers and a
consumer training through them. Six times over, the provider holding the lease is
SIGKILLed; it restarts with the same data directory, as a rebooted rig would, two kills
later. So at each kill one other host is up and the order of hosts is fixed (a, b, c,
a, b, c), however fast a node restarts and re-announces. A consumer that banned each
host after one failure ran out of hosts at the fourth kill; this one sets a failed host
aside for a backoff and takes it back once it announces again, so the job finishes with
the loss of a local run, and every receipt a provider kept is in the consumer's ledger.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cumulus_p2p.market.ledger import Ledger
from cumulus_p2p.testing.churn import STARTUP_S, open_provider_pool
from cumulus_p2p.testing.nodes import LocalRun, NodeProcess, demo_reference, final_json

pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).parent / "scripts"
PRICES = {"a": "0.4", "b": "0.5", "c": "0.6"}
STEPS = 28
#: The job is held after each of these steps while the test kills its host.
HOLDS = (4, 8, 12, 16, 20, 24)


def receipts(data_dir: Path) -> dict[str, str]:
    """Receipt id -> the host that issued it, from a node's ledger."""
    with Ledger.open(data_dir) as ledger:
        return {e.receipt_id: e.host for e in ledger.entries()}


def test_a_job_survives_each_of_its_hosts_killed_and_restarted_twice(tmp_path):
    killed: list[str] = []
    restarted: list[NodeProcess] = []
    with open_provider_pool(tmp_path, PRICES) as pool:
        gates = tmp_path / "gates"
        gates.mkdir()
        script = [str(SCRIPTS / "multi_gated_train.py"), str(STEPS)]
        script += [",".join(map(str, HOLDS)), str(gates)]
        # A failed host is set aside for 3 s, then 6 s (not 15 s, then 30 s, by default).
        consumer = pool.start_consumer(
            "--checkpoint-interval", "1s", "--host-backoff", "3s",
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
            # The host killed two kills ago is back before this kill: it is the one the
            # job can fail over to. Had it come back at once, whether it had announced
            # before the next failover would choose the host (a, b, a, b... or a, b, c...).
            if len(killed) >= 2:
                restarted.append(pool.restart(killed[-2]))
                restarted[-1].wait_for("providing", timeout=STARTUP_S)
            name = pool.holder(state)
            pool.kill(name)
            killed.append(name)
            (gates / str(step)).touch()
        restarted += [pool.restart(name) for name in killed[-2:]]
        # The job may wait for its host's backoff to end: the local run fits in it.
        with LocalRun(demo_reference(STEPS)) as local:
            assert consumer.proc.wait(timeout=600) == 0, consumer.output()
            for node in restarted:
                node.wait_for("providing", timeout=STARTUP_S)
            name_of = pool.name_of
            expected = local.final_loss()
    # Each host was leased again after it had failed: failure set it aside, it was no ban.
    assert killed == ["a", "b", "c", "a", "b", "c"]
    assert final_json(consumer.lines)["final_loss"] == expected
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
