"""End to end: real cumulus-node processes on loopback run an unmodified CUDA-style script.

A bootstrap node, two CPU providers at different prices and a consumer whose script
(tests/scripts/cuda_train.py, written with .cuda() and device="cuda") must finish with
exactly the losses of a local CPU run, on the cheaper provider, with the consumer's
ledger holding exactly the receipts the provider holds.

Consumers run their scripts on the native device, the default; the tests of a plain run,
a renewed lease and a killed provider pass ``--python-device``, and each has a native
twin further down.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from cumulus_p2p.market.ledger import Ledger
from cumulus_p2p.testing import loopback, nodes

# Starts real cumulus-node processes: scripts/test --fast skips it.
pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).parent / "scripts"
SCRIPT = SCRIPTS / "cuda_train.py"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    root = tmp_path_factory.mktemp("mesh")
    boot = loopback.start_boot(root)
    providers = {
        price: nodes.start_provider(root / f"p{price}", boot.addr, "--price", price)
        for price in ("0.3", "0.7")
    }
    try:
        for node in providers.values():
            node.wait_for("providing")
        yield root, boot, providers
    finally:
        for node in [*providers.values(), boot]:
            node.stop()


def local_run(epochs: str = "2") -> dict:
    return nodes.local_result(str(SCRIPT), epochs)


def native_local_losses(script: Path, *args: str) -> list[float]:
    """The losses of the native script ``script`` run here on the CPU (``args`` after
    the device)."""
    return nodes.local_result(str(script), "cpu", *args)["losses"]


def finished_consumer(data_dir: Path, boot, *args: str, command: list[str]):
    """A consumer node under ``data_dir`` that ran ``command`` to a clean exit."""
    consumer = nodes.start_consumer(data_dir, boot.addr, *args, command=command)
    assert consumer.proc.wait(timeout=240) == 0, consumer.output()
    return consumer


def receipt_ids(data_dir: Path) -> set[str]:
    return set(bytes_by_receipt(data_dir))


def bytes_by_receipt(data_dir: Path) -> dict[str, int]:
    with Ledger.open(data_dir) as ledger:
        return {e.receipt_id: e.bytes_moved for e in ledger.entries()}


def bytes_moved(data_dir: Path) -> int:
    with Ledger.open(data_dir) as ledger:
        return sum(e.bytes_moved for e in ledger.entries())


def last_json(node) -> dict:
    return json.loads(next(x for x in reversed(node.lines) if x.startswith("{")))


def test_a_cuda_style_script_runs_unchanged_on_the_cheaper_provider_with_matching_books(mesh):
    root, boot, providers = mesh
    # On the Python device; the native device's run is the native test below.
    consumer = finished_consumer(
        root / "consumer",
        boot,
        "--python-device",
        "--max-price",
        "1.0",
        command=[str(SCRIPT), "2"],
    )
    result = last_json(consumer)
    expected = local_run()
    assert result["device"] == "cumulus:0"
    assert result["losses"] == expected["losses"]
    assert result["eval_loss"] == expected["eval_loss"]
    # The providers serve the module's other jobs too: only this job's receipts are compared.
    mine = bytes_by_receipt(root / "consumer")
    cheap, dear = bytes_by_receipt(root / "p0.3"), bytes_by_receipt(root / "p0.7")
    assert mine and mine.items() <= cheap.items()
    assert not mine.keys() & dear.keys()
    assert sum(mine.values()) > 0
    # The consumer countersigned those bytes against its own count of the same frames.
    (lease,) = consumer.state()["leases"]
    assert lease["bytes_counted"] == lease["bytes"] == bytes_moved(root / "consumer")
    assert "total cost" in consumer.output()


def test_a_job_outlasting_its_lease_renews_it_and_finishes_with_the_same_losses(mesh):
    root, boot, _ = mesh
    consumer = finished_consumer(
        root / "renewing",
        boot,
        "--python-device",  # the native device's: the native test below
        "--max-price",
        "1.0",
        "--duration",
        "4s",
        "--checkpoint-interval",
        "1s",
        command=[str(SCRIPT), "3", "0.4"],
    )
    assert last_json(consumer)["losses"] == local_run("3")["losses"]
    state = consumer.state()
    states = [lease["state"] for lease in state["leases"]]
    assert len(states) >= 2 and set(states[:-1]) == {"ended"}, states
    assert all(row["failures"] == 0 for row in state["scores"])


def test_a_job_survives_its_provider_being_killed_and_finishes_on_the_other(tmp_path):
    # The job holds after step 10 until the test lets it go and at once kills its
    # provider: killed mid-training, and never after the job finished.
    gate = tmp_path / "gate"
    script = [str(SCRIPTS / "gated_train.py"), "20", "10", str(gate)]
    with loopback.cheap_and_dear_providers(tmp_path) as (boot, providers):
        consumer = nodes.start_consumer(
            tmp_path / "consumer",
            boot.addr,
            "--python-device",  # the native device's: the native test below
            "--checkpoint-interval",
            "1s",
            command=script,
            env={"CUMULUS_RESUME_TIMEOUT": "1"},
        )
        consumer.wait_for("holding at step 10", timeout=120)
        gate.touch()
        providers[0].proc.kill()
        with nodes.LocalRun(nodes.demo_reference(20)) as local:
            assert consumer.proc.wait(timeout=180) == 0, consumer.output()
            expected = local.final_loss()
    assert last_json(consumer)["final_loss"] == expected
    # No host lends disk for a standby: the checkpoints were on the consumer's disk.
    assert "no standby" in consumer.output()
    assert "checkpoints go to this machine's disk" in consumer.output()
    assert "its state came from the hosts" not in consumer.output()
    state = consumer.state()
    assert [lease["state"] for lease in state["leases"]] == ["failed", "held"]
    assert {lease["role"] for lease in state["leases"]} == {"session"}
    assert state["failovers"] == 1
    gone = state["leases"][0]["host"]
    score = next(row for row in state["scores"] if row["host"] == gone)
    assert score["failures"] > 0
    assert receipt_ids(tmp_path / "p1") <= receipt_ids(tmp_path / "consumer")


def run_one_epoch_through_libp2p(tmp_path: Path, boot, provider) -> None:
    """Run one epoch of the script against ``provider``, the only one on the mesh, and
    check that it went through the consumer node's libp2p door with matching books."""
    try:
        provider.wait_for("providing")
        consumer = finished_consumer(tmp_path / "consumer", boot, command=[str(SCRIPT), "1"])
    finally:
        for node in (provider, boot):
            node.stop()
    assert last_json(consumer)["losses"] == local_run("1")["losses"]
    assert "going through libp2p" in consumer.output()
    assert receipt_ids(tmp_path / "consumer") == receipt_ids(provider.data_dir)


def test_a_provider_whose_session_port_cannot_be_dialed_is_reached_over_libp2p(tmp_path):
    boot = loopback.start_boot(tmp_path)
    # It listens for sessions on 127.0.0.1 but advertises 127.0.0.9, where nothing
    # answers: as a host behind NAT advertising an address nobody can dial.
    provider = nodes.start_provider(
        tmp_path / "natted",
        boot.addr,
        "--session-host",
        "127.0.0.1",
        "--advertise-host",
        loopback.UNDIALABLE_HOST,
    )
    run_one_epoch_through_libp2p(tmp_path, boot, provider)


def test_a_provider_behind_nat_is_leased_and_used_through_a_relay(tmp_path):
    boot = loopback.start_boot(tmp_path)
    # No listen address at all, and a session port nobody can dial: reachable only
    # through the relay reservation it keeps on the bootstrap node.
    provider = loopback.start_hidden_provider(tmp_path / "hidden", boot)
    run_one_epoch_through_libp2p(tmp_path, boot, provider)


#: py-libp2p's warnings about streams between other peers, which used to fill consoles.
LIBP2P_NOISE = ("Failed to read DHT message", "Failed to open stream to", "Error sending ADD_")
LOG_LINE = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL) (\S+): ")


def third_party_lines(output: str) -> list[str]:
    """Console lines that came from a logger other than Cumulus's own."""
    lines = output.splitlines()
    formatted = [x for x in lines if (m := LOG_LINE.match(x)) and not m[2].startswith("cumulus")]
    return formatted + [x for x in lines if x.startswith(LIBP2P_NOISE)]


def test_consoles_show_no_third_party_log_lines_and_the_node_log_keeps_them(mesh):
    root, boot, providers = mesh
    consumer = finished_consumer(root / "quiet", boot, command=[str(SCRIPT), "1"])
    for node in (consumer, boot, *providers.values()):
        assert third_party_lines(node.output()) == [], node.data_dir
        assert (node.data_dir / "node.log").stat().st_size > 0
    # What the consumer's console does show of Cumulus: short lines, marked.
    ours = [x for x in consumer.output().splitlines() if x.startswith("cumulus: ")]
    assert ours[0].startswith("cumulus: leased 1 share(s)")
    assert any(x.startswith("cumulus: receipt 0 from ") for x in ours), ours


def test_a_native_script_trains_on_a_leased_host_with_matching_books(mesh):
    root, boot, providers = mesh
    script = SCRIPTS / "native_train.py"
    consumer = finished_consumer(
        root / "native",
        boot,
        "--max-price",
        "1.0",
        "--native",
        command=[str(script), "cumulus"],
    )
    result = last_json(consumer)
    assert result["device"] == "cumulus:0"
    assert result["losses"] == native_local_losses(script)
    # The provider's receipts count the native session's bytes as the consumer counted them.
    (lease,) = consumer.state()["leases"]
    assert lease["bytes_counted"] == lease["bytes"] == bytes_moved(root / "native") > 0


def test_a_native_job_outlasting_its_lease_resumes_where_it_was_parked(mesh, tmp_path):
    root, boot, _ = mesh
    gate, script = tmp_path / "gate", SCRIPTS / "native_train.py"
    consumer = nodes.start_consumer(
        root / "native-renewing",
        boot.addr,
        "--native",
        "--duration",
        "4s",
        command=[str(script), "cumulus", "4", str(gate)],
    )
    consumer.wait_for("holding", timeout=120)
    time.sleep(5)  # the lease's 4 s run out while the job holds: its host parks it
    gate.touch()
    assert consumer.proc.wait(timeout=180) == 0, consumer.output()
    assert last_json(consumer)["losses"] == native_local_losses(script, "4")
    assert "session resumed on its host" in consumer.output()
    state = consumer.state()
    states = [lease["state"] for lease in state["leases"]]
    assert len(states) >= 2 and set(states[:-1]) == {"ended"}, states


def test_a_native_job_is_replayed_on_another_host_when_its_provider_is_killed(tmp_path):
    # The job holds after its first step; its provider is killed while it holds, so the
    # next step finds the host gone.
    gate, script = tmp_path / "gate", SCRIPTS / "native_train.py"
    with loopback.cheap_and_dear_providers(tmp_path) as (boot, providers):
        consumer = nodes.start_consumer(
            tmp_path / "consumer",
            boot.addr,
            "--native",
            command=[str(script), "cumulus", "4", str(gate)],
            env={"CUMULUS_RESUME_TIMEOUT": "1"},
        )
        consumer.wait_for("holding", timeout=120)
        providers[0].proc.kill()
        gate.touch()
        assert consumer.proc.wait(timeout=180) == 0, consumer.output()
    assert last_json(consumer)["losses"] == native_local_losses(script, "4")
    state = consumer.state()
    assert [lease["state"] for lease in state["leases"]] == ["failed", "held"]
    assert state["failovers"] == 1
