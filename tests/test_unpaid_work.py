"""Nothing runs unpaid (issue 16): a host pauses, then ends, a lease its consumer does
not pay for, reports the consumer, and may refuse it afterwards.

Real ``cumulus-node`` processes on loopback: a bootstrap node and a CPU provider that
receipts every second (so it pauses a lease after 2 s unpaid and ends it after 4 s).
The consumer is ``cumulus_p2p.testing.freeloader``: a real consumer process that leases
and computes through the real session channel but never countersigns a receipt.
"""

from __future__ import annotations

import pytest

from cumulus_p2p.testing import forkstart, freeloader, nodes

# Starts real cumulus-node processes: scripts/test --fast skips it.
pytestmark = pytest.mark.slow


@pytest.fixture
def mesh(tmp_path):
    with nodes.boot_and_provider(tmp_path, "--min-consumer-score", "0.3") as (boot, provider):
        yield tmp_path, boot, provider


def run_freeloader(tmp_path, boot) -> list[str]:
    done = forkstart.run(
        freeloader.command(boot.addr, tmp_path / "freeloader", again_after=5), timeout=180
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.splitlines()


def test_a_consumer_that_never_countersigns_is_paused_then_ended_reported_and_refused(mesh):
    tmp_path, boot, provider = mesh
    lines = run_freeloader(tmp_path, boot)
    ended = next(line for line in lines if line.startswith("session ended:"))
    assert "unpaid: the lease is paused" in ended
    resumed = next(line for line in lines if line.startswith("resume"))
    assert resumed.startswith("resume refused:") and "unsettled" in resumed
    again = lines[-1]
    assert again.startswith("lease again refused:") and "payment record" in again
    state = provider.state()
    assert [lease["state"] for lease in state["leases"]] == ["unpaid"]
    consumer = state["leases"][0]["consumer"]
    record = next(row for row in state["scores"] if row["host"] == consumer)
    assert record["failures"] > 0
    assert state["shares_free"] == state["shares_total"]
