"""When the ``cumulus`` device comes into being, and what it carries over.

Each test runs in a fresh interpreter: registration cannot be undone in a process. A
machine with a local GPU is played by replacing ``torch.cuda.is_available`` before the
import (the only thing registration asks of the GPU); the last test runs on a real one.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

# A fresh interpreter importing torch per test: scripts/test --fast skips it.
pytestmark = pytest.mark.slow

WITH_LOCAL_GPU = "import torch; torch.cuda.is_available = lambda: True; "


def _run(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return out.stdout.strip()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a local GPU")
def test_without_a_local_gpu_importing_registers_the_device():
    code = "import torch, cumulus_p2p.remote; print(torch.device('cumulus', 0))"
    assert _run(code) == "cumulus:0"


def test_with_a_local_gpu_importing_leaves_torch_without_a_new_accelerator():
    # A registered PrivateUse1 backend becomes torch's accelerator and breaks local CUDA
    # autograd (pytorch/pytorch#161129): importing must not register it there.
    code = WITH_LOCAL_GPU + (
        "import cumulus_p2p.remote, cumulus_p2p.shim; "
        "print(torch._C._get_privateuse1_backend_name())"
    )
    assert _run(code) == "privateuseone"


def test_with_a_local_gpu_attaching_registers_the_device(executor_address):
    code = WITH_LOCAL_GPU + (
        "import cumulus_p2p.remote as remote; "
        f"remote.attach({executor_address!r}); "
        "print(torch.zeros(2, device='cumulus').device)"
    )
    assert _run(code) == "cumulus:0"


def test_with_a_local_gpu_a_seed_set_before_attaching_reaches_the_device(executor_address):
    # A CPU executor draws the CPU's stream, so the remote draw equals a local one.
    code = WITH_LOCAL_GPU + (
        "import cumulus_p2p.remote as remote; torch.manual_seed(5); "
        f"remote.attach({executor_address!r}); "
        "far = torch.rand(4, device='cumulus').cpu(); torch.manual_seed(5); "
        "print(torch.equal(far, torch.rand(4)))"
    )
    assert _run(code) == "True"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a local CUDA GPU")
def test_local_cuda_training_still_works_after_importing_the_device():
    code = (
        "import torch, cumulus_p2p.remote, cumulus_p2p.shim; "
        "w = torch.randn(8, 8, device='cuda', requires_grad=True); "
        "(w @ w).square().sum().backward(); print(w.grad.device.type)"
    )
    assert _run(code) == "cuda"
