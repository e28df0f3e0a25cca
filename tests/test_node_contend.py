"""A bid below the ask: a contending lease at the host's contend price. Real node processes.

The host asks 0.5 per share-hour and sells contending leases at 0.2. A consumer bidding
0.3 with ``--priority contend`` leases there as a contending tenant, trains to a local
run's loss, and both ledgers charge its receipts at 0.2: one price for every contending
tenant (``market/pricing.py`` says why). The host has one on-demand share and one
contending share beyond it: an on-demand job runs beside the contending one, and neither
is preempted. That job pays its bid of 0.6 over the ask (``--pay-bid``), which would rank
it ahead of other on-demand tenants. A bid under the contend price leases nothing: while it
waits its status shows the price that would lease it now, and it ends saying what the
price is. An on-demand bid of 0.3 is told a contending lease would fit. Once the two jobs
end, their service records reach the boot node, whose ``cumulus-node offers`` shows what
each class cleared at beside the ask and the contending floor.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cumulus_p2p.market.ledger import Ledger
from cumulus_p2p.testing import loopback, nodes

# Starts real cumulus-node processes: scripts/test --fast skips it.
pytestmark = pytest.mark.slow

SCRIPT = ["-m", "cumulus_p2p.demo_train", "--steps", "30", "--log-every", "10"]


def share_seconds(data_dir) -> dict[str, int]:
    with Ledger.open(data_dir) as books:
        return {e.receipt_id: e.share_seconds for e in books.entries()}


def cleared(state: dict) -> dict | None:
    """The boot node's price row once both jobs' leases are counted in it and the host's
    shares are free again."""
    rows = [
        r
        for r in state.get("prices", [])
        if r["contend_leases"] and r["on_demand_leases"] and r["ask"] and r["contend_floor"]
    ]
    return rows[0] if rows else None


def test_a_bid_between_the_contend_price_and_the_ask_runs_contending_at_that_price(tmp_path):
    boot = loopback.start_boot(tmp_path)
    host = nodes.start_provider(
        tmp_path / "host", boot.addr, "--price", "0.5", "--contend-price", "0.2",
        "--shares", "1", "--receipt-interval", "1s",
    )  # fmt: skip
    try:
        host.wait_for("1 more shares at 0.200000")
        # Under the contend price: no lease, and the reason names the price on offer.
        cheapskate = nodes.start_consumer(
            tmp_path / "cheapskate", boot.addr, "--priority", "contend", "--max-price", "0.1",
            "--match-timeout", "15s", command=SCRIPT,
        )  # fmt: skip
        # On demand at 0.3: no lease under the ask, and a hint that contending would fit.
        on_demand = nodes.start_consumer(
            tmp_path / "on-demand", boot.addr, "--max-price", "0.3", "--match-timeout", "15s",
            command=SCRIPT,
        )  # fmt: skip
        # While it waits, its status says what would lease it now: the contend price, while
        # the contending share is free (taken, no price would: the jobs below come after).
        waiting = cheapskate.wait_for_state(
            lambda s: (s.get("standing") or {}).get("run_now_price"), timeout=60
        )
        assert waiting["standing"]["run_now_price"] == 200_000
        consumer = nodes.start_consumer(
            tmp_path / "consumer", boot.addr, "--priority", "contend", "--max-price", "0.3",
            command=SCRIPT,
        )  # fmt: skip
        # On demand, paying its bid over the ask: the host's one on-demand share.
        payer = nodes.start_consumer(
            tmp_path / "payer", boot.addr, "--max-price", "0.6", "--pay-bid", command=SCRIPT
        )
        assert cheapskate.proc.wait(timeout=120) != 0
        assert on_demand.proc.wait(timeout=120) != 0
        assert consumer.proc.wait(timeout=180) == 0, consumer.output()
        assert payer.proc.wait(timeout=180) == 0, payer.output()
        # Every node sees what the two leases cleared at, from their service records.
        prices = cleared(boot.wait_for_state(cleared, timeout=60))
        offers = subprocess.run(
            [sys.executable, "-m", "cumulus_p2p.cli", "offers", "--data-dir", str(boot.data_dir)],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    finally:
        for node in (host, boot):
            node.stop()
    local = nodes.local_final_loss(nodes.demo_reference(30))
    assert nodes.final_json(consumer.lines)["final_loss"] == local
    assert nodes.final_json(payer.lines)["final_loss"] == local
    # One lease each: nothing was preempted.
    (paid,) = json.loads((tmp_path / "payer" / "state.json").read_text())["leases"]
    assert paid["price"] == 600_000
    (lease,) = json.loads((tmp_path / "consumer" / "state.json").read_text())["leases"]
    assert lease["price"] == 200_000  # the contend price, whatever its bid above it
    receipted = share_seconds(tmp_path / "consumer")
    both = receipted | share_seconds(tmp_path / "payer")
    assert receipted and both == share_seconds(tmp_path / "host")
    assert lease["cost"] == sum(receipted.values()) * 200_000 // 3600
    assert "lowest contend price: 0.2" in " ".join(cheapskate.output().split())
    hint = "a contending lease fits your limit (--priority contend"
    assert hint in " ".join(on_demand.output().split())
    assert json.loads((tmp_path / "cheapskate" / "state.json").read_text())["leases"] == []
    assert (prices["ask"], prices["contend_floor"]) == (500_000, 200_000)
    assert (prices["on_demand_cleared"], prices["contend_cleared"]) == (600_000, 200_000)
    assert "0.200000 (1)" in offers and "0.600000 (1)" in offers
