"""A provider stopped with SIGTERM leaves in order (issue 16).

Real ``cumulus-node`` processes on loopback: a bootstrap node, two CPU providers and a
consumer training on the cheaper one. The cheaper provider is sent SIGTERM mid-job: it
tells the consumer it is leaving, so the job moves to the other provider at once, with
no failure report, and finishes with the loss of a local run; the leaving provider
settles its last receipt and exits 0.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from cumulus_p2p.market.ledger import Ledger
from cumulus_p2p.testing import forkstart, freeloader, nodes

# Starts real cumulus-node processes: scripts/test --fast skips it.
pytestmark = pytest.mark.slow

SCRIPT = ["-m", "cumulus_p2p.demo_train", "--steps", "30", "--log-every", "5"]
SCRIPTS = Path(__file__).parent / "scripts"


def receipt_ids(data_dir) -> set[str]:
    with Ledger.open(data_dir) as ledger:
        return {e.receipt_id for e in ledger.entries()}


@pytest.mark.timing  # the job moves within 10 s
def test_a_provider_stopped_with_sigterm_hands_the_job_over_without_blame(tmp_path):
    boot = nodes.start_node(tmp_path / "boot", "--listen", nodes.LOOPBACK_LISTEN)
    cheap, dear = (
        nodes.start_provider(tmp_path / name, boot.addr, "--price", price)
        for name, price in (("cheap", "0.3"), ("dear", "0.7"))
    )
    try:
        for node in (cheap, dear):
            node.wait_for("providing")
        # The job holds after step 10 until the notice came, so it cannot finish first.
        gate = tmp_path / "gate"
        held = [str(SCRIPTS / "gated_train.py"), "30", "10", str(gate)]
        consumer = nodes.start_consumer(
            tmp_path / "consumer", boot.addr, "--checkpoint-interval", "1s", command=held
        )
        consumer.wait_for("holding at step 10", timeout=120)
        seen = len(consumer.lines)
        cheap.proc.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        consumer.wait_for("is leaving", timeout=30, start=seen)
        gate.touch()
        consumer.wait_for("step   15", timeout=60, start=seen)
        moved_after = time.monotonic() - stopped
        assert cheap.proc.wait(timeout=40) == 0, cheap.output()
        assert consumer.proc.wait(timeout=180) == 0, consumer.output()
    finally:
        for node in (cheap, dear, boot):
            node.stop()
    assert "leaving" in cheap.output()
    assert "is leaving" in consumer.output()
    # At once: well inside the 10 s a silent host gets to resume the channel.
    assert moved_after < 10, moved_after
    nodes.assert_local_final_loss(consumer, nodes.demo_reference(30))
    state = json.loads((tmp_path / "consumer" / "state.json").read_text())
    assert [lease["state"] for lease in state["leases"]] == ["left", "held"]
    assert all(row["failures"] == 0 for row in state["scores"])
    assert (
        receipt_ids(tmp_path / "cheap")
        == {r for r in receipt_ids(tmp_path / "consumer") if r in receipt_ids(tmp_path / "cheap")}
        != set()
    )
    assert lease_states(cheap) == ["ended"]


def start_freeloading(tmp_path, *provider_flags: str):
    """A provider serving a consumer that never settles (``testing.freeloader``), so an
    orderly stop would wait on it for the whole settle grace."""
    boot = nodes.start_node(tmp_path / "boot", "--listen", nodes.LOOPBACK_LISTEN)
    provider = nodes.start_provider(
        tmp_path / "provider", boot.addr, "--settle-grace", "60s", *provider_flags
    )
    provider.wait_for("providing")
    freeloading = forkstart.popen(
        freeloader.command(boot.addr, tmp_path / "freeloader", again_after=60),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert freeloading.stdout.readline().startswith("leased")
    provider.wait_for_state(lambda state: "running" in _states(state), timeout=30)
    return boot, provider, freeloading


def _states(state: dict) -> list[str]:
    return [lease["state"] for lease in state.get("leases", [])]


def lease_states(node) -> list[str]:
    return _states(node.state())


def test_a_second_sigterm_stops_a_leaving_provider_at_once(tmp_path):
    boot, provider, freeloader = start_freeloading(tmp_path)
    try:
        provider.proc.send_signal(signal.SIGTERM)
        provider.wait_for("leaving:")
        provider.proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        assert provider.proc.wait(timeout=20) == 0, provider.output()
        assert time.monotonic() - started < 10
        assert "stopping now" in provider.output()
    finally:
        freeloader.kill()
        for node in (provider, boot):
            node.stop()


def test_a_leaving_provider_stops_anyway_after_its_leave_timeout(tmp_path):
    boot, provider, freeloader = start_freeloading(tmp_path, "--leave-timeout", "3s")
    try:
        provider.proc.send_signal(signal.SIGTERM)
        assert provider.proc.wait(timeout=30) == 0, provider.output()
        assert "leaving took over 3 s: stopping now" in provider.output(), provider.output()
    finally:
        freeloader.kill()
        for node in (provider, boot):
            node.stop()
