"""``cumulus-node --consume --gpus N``: a job of N GPUs, one leased host per rank (issue 33).

Real nodes on loopback: a bootstrap node, two CPU providers and a consumer running an
unchanged torchrun DDP script (``tests/scripts/ddp_train.py``, written for NCCL and
``cuda:LOCAL_RANK``) with two ranks. Each rank's process attaches to its own lease, and
the gradients are all-reduced between the two hosts.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cumulus_p2p.market.ledger import Ledger
from cumulus_p2p.testing import loopback, nodes

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "scripts" / "ddp_train.py"
TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
#: Steps and hidden width: a small model, so that the spec waits on nodes, not on compute.
ARGS = ["3", "256"]


def test_a_torchrun_ddp_script_on_two_leased_hosts_ends_with_local_gloo_ddps_parameters(
    tmp_path,
):
    # The local run first, alone: two torchrun jobs at once once saw a local rank abort.
    local = [sys.executable, *TORCHRUN, str(SCRIPT), str(tmp_path / "local.pt"), *ARGS]
    done = subprocess.run(local, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    boot = loopback.start_boot(tmp_path)
    providers = [
        nodes.start_provider(tmp_path / f"p{i}", boot.addr, "--price", price)
        for i, price in enumerate(("0.3", "0.5"))
    ]
    consumer = None
    try:
        for node in providers:
            node.wait_for("providing")
        flags = ["--gpus", "2", "--python-device", "--checkpoint-to", "consumer"]
        command = [*TORCHRUN, str(SCRIPT), str(tmp_path / "leased.pt"), *ARGS]
        consumer = nodes.start_consumer(tmp_path / "consumer", boot.addr, *flags, command=command)
        assert consumer.proc.wait(timeout=300) == 0, consumer.output()
        hosts = {p.wait_for_state(lambda s: "peer_id" in s)["peer_id"] for p in providers}
    finally:
        nodes.stop_all([n for n in (consumer, *providers, boot) if n is not None])
    leased, expected = torch.load(tmp_path / "leased.pt"), torch.load(tmp_path / "local.pt")
    assert leased.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.allclose(leased[name], value, rtol=0, atol=1e-6), name
    # One lease per rank, each from another host, both receipted in the ledger.
    state = consumer.state()
    assert state["gpus"] == 2
    assert {lease["host"] for lease in state["leases"]} == hosts
    assert len(state["leases"]) == 2
    with Ledger.open(tmp_path / "consumer") as ledger:
        assert {entry.host for entry in ledger.entries()} == hosts
