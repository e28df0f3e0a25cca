"""A job run with ``cumulus-node --consume --checkpoint-to standby``: real node processes.

The consumer node leases a second host to keep the session's checkpoints. The hosts copy
them between themselves over the secure channel, and a failover restores the session
from there: the checkpoints never cross the consumer's link, and the consumer's disk
holds none of them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cumulus_p2p.remote.blobs import is_digest
from cumulus_p2p.testing import loopback, nodes

# Starts real cumulus-node processes: scripts/test --fast skips it.
pytestmark = pytest.mark.slow

SCRIPT = ["-m", "cumulus_p2p.demo_train", "--steps", "30", "--log-every", "5"]


def checkpoint_bytes(consumer_dir) -> int:
    """What the consumer's own checkpoint store holds on disk."""
    root = consumer_dir / "checkpoints"
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) if root.exists() else 0


def test_a_job_whose_host_is_killed_resumes_from_its_standby_and_finishes_the_same(tmp_path):
    boot = loopback.start_boot(tmp_path)
    storage = ("--storage-gib", "8", "--storage-price", "0.01")
    providers = [
        nodes.start_provider(tmp_path / f"p{i}", boot.addr, "--price", price, *storage)
        for i, price in enumerate(("0.3", "0.5", "0.7"))
    ]
    try:
        for node in providers:
            node.wait_for("providing")
        consumer = nodes.start_consumer(
            tmp_path / "consumer",
            boot.addr,
            "--checkpoint-interval",
            "1s",
            "--checkpoint-to",
            "standby",
            command=SCRIPT,
            env={"CUMULUS_RESUME_TIMEOUT": "1"},
        )
        consumer.wait_for("step   10", timeout=120)
        leases = consumer.wait_for_state(lambda s: len(s.get("leases", ())) == 2)["leases"]
        session = next(row for row in leases if row["role"] == "session")
        host = next(p for p in providers if p.state().get("peer_id") == session["host"])
        host.proc.kill()
        assert consumer.proc.wait(timeout=180) == 0, consumer.output()
    finally:
        for node in [*providers, boot]:
            node.stop()
    local = subprocess.run(
        [sys.executable, *SCRIPT], capture_output=True, text=True, check=True, timeout=120
    )
    final = [json.loads(line) for line in consumer.lines if line.startswith("{")][-1]
    assert final["final_loss"] == json.loads(local.stdout.splitlines()[-1])["final_loss"]
    state = json.loads((tmp_path / "consumer" / "state.json").read_text())
    roles = {row["role"]: row for row in state["leases"] if row["state"] != "failed"}
    assert roles["standby"]["host"] != session["host"]
    assert roles["standby"]["price"] == 10_000  # per GiB-hour: a lease of disk, not shares
    assert "its state came from the hosts that keep its checkpoint" in consumer.output()
    assert checkpoint_bytes(tmp_path / "consumer") == 0


def test_a_standby_that_vanishes_is_replaced_and_the_new_one_restores_the_session(tmp_path):
    boot = loopback.start_boot(tmp_path)
    storage = ("--storage-gib", "8", "--storage-price", "0.01")
    providers = [
        nodes.start_provider(tmp_path / f"p{i}", boot.addr, "--price", price, *storage)
        for i, price in enumerate(("0.3", "0.5", "0.7"))
    ]
    by_id = {}
    try:
        for node in providers:
            node.wait_for("providing")
        by_id = {p.wait_for_state(lambda s: "peer_id" in s)["peer_id"]: p for p in providers}
        consumer = nodes.start_consumer(
            tmp_path / "consumer",
            boot.addr,
            "--checkpoint-interval",
            "1s",
            "--checkpoint-to",
            "standby",
            command=["-m", "cumulus_p2p.demo_train", "--steps", "400", "--log-every", "5"],
            env={"CUMULUS_RESUME_TIMEOUT": "1"},
        )
        consumer.wait_for("step    5", timeout=120)
        leases = consumer.wait_for_state(lambda s: len(s.get("leases", ())) == 2)["leases"]
        roles = {row["role"]: row["host"] for row in leases}
        by_id[roles["standby"]].proc.kill()
        replaced = consumer.wait_for_state(
            lambda s: (
                [r["role"] for r in s["leases"] if r["state"] == "held"].count("standby") == 1
                and any(r["state"] == "failed" for r in s["leases"])
            ),
            timeout=120,
        )
        new_standby = next(
            r["host"] for r in replaced["leases"] if r["role"] == "standby" and r["state"] == "held"
        )
        # A checkpoint or two on the new standby (one a second), then the session's host.
        seen = len(consumer.lines)
        consumer.wait_for("step", start=seen, timeout=60)
        time.sleep(2)
        by_id[roles["session"]].proc.kill()
        assert consumer.proc.wait(timeout=180) == 0, consumer.output()
    finally:
        for node in [*providers, boot]:
            node.stop()
    assert new_standby not in roles.values()
    assert "a new standby takes the checkpoints" in consumer.output()
    assert "its state came from the hosts that keep its checkpoint" in consumer.output()
    local = subprocess.run(
        [sys.executable, "-m", "cumulus_p2p.demo_train", "--steps", "400"],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    final = [json.loads(line) for line in consumer.lines if line.startswith("{")][-1]
    assert final["final_loss"] == json.loads(local.stdout.splitlines()[-1])["final_loss"]
    assert checkpoint_bytes(tmp_path / "consumer") == 0


def test_with_no_host_lending_disk_the_checkpoints_stay_on_the_consumer(tmp_path):
    boot = loopback.start_boot(tmp_path)
    providers = [
        nodes.start_provider(tmp_path / f"p{i}", boot.addr, "--price", price)
        for i, price in enumerate(("0.3", "0.5"))
    ]
    try:
        for node in providers:
            node.wait_for("providing")
        consumer = nodes.start_consumer(
            tmp_path / "consumer",
            boot.addr,
            "--checkpoint-interval",
            "1s",
            "--checkpoint-to",
            "standby",
            command=[*SCRIPT[:3], "10"],
        )
        assert consumer.proc.wait(timeout=180) == 0, consumer.output()
    finally:
        for node in [*providers, boot]:
            node.stop()
    assert "checkpoints go to this machine's disk" in consumer.output()
    state = json.loads((tmp_path / "consumer" / "state.json").read_text())
    assert [row["role"] for row in state["leases"]] == ["session"]
    assert checkpoint_bytes(tmp_path / "consumer") > 0


def test_a_second_host_fetches_an_upload_from_the_first_instead_of_the_consumer(tmp_path):
    boot = loopback.start_boot(tmp_path)
    script = [str(Path(__file__).parent / "scripts" / "upload_weights.py")]
    first = nodes.start_provider(tmp_path / "first", boot.addr, "--price", "0.7")
    nodes_up = [boot, first]
    try:
        first.wait_for("providing")
        one = nodes.start_consumer(tmp_path / "one", boot.addr, command=script)
        assert one.proc.wait(timeout=180) == 0, one.output()
        first.wait_for_state(lambda s: s.get("blobs_announced", 0) >= 3)
        # A cheaper host joins: the next consumer leases it, and it has none of them.
        second = nodes.start_provider(tmp_path / "second", boot.addr, "--price", "0.3")
        nodes_up.append(second)
        second.wait_for("providing")
        two = nodes.start_consumer(tmp_path / "two", boot.addr, command=script)
        assert two.proc.wait(timeout=180) == 0, two.output()
    finally:
        for node in nodes_up:
            node.stop()
    result = [json.loads(line) for line in two.lines if line.startswith("{")][-1]
    assert result["sum"] == result["expected"]
    assert result["fetched"] == 48 * 2**20
    (lease,) = json.loads((tmp_path / "two" / "state.json").read_text())["leases"]
    assert lease["host"] == second.state()["peer_id"]
    assert lease["bytes_counted"] < 2**20  # the consumer's link carried digests, not bytes


def test_a_private_jobs_uploads_are_not_kept_by_its_host(tmp_path):
    boot = loopback.start_boot(tmp_path)
    provider = nodes.start_provider(tmp_path / "host", boot.addr, "--price", "0.3")
    script = [str(Path(__file__).parent / "scripts" / "upload_weights.py")]
    try:
        provider.wait_for("providing")
        consumer = nodes.start_consumer(tmp_path / "one", boot.addr, "--private", command=script)
        assert consumer.proc.wait(timeout=180) == 0, consumer.output()
    finally:
        for node in (provider, boot):
            node.stop()
    result = [json.loads(line) for line in consumer.lines if line.startswith("{")][-1]
    assert result["sum"] == result["expected"] and result["fetched"] == 0
    kept = [p for p in (tmp_path / "host" / "blobs").iterdir() if is_digest(p.name)]
    assert kept == []
