"""Training on ``cumulus`` gives exactly what training on the CPU gives."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from cumulus_p2p.testing.models import train


@pytest.mark.parametrize("task", ["mlp", "cnn", "transformer"])
@pytest.mark.parametrize("foreach", [False, True], ids=["single_tensor", "foreach"])
def test_training_matches_local_cpu(cumulus, task, foreach):
    local_losses, local_params = train(task, "cpu", steps=4, foreach=foreach)
    remote_losses, remote_params = train(task, "cumulus", steps=4, foreach=foreach)

    assert remote_losses == pytest.approx(local_losses, abs=1e-5)
    assert local_params.keys() == remote_params.keys()
    for name, value in local_params.items():
        torch.testing.assert_close(remote_params[name], value, rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.AdamW])
def test_other_optimizers_match_local_cpu(cumulus, optimizer):
    def run(device):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        model = model.to(device)
        opt = optimizer(model.parameters(), lr=0.05, weight_decay=0.01, foreach=True)
        x = torch.linspace(-1, 1, 64).reshape(8, 8).to(device)
        for _ in range(3):
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
        return [p.detach().cpu() for p in model.parameters()]

    for local, remote_ in zip(run("cpu"), run("cumulus"), strict=True):
        torch.testing.assert_close(remote_, local, rtol=0, atol=1e-6)


@pytest.mark.parametrize("task", ["mlp", "cnn", "transformer"])
def test_bfloat16_autocast_on_cumulus_trains_as_cpu_autocast_does(cumulus, task):
    # The casting policy is CUDA's, not the CPU's (losses and norms stay in float32
    # there), so the losses agree to bfloat16's precision, not bit for bit.
    local_losses, _ = train(task, "cpu", steps=4, autocast=torch.bfloat16)
    remote_losses, _ = train(task, "cumulus", steps=4, autocast=torch.bfloat16)
    assert remote_losses == pytest.approx(local_losses, rel=5e-3)


def test_autocast_on_cumulus_needs_no_cuda_compatibility_mode(executor_address):
    script = (
        "import sys, torch; from cumulus_p2p import remote\n"
        f"with remote.attach({executor_address!r}):\n"
        "    x = torch.randn(4, 8, device='cumulus'); w = torch.randn(3, 8, device='cumulus')\n"
        "    with torch.autocast('cumulus', dtype=torch.bfloat16):\n"
        "        y = torch.nn.functional.linear(x, w)\n"
        "        print(y.dtype, torch.softmax(y, -1).dtype, torch.exp(y).dtype)\n"
        "print('cumulus_p2p.remote.cuda_compat' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["torch.bfloat16", "torch.float32", "torch.float32", "False"]
