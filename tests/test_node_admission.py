"""Freed shares go to the best waiting bid, not the first proposal. Real node processes.

A host has one share at 0.5, held by a job. Two more jobs wait for it: one bidding 0.6
comes first, one bidding 0.9 second. Both bids rest in the book while they wait. When the
first job ends, the host gives the share to the 0.9 bid (``market/admission.py``), and the
0.6 job leases it after that; both finish with a local run's loss.
"""

from __future__ import annotations

import json

import pytest

from cumulus_p2p.testing import loopback, nodes

# Starts real cumulus-node processes: scripts/test --fast skips it.
pytestmark = pytest.mark.slow

PACED = ["-m", "cumulus_p2p.testing.paced_train", "--steps", "20", "--seconds", "12"]
QUICK = ["-m", "cumulus_p2p.demo_train", "--steps", "10", "--log-every", "5"]


def lease_start(data_dir) -> float:
    (lease,) = json.loads((data_dir / "state.json").read_text())["leases"]
    return lease["start_at"]


def waiting(state: dict) -> bool:
    """The job waits for a host: its bid rests in the book."""
    return bool(state.get("waiting_for"))


def test_the_share_freed_goes_to_the_higher_waiting_bid_though_it_came_second(tmp_path):
    boot = loopback.start_boot(tmp_path)
    host = nodes.start_provider(tmp_path / "host", boot.addr, "--price", "0.5", "--shares", "1")
    try:
        host.wait_for("providing")
        holder = nodes.start_consumer(
            tmp_path / "holder", boot.addr, "--max-price", "0.5", command=PACED
        )
        holder.wait_for("step    5", timeout=120)
        cheap = nodes.start_consumer(
            tmp_path / "cheap", boot.addr, "--max-price", "0.6", "--match-timeout", "120s",
            command=QUICK,
        )  # fmt: skip
        cheap.wait_for_state(waiting, timeout=60)
        dear = nodes.start_consumer(
            tmp_path / "dear", boot.addr, "--max-price", "0.9", "--match-timeout", "120s",
            command=QUICK,
        )  # fmt: skip
        dear.wait_for_state(waiting, timeout=60)
        for job in (holder, dear, cheap):
            assert job.proc.wait(timeout=180) == 0, job.output()
    finally:
        for node in (host, boot):
            node.stop()
    assert lease_start(tmp_path / "dear") < lease_start(tmp_path / "cheap")
    local = nodes.local_final_loss(nodes.demo_reference(10))
    assert nodes.final_json(dear.lines)["final_loss"] == local
    assert nodes.final_json(cheap.lines)["final_loss"] == local
