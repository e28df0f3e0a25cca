"""The native device against an executor on CUDA, on a machine with a GPU: training on
``cumulus`` matches native CUDA.

Native CUDA runs in a subprocess of its own, the native device in the suite's native
child process (``testing/native_process.py``), each with a fresh CUDA context.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from cumulus_p2p.testing.native_process import in_native_process

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.native,
    pytest.mark.usefixtures("native_child"),
]


def _native_cuda_losses(task: str, autocast: str | None) -> list[float]:
    code = (
        "import json, torch; from cumulus_p2p.testing.models import train; "
        f"dtype = {autocast!r} and getattr(torch, {autocast!r}); "
        f"print(json.dumps(train({task!r}, 'cuda', steps=4, autocast=dtype)[0]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@in_native_process
def _native_device_losses(task: str, autocast: str | None) -> list[float]:
    from cumulus_p2p.native.session import NativeSession
    from cumulus_p2p.testing.executor import executor_process
    from cumulus_p2p.testing.models import train

    with executor_process(device="cuda", quota="8GiB") as (address, _):
        host, port = address.split(":")
        with NativeSession.connect(host, int(port)):
            dtype = autocast and getattr(torch, autocast)
            return train(task, "cumulus", steps=4, autocast=dtype)[0]


@pytest.mark.parametrize("task", ["mlp", "transformer"])
def test_native_device_training_on_a_cuda_executor_matches_native_cuda(task):
    # The transformer's attention runs the fused kernel the GPU picks, as native CUDA's.
    far = _native_device_losses(task, None)
    assert far == pytest.approx(_native_cuda_losses(task, None), rel=1e-5)


def test_bf16_autocast_on_a_cuda_executor_trains_as_native_cuda():
    # Under bf16 the GPU picks flash attention: its kernel and backward run remotely.
    far = _native_device_losses("transformer", "bfloat16")
    assert far == pytest.approx(_native_cuda_losses("transformer", "bfloat16"), rel=1e-2)
