"""A bid below the ask: a contending lease at the host's contend price. Real node processes.

The host asks 0.5 per share-hour and sells contending leases at 0.2. A consumer bidding
0.3 with ``--priority contend`` leases there as a contending tenant, trains to a local
run's loss, and both ledgers charge its receipts at 0.2: one price for every contending
tenant (``market/pricing.py`` says why). The host has one on-demand share and one
contending share beyond it: an on-demand job paying the ask runs beside the contending
one, and neither is preempted. A bid under the contend price leases nothing: while it
waits its status shows the price that would lease it now, and it ends saying what the
price is. An on-demand bid of 0.3 is told a contending lease would fit.
"""

from __future__ import annotations

import json

import pytest

from cumulus_p2p.market.ledger import Ledger
from cumulus_p2p.testing import loopback, nodes

# Starts real cumulus-node processes: scripts/test --fast skips it.
pytestmark = pytest.mark.slow

SCRIPT = ["-m", "cumulus_p2p.demo_train", "--steps", "30", "--log-every", "10"]


def share_seconds(data_dir) -> dict[str, int]:
    with Ledger.open(data_dir) as books:
        return {e.receipt_id: e.share_seconds for e in books.entries()}


def test_a_bid_between_the_contend_price_and_the_ask_runs_contending_at_that_price(tmp_path):
    boot = loopback.start_boot(tmp_path)
    host = nodes.start_provider(
        tmp_path / "host", boot.addr, "--price", "0.5", "--contend-price", "0.2",
        "--shares", "1", "--receipt-interval", "1s",
    )  # fmt: skip
    try:
        host.wait_for("1 more shares at 0.200000")
        # All at once: the two that bid too little can lease nothing, whenever they come.
        consumer = nodes.start_consumer(
            tmp_path / "consumer", boot.addr, "--priority", "contend", "--max-price", "0.3",
            command=SCRIPT,
        )  # fmt: skip
        # On demand at the ask: the host's one on-demand share, beside the contending one.
        payer = nodes.start_consumer(
            tmp_path / "payer", boot.addr, "--max-price", "0.5", command=SCRIPT
        )
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
        # While it waits, its status says what would lease it now: the contend price.
        waiting = cheapskate.wait_for_state(
            lambda s: (s.get("standing") or {}).get("run_now_price"), timeout=60
        )
        assert waiting["standing"]["run_now_price"] == 200_000
        assert cheapskate.proc.wait(timeout=120) != 0
        assert on_demand.proc.wait(timeout=120) != 0
        assert consumer.proc.wait(timeout=180) == 0, consumer.output()
        assert payer.proc.wait(timeout=180) == 0, payer.output()
    finally:
        for node in (host, boot):
            node.stop()
    local = nodes.local_final_loss(SCRIPT)
    assert nodes.final_json(consumer.lines)["final_loss"] == local
    assert nodes.final_json(payer.lines)["final_loss"] == local
    # One lease each: nothing was preempted.
    (paid,) = json.loads((tmp_path / "payer" / "state.json").read_text())["leases"]
    assert paid["price"] == 500_000
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
