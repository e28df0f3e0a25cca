"""``cumulus-node --consume --gpus N``: a job of N GPUs, one leased host per rank (issue 33).

Real nodes on loopback: a bootstrap node, CPU providers and a consumer running an
unchanged torchrun DDP script (``tests/scripts/ddp_train.py``, written for NCCL and
``cuda:LOCAL_RANK``) with two ranks. Each rank's process attaches to its own lease, and
the gradients are all-reduced between the two hosts.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cumulus_p2p.cli._exits import EXIT_NO_MATCH
from cumulus_p2p.market.ledger import Ledger
from cumulus_p2p.testing import forkstart, loopback, nodes

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "scripts" / "ddp_train.py"
#: A CUDA script that splits its model across cuda:0 and cuda:1, in one process.
PIPELINE = Path(__file__).parent / "scripts" / "pipeline_train.py"
#: The local reference runs' torchrun (``nodes.local_ddp_run``), in the consumer's command.
TORCHRUN = nodes.TORCHRUN_LOCAL
#: Steps and hidden width: a small model, so that the spec waits on nodes, not on compute.
ARGS = ["3", "256"]
#: A job that outlasts leases of a few seconds.
LONG = ["150", "256"]


def start_consumer(tmp_path, boot, *flags: str, command: list[str]) -> nodes.NodeProcess:
    """The job's consumer node. Its ranks start as fresh interpreters, not ``forkexec``
    forks: the shim checks that its parent or grandparent is the node."""
    return nodes.start_consumer(tmp_path / "consumer", boot.addr, *flags, command=command)


def run_job(
    tmp_path, boot, providers, *flags: str, args=ARGS, command: list[str] | None = None
) -> nodes.NodeProcess:
    """Once ``providers`` provide, run the DDP script (``args``) as a job of two GPUs
    (``flags`` added), or ``python *command``, and wait for it to end well; every node is
    stopped on the way out. The DDP script's parameters are in ``leased.pt``
    (``matches_local``)."""
    consumer = None
    try:
        for node in providers:
            node.wait_for("providing")
        if command is None:
            command = [*TORCHRUN, str(SCRIPT), str(tmp_path / "leased.pt"), *args]
        consumer = start_consumer(tmp_path, boot, "--gpus", "2", *flags, command=command)
        assert consumer.proc.wait(timeout=300) == 0, consumer.output()
    finally:
        nodes.stop_all([n for n in (consumer, *providers, boot) if n is not None])
    return consumer


def matches_local(tmp_path, local: Path) -> dict:
    """Check the job's parameters against the local run's; return the local ones."""
    leased, expected = torch.load(tmp_path / "leased.pt"), torch.load(local)
    assert leased.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.allclose(leased[name], value, rtol=0, atol=1e-6), name
    return expected


def test_a_torchrun_ddp_script_on_two_leased_hosts_ends_with_local_gloo_ddps_parameters(
    tmp_path,
):
    # The local run first, alone: two torchrun jobs at once once saw a local rank abort.
    local, _ = nodes.local_ddp_run(SCRIPT, *ARGS, scratch=tmp_path)
    boot = loopback.start_boot(tmp_path)
    # The second rank passes the cheaper host in another region for one near the first's.
    regions = {"near": ("0.3", "eu-west"), "far": ("0.4", "us-east"), "dear": ("0.5", "eu-west")}
    providers = [
        nodes.start_provider(tmp_path / name, boot.addr, "--price", price, "--region", region)
        for name, (price, region) in regions.items()
    ]
    consumer = run_job(tmp_path, boot, providers, "--checkpoint-to", "consumer")
    expected = matches_local(tmp_path, local)
    ids = [p.state()["peer_id"] for p in providers]
    hosts = {ids[0], ids[2]}
    # One lease per rank, each from another host in one region, both receipted.
    state = consumer.state()
    assert state["gpus"] == 2
    assert state["collectives_through_consumer"] is False
    assert state["peer_links"] == "tls"
    assert {lease["host"] for lease in state["leases"]} == hosts
    assert sorted(lease["rank"] for lease in state["leases"]) == [0, 1]
    # The leases table the node prints at its end says which rank each lease serves.
    assert re.search(r"┃ rank\s*┃ lease", consumer.output()), consumer.output()
    with Ledger.open(tmp_path / "consumer") as ledger:
        entries, disputes = list(ledger.entries()), list(ledger.disputes())
    assert {entry.host for entry in entries} == hosts
    # Each host's receipts count the bytes its collectives carried to the other: DDP's
    # broadcast of the parameters at its start, then an all-reduce of the gradients a
    # step, and a few bytes of DDP's own checks at its start (136: the parameters' shapes
    # gathered).
    parameter_bytes = sum(value.nbytes for value in expected.values())
    between = {host: sum(e.peer_bytes for e in entries if e.host == host) for host in hosts}
    for carried in between.values():
        assert 0 <= carried - (int(ARGS[0]) + 1) * parameter_bytes < 1024, between
    # The consumer counted them too, from the collectives its ranks asked for: it
    # countersigned every receipt.
    assert disputes == []


def test_a_job_of_two_gpus_with_a_host_behind_nat_reduces_through_the_consumer(tmp_path):
    local, _ = nodes.local_ddp_run(SCRIPT, *ARGS, scratch=tmp_path)
    boot = loopback.start_boot(tmp_path)
    # The hidden host is reached through the relay on boot alone: the other host could
    # not dial it either.
    providers = [
        nodes.start_provider(tmp_path / "open", boot.addr),
        loopback.start_hidden_provider(tmp_path / "hidden", boot),
    ]
    consumer = run_job(tmp_path, boot, providers, "--checkpoint-to", "consumer")
    matches_local(tmp_path, local)
    assert "take no connections from other hosts" in consumer.output()
    state = consumer.state()
    assert state["collectives_through_consumer"] is True
    assert any("libp2p door" in row["path"] for row in state["leases"]), state["leases"]
    # Nothing went between the hosts: no receipt counts bytes to the other host.
    with Ledger.open(tmp_path / "consumer") as ledger:
        entries = list(ledger.entries())
    assert len({entry.host for entry in entries}) == 2
    assert all(entry.peer_bytes == 0 for entry in entries), entries


def test_a_job_of_two_gpus_leases_both_on_one_rig_before_a_cheaper_single_host(tmp_path):
    local, _ = nodes.local_ddp_run(SCRIPT, *ARGS, scratch=tmp_path)
    boot = loopback.start_boot(tmp_path)
    rig = nodes.start_rig(tmp_path / "rig", boot.addr, devices=2, shares=1)
    single = nodes.start_provider(tmp_path / "single", boot.addr, "--price", "0.3")
    consumer = run_job(tmp_path, boot, [rig, single], "--checkpoint-to", "consumer")
    expected = matches_local(tmp_path, local)
    rig_id = rig.state()["peer_id"]
    # Both ranks on the rig, a device each: their gradients never left the machine.
    leases = consumer.state()["leases"]
    assert [lease["host"] for lease in leases] == [rig_id, rig_id]
    assert len({lease["offer"] for lease in leases}) == 2
    # The rig's workers report what their collectives carried, as a single host does.
    parameter_bytes = sum(value.nbytes for value in expected.values())
    for lease in leases:
        assert lease["peer_bytes"] >= (int(ARGS[0]) + 1) * parameter_bytes, leases


def test_a_job_of_more_gpus_than_hosts_says_each_rank_needs_its_own_host(tmp_path):
    boot = loopback.start_boot(tmp_path)
    provider = nodes.start_provider(tmp_path / "p", boot.addr)
    consumer = None
    try:
        provider.wait_for("providing")
        flags = ["--gpus", "2", "--match-timeout", "5s"]
        command = [*TORCHRUN, str(SCRIPT), str(tmp_path / "leased.pt"), *ARGS]
        consumer = start_consumer(tmp_path, boot, *flags, command=command)
        assert consumer.proc.wait(timeout=120) == EXIT_NO_MATCH, consumer.output()
        # The first rank's lease was given back: the host's shares are all free again,
        # not at the end of the lease's term (an hour).
        provider.wait_for_state(lambda s: s["shares_free"] == s["shares_total"], timeout=10)
    finally:
        nodes.stop_all([n for n in (consumer, provider, boot) if n is not None])
    assert "already serves another rank of this job" in consumer.output()
    assert "running" not in consumer.output()  # the script never started
    assert "lower --gpus" in consumer.output()


def ended(node: nodes.NodeProcess, timeout: float) -> int:
    """``node``'s exit status; a failure showing its output if it runs past ``timeout``."""
    try:
        return node.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running after {timeout} s:\n{node.output()[-8000:]}")


def start_mid_job_kill(tmp_path, boot, providers, flags, args) -> tuple[nodes.NodeProcess, str]:
    """Start the DDP script as a job of two GPUs; once it is training, SIGKILL rank 1's
    host. Returns the consumer and the killed host's peer id."""
    for node in providers:
        node.wait_for("providing")
    peer_ids = [p.wait_for_state(lambda s: "peer_id" in s)["peer_id"] for p in providers]
    command = [*TORCHRUN, str(SCRIPT), str(tmp_path / "leased.pt"), *args]
    consumer = start_consumer(tmp_path, boot, "--gpus", "2", *flags, command=command)
    running = consumer.wait_for_state(
        lambda s: s.get("ops", 0) > 300 and all(row["path"] for row in s["leases"]),
        timeout=120,
    )
    second = next(row["host"] for row in running["leases"] if row["rank"] == 1)
    killed = providers[peer_ids.index(second)]
    killed.proc.kill()
    killed.proc.wait()
    return consumer, second


def test_a_job_of_two_gpus_that_loses_a_host_moves_that_rank_and_ends_as_undisturbed(tmp_path):
    local, _ = nodes.local_ddp_run(SCRIPT, *LONG, scratch=tmp_path)
    boot = loopback.start_boot(tmp_path)
    providers = [nodes.start_provider(tmp_path / f"p{i}", boot.addr) for i in range(3)]
    consumer = None
    try:
        flags = ["--checkpoint-to", "consumer", "--checkpoint-interval", "1s"]
        consumer, killed = start_mid_job_kill(tmp_path, boot, providers, flags, LONG)
        assert ended(consumer, timeout=300) == 0, consumer.output()
    finally:
        nodes.stop_all([n for n in (consumer, *providers, boot) if n is not None])
    matches_local(tmp_path, local)
    # Rank 1 lost its host and moved to the spare; rank 0 went back on its own host,
    # under the lease it had.
    leases = consumer.state()["leases"]
    first = [row for row in leases if row["rank"] == 0]
    second = [(row["host"], row["state"]) for row in leases if row["rank"] == 1]
    assert len(first) == 1 and first[0]["host"] != killed, leases
    assert second[0] == (killed, "failed") and second[-1][0] not in (killed, first[0]["host"])
    # Every host's receipts counted the collectives it ran again, and the consumer, who
    # counted them again too, signed them all.
    with Ledger.open(tmp_path / "consumer") as ledger:
        assert list(ledger.disputes()) == []
    assert consumer.output().count("session moved to") >= 2  # each rank's, said


def test_a_job_of_two_gpus_with_no_spare_host_ends_when_it_stops_waiting_saying_why(tmp_path):
    boot = loopback.start_boot(tmp_path)
    providers = [nodes.start_provider(tmp_path / f"p{i}", boot.addr) for i in range(2)]
    consumer = None
    try:
        flags = ["--checkpoint-to", "consumer", "--wait-for-host", "5s"]
        # Far more steps than the spec waits for: the job is mid-training when a host dies.
        consumer, _ = start_mid_job_kill(tmp_path, boot, providers, flags, ["100000", "256"])
        assert consumer.proc.wait(timeout=120) != 0
    finally:
        nodes.stop_all([n for n in (consumer, *providers, boot) if n is not None])
    # The rank that lost its host said why it gave up, and the other stopped at once.
    assert "3 failover attempts failed" in consumer.output()
    assert "the job's group cannot re-form: rank 1 lost its host and found no other" in (
        consumer.output()
    )
    states = {row["rank"]: row["state"] for row in consumer.state()["leases"]}
    assert states == {0: "held", 1: "failed"}, consumer.output()


def test_a_job_of_two_gpus_outlasting_its_leases_renews_each_where_it_runs(tmp_path):
    boot = loopback.start_boot(tmp_path)
    providers = [nodes.start_provider(tmp_path / f"p{i}", boot.addr) for i in range(2)]
    local, _ = nodes.local_ddp_run(SCRIPT, *LONG, scratch=tmp_path)
    flags = ["--duration", "3s", "--checkpoint-interval", "1s"]
    consumer = run_job(tmp_path, boot, providers, *flags, args=LONG)
    matches_local(tmp_path, local)
    # Each rank renewed its lease at least once, each time with the host its group is on.
    leases = consumer.state()["leases"]
    for rank in (0, 1):
        hosts = [row["host"] for row in leases if row["rank"] == rank]
        assert len(hosts) >= 2 and len(set(hosts)) == 1, leases


def test_one_process_runs_a_model_split_across_two_leased_gpus_with_a_cpu_runs_losses(
    tmp_path,
):
    local = forkstart.run([sys.executable, str(PIPELINE), "4"], cwd=tmp_path, timeout=120)
    assert local.returncode == 0, local.stderr
    boot = loopback.start_boot(tmp_path)
    providers = [nodes.start_provider(tmp_path / f"p{i}", boot.addr) for i in range(2)]
    command = [str(PIPELINE), "4"]
    consumer = run_job(tmp_path, boot, providers, "--checkpoint-to", "consumer", command=command)
    split, reference = nodes.final_json(consumer.lines), nodes.final_json(local.stdout.splitlines())
    assert split["placed"] == ["cumulus:0", "cumulus:1"]  # the script's cuda:0 and cuda:1
    assert split["losses"] == pytest.approx(reference["losses"], abs=1e-6)
    hosts = {p.state()["peer_id"] for p in providers}
    assert {lease["host"] for lease in consumer.state()["leases"]} == hosts
    # The activations went from one host to the other, and back as gradients: both
    # hosts' receipts count those bytes, and the consumer, counting the same, signed.
    with Ledger.open(tmp_path / "consumer") as ledger:
        entries, disputes = list(ledger.entries()), list(ledger.disputes())
    moved = {host: sum(e.peer_bytes for e in entries if e.host == host) for host in hosts}
    assert all(carried >= 4 * 2 * 256 * 128 * 4 for carried in moved.values()), moved
    assert disputes == []
