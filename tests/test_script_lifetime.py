"""The script under the shim lives and dies with its consumer node (issue 16).

Real ``cumulus-node`` processes on loopback: a bootstrap node, one provider and a
consumer running a long training script; the consumer node is then stopped the way
systemd, ``kill`` or a crash would stop it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cumulus_p2p.market.ledger import Ledger
from cumulus_p2p.node import control
from cumulus_p2p.testing import nodes
from cumulus_p2p.testing.processes import alive, gone_within

# Starts real cumulus-node processes: scripts/test --fast skips it.
pytestmark = pytest.mark.slow

LONG_JOB = ["-m", "cumulus_p2p.demo_train", "--steps", "100000", "--log-every", "5"]


@pytest.fixture
def mesh(tmp_path):
    with nodes.boot_and_provider(tmp_path) as (boot, provider):
        yield tmp_path, boot, provider


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as listing:
        return [int(p) for p in listing.read().split()]


def receipt_ids(data_dir: Path) -> set[str]:
    with Ledger.open(data_dir) as ledger:
        return {e.receipt_id for e in ledger.entries()}


def _states(state: dict) -> list[str]:
    return [lease["state"] for lease in state.get("leases", [])]


def lease_states(node) -> list[str]:
    return _states(node.state())


def wait_for_leases(node, final: str, timeout: float = 60.0) -> list[str]:
    """The node's lease states once all are ``final``, or as they are at the timeout."""
    with contextlib.suppress(TimeoutError):
        node.wait_for_state(lambda state: set(_states(state)) == {final}, timeout)
    return lease_states(node)


def start_long_job(tmp_path: Path, boot):
    consumer = nodes.start_consumer(tmp_path / "consumer", boot.addr, command=LONG_JOB)
    consumer.wait_for("step   10", timeout=120)
    (script,) = children(consumer.proc.pid)
    return consumer, script


def test_a_consumer_node_stopped_with_sigterm_stops_its_script_and_settles(mesh):
    tmp_path, boot, provider = mesh
    consumer, script = start_long_job(tmp_path, boot)
    consumer.proc.send_signal(signal.SIGTERM)
    assert consumer.proc.wait(timeout=60) == 128 + signal.SIGTERM, consumer.output()
    assert not alive(script)
    assert "stopping the script" in consumer.output()
    assert wait_for_leases(provider, "ended") == ["ended"]
    held = receipt_ids(tmp_path / "consumer")
    assert held and held == receipt_ids(provider.data_dir)


def test_a_consumer_node_killed_with_sigkill_takes_its_script_down(mesh):
    tmp_path, boot, provider = mesh
    consumer, script = start_long_job(tmp_path, boot)
    consumer.proc.kill()
    consumer.proc.wait()
    assert gone_within(script, 15), "the script outlived its node"
    # Its last receipt can never be countersigned: the lease ends unpaid after the
    # grace periods (2 s and 2 s more, at one receipt a second), not at its term.
    assert wait_for_leases(provider, "unpaid", timeout=30) == ["unpaid"]


def test_a_shim_whose_node_is_already_gone_does_not_start_the_script(tmp_path):
    script = tmp_path / "never.py"
    script.write_text("open('ran', 'w').write('yes')\n")
    env = dict(os.environ)
    env[control.ENV_ADDRESS] = "127.0.0.1:9"
    env[control.ENV_TOKEN] = "0" * 32
    env[control.ENV_NODE_PID] = "1"  # not this process's parent: the node is gone
    done = subprocess.run(
        [sys.executable, "-m", "cumulus_p2p.shim", str(script)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "the cumulus-node that started this script is gone" in done.stderr
    assert not (tmp_path / "ran").exists()


def test_status_shows_each_session_at_work_on_both_sides(mesh):
    tmp_path, boot, provider = mesh
    consumer, _ = start_long_job(tmp_path, boot)
    try:
        deadline = time.monotonic() + 30
        while True:
            (row,) = provider.state()["leases"]
            if row.get("ops", 0) > 0 and row.get("memory", 0) > 0:
                break
            assert time.monotonic() < deadline, row
            time.sleep(0.5)
        assert 0 < row["memory"] <= row["quota"] and row["bytes"] > 0
        wide = {**os.environ, "COLUMNS": "200"}
        shown = subprocess.run(
            nodes.node_command("status", "--data-dir", str(provider.data_dir)),
            capture_output=True,
            text=True,
            timeout=60,
            env=wide,
        )
        assert "ops/s" in shown.stdout, shown.stdout
        mine = subprocess.run(
            nodes.node_command("status", "--data-dir", str(tmp_path / "consumer")),
            capture_output=True,
            text=True,
            timeout=60,
            env=wide,
        )
        assert "session path" in mine.stdout and "direct to 127.0.0.1:" in mine.stdout
    finally:
        consumer.proc.kill()
        consumer.proc.wait()
