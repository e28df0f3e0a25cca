"""Tenant isolation on a GPU: what only CUDA can do to a worker (issues 12 and 34).

A device-side assert (an out-of-range index) leaves a CUDA context unusable for good:
every later call in that process fails. Each session runs in a worker process of its
own, so the assert ends the hostile session alone; its bystander trains on with correct
results, and the supervisor's pool serves new sessions from fresh workers. The per-worker
allocator cap is the second wall behind the session quota.

Runs only where CUDA exists (the device machine); a CPU cannot raise a device-side
assert, and ``test_worker_isolation`` covers the same path there with a stand-in check.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import cumulus_p2p.remote as remote
from cumulus_p2p._errors import CumulusError, SessionClosedError
from cumulus_p2p.testing.executor import executor_process
from cumulus_p2p.testing.models import train
from cumulus_p2p.testing.tenant import Tenant

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.slow,
]


@pytest.fixture(scope="module")
def cuda_workers():
    """A CUDA executor running each session in a worker process, two kept warm."""
    extra = ["--worker-per-session", "--pool", "2"]
    with executor_process(device="cuda", quota="2GiB", extra=extra) as (address, proc):
        yield address


@pytest.fixture(scope="module")
def reference(cuda_workers):
    with remote.attach(cuda_workers):
        losses, _ = train("mlp", "cumulus", steps=6)
    return losses


def _trigger_device_side_assert(address: str) -> tuple[int, str]:
    """Open a session, index past an embedding's end on the GPU; its worker pid and error."""
    with remote.attach(address) as session:
        weight = torch.randn(4, 2, device="cumulus")
        index = torch.tensor([10]).to("cumulus")
        # The kernel's assert surfaces at the next synchronisation, the .item().
        with pytest.raises(CumulusError) as first:
            torch.nn.functional.embedding(index, weight).sum().item()
        with pytest.raises(SessionClosedError, match="caused by this session"):
            (weight * 2).sum().item()
        return session.info["worker_pid"], str(first.value)


def test_a_device_side_assert_ends_only_the_session_that_caused_it(cuda_workers, reference):
    bystander = Tenant(cuda_workers, "mlp", 6, pause_after=2)
    bystander.wait_paused()
    _, error = _trigger_device_side_assert(cuda_workers)
    print("hostile session's error:", error)
    bystander.go_on()
    assert bystander.finish() == {"losses": reference}


def test_new_sessions_get_a_fresh_worker_after_a_device_side_assert(cuda_workers, reference):
    poisoned_pid, _ = _trigger_device_side_assert(cuda_workers)
    with remote.attach(cuda_workers) as session:
        assert session.info["worker_pid"] != poisoned_pid
        losses, _ = train("mlp", "cumulus", steps=6)
    assert losses == reference


def test_a_session_over_its_quota_is_refused_and_keeps_its_tensors(cuda_workers):
    with remote.attach(cuda_workers):
        kept = torch.ones(1024, device="cumulus")
        with pytest.raises(CumulusError, match="quota"):
            torch.empty(3 << 30, dtype=torch.uint8, device="cumulus").sum().item()
        assert kept.sum().item() == 1024


def test_the_worker_allocator_cap_stops_what_the_quota_would_miss():
    # The cap is per process: measure it in a fresh one, as a worker would set it.
    code = (
        "import torch\n"
        "from cumulus_p2p.host.worker import _cap_device_memory\n"
        "device = torch.device('cuda', 0)\n"
        "_cap_device_memory(device, 1 << 30)\n"
        "held = torch.empty(1 << 30, dtype=torch.uint8, device=device)\n"
        "try:\n"
        "    torch.empty(2 << 30, dtype=torch.uint8, device=device)\n"
        "    print('allocated past the cap')\n"
        "except torch.OutOfMemoryError:\n"
        "    print('capped')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "capped", out.stderr
