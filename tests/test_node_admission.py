"""Freed shares go to the best waiting bid, not the first proposal. Real node processes.

A host has one share at 0.5, held by a job. Two more jobs wait for it: one bidding 0.6
comes first, one bidding 0.9 second. Both bids rest in the book while they wait; the
holding job is let finish only once the host's own book holds both. When it ends, the host
gives the share to the 0.9 bid (``market/admission.py``), and the 0.6 job leases it after
that; both finish with a local run's loss.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cumulus_p2p.testing import loopback, nodes

# Starts real cumulus-node processes: scripts/test --fast skips it.
pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).parent / "scripts"
QUICK = ["-m", "cumulus_p2p.demo_train", "--steps", "10", "--log-every", "5"]


def lease_start(data_dir) -> float:
    (lease,) = json.loads((data_dir / "state.json").read_text())["leases"]
    return lease["start_at"]


def waiting(state: dict) -> bool:
    """The job waits for a host: its bid rests in the book."""
    return bool(state.get("waiting_for"))


def both_bids_rest(state: dict) -> bool:
    return len(state.get("bids", [])) >= 2


def test_the_share_freed_goes_to_the_higher_waiting_bid_though_it_came_second(tmp_path):
    gate = tmp_path / "gate"
    held = [str(SCRIPTS / "gated_train.py"), "20", "5", str(gate)]
    boot = loopback.start_boot(tmp_path)
    host = nodes.start_provider(tmp_path / "host", boot.addr, "--price", "0.5", "--shares", "1")
    try:
        host.wait_for("providing")
        holder = nodes.start_consumer(
            tmp_path / "holder", boot.addr, "--max-price", "0.5", command=held
        )
        holder.wait_for("holding at step 5", timeout=120)
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
        # The host must know of both before the share frees: its book, not the consumers'.
        host.wait_for_state(both_bids_rest, timeout=60)
        gate.touch()
        for job in (holder, dear, cheap):
            assert job.proc.wait(timeout=180) == 0, job.output()
    finally:
        for node in (host, boot):
            node.stop()
    assert lease_start(tmp_path / "dear") < lease_start(tmp_path / "cheap")
    local = nodes.local_final_loss(nodes.demo_reference(10))
    assert nodes.final_json(dear.lines)["final_loss"] == local
    assert nodes.final_json(cheap.lines)["final_loss"] == local
