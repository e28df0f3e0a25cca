"""A host that sells twice its memory: two tenants on one share's worth. Real node processes.

The host splits its device into one share and overcommits it twice (``--overcommit 2``):
it sells two shares of the whole device's memory, and says so in its offer. Two paced
jobs lease one share each and run side by side to a local run's loss, where at 1.0 the
second would wait. (A bid that refuses overcommitted memory: ``test_market_book.py``, and
what its node says: ``test_consumer_no_match.py``.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cumulus_p2p.testing import nodes

# Starts real cumulus-node processes: scripts/test --fast skips it.
pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).parent / "scripts"


def running(state: dict) -> list[dict]:
    return [row for row in state.get("leases", []) if row["state"] == "running"]


def test_an_overcommitted_host_runs_two_tenants_on_one_shares_memory(tmp_path):
    with nodes.boot_and_provider(tmp_path, "--shares", "1", "--overcommit", "2") as (boot, host):
        host.wait_for("2 shares (2x the memory, paged out when idle)")
        # Each job holds at step 5 until the test saw both leases run at once.
        gate = tmp_path / "gate"
        held = [str(SCRIPTS / "gated_train.py"), "20", "5", str(gate)]
        tenants = [
            nodes.start_consumer(tmp_path / name, boot.addr, command=held)
            for name in ("first", "second")
        ]
        state = host.wait_for_state(lambda s: len(running(s)) == 2, timeout=120)
        assert (state["shares_total"], state["overcommit"]) == (2, 2.0)
        gate.touch()
        for tenant in tenants:
            assert tenant.proc.wait(timeout=180) == 0, tenant.output()
    local = nodes.local_final_loss(nodes.demo_reference(20))
    assert [nodes.final_json(t.lines)["final_loss"] for t in tenants] == [local, local]
