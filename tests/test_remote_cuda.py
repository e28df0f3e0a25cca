"""The CUDA path, on a machine with a GPU: remote CUDA training matches native CUDA.

Native CUDA runs in a subprocess that never imports ``cumulus_p2p.remote``: a registered
cumulus device would break local CUDA autograd in this one (pytorch/pytorch#161129).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import cumulus_p2p.remote as remote
from cumulus_p2p.channel.transport import SocketFrameChannel
from cumulus_p2p.testing.executor import executor_process
from cumulus_p2p.testing.models import train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def cuda_executor():
    with executor_process(device="cuda", quota="8GiB") as (address, _):
        yield address


def _native(task: str) -> list[float]:
    code = (
        "import json, torch; from cumulus_p2p.testing.models import train; "
        f"print(json.dumps(train({task!r}, 'cuda', steps=4)[0]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("task", ["mlp", "transformer"])
def test_remote_cuda_training_matches_native_cuda(cuda_executor, task):
    with remote.attach(cuda_executor):
        far, _ = train(task, "cumulus", steps=4)
    assert far == pytest.approx(_native(task), rel=1e-5)


def _attention_ops(session, attend) -> int:
    q = torch.randn(2, 4, 64, 32, device="cumulus", requires_grad=True)
    q.sum().item()
    before = session.stats()["ops"]
    attend(q).sum().backward()
    q.grad.sum().item()
    return session.stats()["ops"] - before


def test_attention_runs_as_a_fused_op_on_a_gpu_not_its_math_decomposition(cuda_executor):
    with remote.attach(cuda_executor) as session:
        fused = _attention_ops(
            session,
            lambda q: torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True),
        )
        math = _attention_ops(
            session,
            lambda q: torch.ops.aten._scaled_dot_product_attention_math(q, q, q, None, 0.0, True)[
                0
            ],
        )
    assert fused < math / 2


def test_a_cuda_session_fails_over_through_a_standby(tmp_path):
    """The standby path on GPUs: checkpoint pieces cross to host memory on the primary,
    and land from the fresh host's store into device memory."""

    def gpu_host(name: str):
        extra = ["--blob-dir", str(tmp_path / name)]
        return executor_process(device="cuda", quota="8GiB", extra=extra)

    with gpu_host("primary") as (primary, proc), gpu_host("standby") as (standby, _):
        with gpu_host("fresh") as (fresh, _):
            with remote.attach(fresh):
                reference, _ = train("transformer", "cumulus", steps=8)
            host, port = fresh.split(":")
            attached = remote.attach(
                primary,
                reconnect=lambda: SocketFrameChannel.connect(host, int(port)),
                standby=standby,
            )
            with attached as session:

                def on_step(i: int) -> None:
                    if i == 2:
                        session.checkpoint()
                    if i == 5:
                        proc.kill()
                        proc.wait()

                got, _ = train("transformer", "cumulus", steps=8, on_step=on_step)
                stats = session.failover_statistics()
    assert got == pytest.approx(reference, rel=1e-5)
    assert stats.cold_restores == 1 and stats.restore_pulled_bytes == stats.checkpoint_bytes
