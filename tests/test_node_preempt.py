"""An on-demand lease preempts an interruptible one, and nothing is lost. Real processes.

The host has one share, sold at 0.5. An interruptible job holds it when an on-demand job
arrives: the host gives the share to the on-demand job, tells the interruptible job's
node (a preemption notice) and parks its session. The interruptible job waits,
unreported, until the share is free again, leases it anew and finishes with a local
run's loss, on the Python device or the native one. Both ledgers agree on every lease.
(A contending lease holds shares of its own, beyond the on-demand ones, so nothing
preempts it: ``test_market_lease.py``.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cumulus_p2p.market.ledger import Ledger
from cumulus_p2p.testing import nodes

# Starts real cumulus-node processes: scripts/test --fast skips it.
pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).parent / "scripts"
QUICK = ["-m", "cumulus_p2p.demo_train", "--steps", "20", "--log-every", "10"]


def receipts(data_dir) -> dict[str, int]:
    with Ledger.open(data_dir) as books:
        return {e.receipt_id: e.share_seconds for e in books.entries()}


@pytest.mark.parametrize("device", ["python", "native"])
def test_an_on_demand_job_preempts_an_interruptible_one_which_resumes_without_loss(
    tmp_path, device
):
    on_device = ["--native"] if device == "native" else ["--python-device"]
    gate = tmp_path / "gate"
    held = [str(SCRIPTS / "gated_train.py"), "60", "5", str(gate)]
    with nodes.boot_and_provider(tmp_path, "--price", "0.5", "--shares", "1") as (boot, _):
        interruptible = nodes.start_consumer(
            tmp_path / "interruptible", boot.addr, *on_device, "--priority", "interruptible",
            "--max-price", "0.5", "--checkpoint-to", "consumer", "--checkpoint-interval", "1s",
            "--wait-for-host", "180s", command=held, env={"CUMULUS_RESUME_TIMEOUT": "1"},
        )  # fmt: skip
        interruptible.wait_for("holding at step 5", timeout=120)
        on_demand = nodes.start_consumer(
            tmp_path / "on-demand", boot.addr, "--max-price", "1", command=QUICK
        )
        # The host's one share went to the on-demand job: the interruptible one was
        # preempted by then, whenever it goes on.
        on_demand.wait_for("leased", timeout=120)
        gate.touch()
        assert on_demand.proc.wait(timeout=180) == 0, on_demand.output()
        assert interruptible.proc.wait(timeout=240) == 0, interruptible.output()
    nodes.assert_local_final_loss(on_demand, nodes.demo_reference(20))
    nodes.assert_local_final_loss(interruptible, nodes.demo_reference(60))
    state = json.loads((tmp_path / "interruptible" / "state.json").read_text())
    states = [lease["state"] for lease in state["leases"]]
    assert states[0] == "preempted", f"{states}: {interruptible.output()}"
    assert all(row["failures"] == 0 for row in state["scores"])  # no blame
    assert "preempted this lease" in interruptible.output()
    if device == "native":  # its host kept the session parked: nothing was restored
        assert "session resumed on its host" in interruptible.output()
    both = receipts(tmp_path / "interruptible") | receipts(tmp_path / "on-demand")
    assert both == receipts(tmp_path / "provider")
