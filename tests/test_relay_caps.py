"""A relayed session outlives the relay's circuit caps (issue 16).

Real ``cumulus-node`` processes on loopback: a bootstrap node that relays circuits for
at most 4 s each, and a provider and a consumer that cannot be dialed (each reachable
only through its relay reservation there). The consumer's training job runs several
times longer than one circuit may last. Each time the relay cuts the circuit, the
consumer node opens a new one and the shim resumes its secure channel over it, as after
any blip: the job finishes with the loss of a local run and no failure report against
the provider.
"""

from __future__ import annotations

import json

import pytest

from cumulus_p2p.market.ledger import Ledger
from cumulus_p2p.testing import loopback, nodes

# Starts real cumulus-node processes: scripts/test --fast skips it.
pytestmark = pytest.mark.slow

SCRIPT = ["-m", "cumulus_p2p.demo_train", "--steps", "300", "--log-every", "50"]


@pytest.mark.timing  # circuits capped at 4 s of wall clock; the workers' load skews them
def test_a_relayed_job_longer_than_the_circuit_cap_finishes_without_blame(tmp_path):
    # The local run the job must match runs while the relay and the provider start, and
    # ends before the job starts: the job's circuits, capped in wall-clock time, never
    # share the cores with it.
    with nodes.LocalRun(nodes.demo_reference(300)) as local:
        boot = loopback.start_boot(tmp_path, "--circuit-duration", "4s")
        provider = loopback.start_hidden_provider(tmp_path / "hidden", boot)
        try:
            provider.wait_for("providing")
            expected = local.final_loss()
            # The consumer cannot be dialed either: every byte between the two goes through
            # circuits on the relay (else the provider would dial the consumer directly).
            consumer = nodes.start_consumer(
                tmp_path / "consumer",
                boot.addr,
                "--listen",
                "none",
                "--relay",
                boot.addr,
                command=SCRIPT,
            )
            assert consumer.proc.wait(timeout=240) == 0, consumer.output()
        finally:
            nodes.stop_all((provider, boot))
    assert nodes.final_json(consumer.lines)["final_loss"] == expected
    state = json.loads((tmp_path / "consumer" / "state.json").read_text())
    assert [lease["state"] for lease in state["leases"]] == ["held"]
    assert all(row["failures"] == 0 for row in state["scores"])
    # The relay did cut the session's circuits, and the consumer opened new ones.
    assert "Circuit duration limit exceeded" in (tmp_path / "boot" / "node.log").read_text()
    assert "opening a new circuit" in (tmp_path / "consumer" / "node.log").read_text()
    with Ledger.open(tmp_path / "consumer") as books:
        held = {e.receipt_id for e in books.entries()}
    with Ledger.open(tmp_path / "hidden") as books:
        assert held == {e.receipt_id for e in books.entries()}
