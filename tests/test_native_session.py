"""A native session end to end: the device's batches replayed by an executor process.

Each test runs in the native-device child process (``testing/native_process.py``) and
starts its own executor process (``native.host``) on loopback.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cumulus_p2p import native
from cumulus_p2p.testing.native_process import in_native_process, stop_native_process

_MISSING = native.missing_toolchain()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(_MISSING is not None, reason=f"cannot build the native device: {_MISSING}"),
]


@pytest.fixture(scope="module", autouse=True)
def _native_child():
    yield
    stop_native_process()


def _train(device: str, steps: int) -> tuple[list[float], list[torch.Tensor]]:
    """A few seeded Adam steps of a tiny transformer; weights and data made on the CPU."""
    from cumulus_p2p.testing.models import TinyTransformer

    torch.manual_seed(0)
    model = TinyTransformer(vocab=16, dim=8, heads=2, layers=2, ctx=4, dropout=0.0)
    x = torch.randint(0, 16, (2, 4))
    y = torch.roll(x, -1, dims=1)
    model, x, y = model.to(device), x.to(device), y.to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(model(x).reshape(-1, 16), y.reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().cpu() for p in model.parameters()]


@in_native_process
def test_a_tiny_transformer_trains_bit_identically_to_local_cpu():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from cumulus_p2p.native.host import running_host
    from cumulus_p2p.native.session import NativeSession

    with running_host() as (host, port), NativeSession.connect(host, port) as session:
        remote_losses, remote_params = _train("cumulus", steps=4)
        # One flush per sync point: each step's loss.item(), then each parameter's read.
        assert session.flushes == 4 + len(remote_params)
    # The device's SDPA takes the math path (its _fused_sdp_choice runs on meta); local
    # CPU would take flash attention for CPU, whose rounding differs.
    with sdpa_kernel(SDPBackend.MATH):
        local_losses, local_params = _train("cpu", steps=4)
    assert remote_losses == local_losses
    assert local_losses[-1] < local_losses[0]
    for remote, local in zip(remote_params, local_params, strict=True):
        assert torch.equal(remote, local)


@in_native_process
def test_early_flushes_change_nothing_but_when_the_executor_replays():
    from cumulus_p2p.native.host import running_host
    from cumulus_p2p.native.session import NativeSession

    with running_host() as (host, port):
        with NativeSession.connect(host, port) as session:
            synced, _ = _train("cumulus", steps=2)
            sync_flushes = session.flushes
        with NativeSession.connect(host, port, flush_bytes=4096) as session:
            early, _ = _train("cumulus", steps=2)
            assert session.flushes > sync_flushes
    assert early == synced


@in_native_process
def test_readbacks_return_the_executors_bytes():
    from cumulus_p2p.native.host import running_host
    from cumulus_p2p.native.session import NativeSession

    with running_host() as (host, port), NativeSession.connect(host, port):
        a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        x = a.to("cumulus")
        assert torch.equal(x.cpu(), a)
        assert torch.equal(x.t()[1:].cpu(), a.t()[1:])  # a strided view
        assert (x * 2).sum().item() == 132.0
        assert x.to(torch.int64).cpu().dtype == torch.int64
        assert torch.equal((x > 5).cpu(), a > 5)
        assert x.cpu().to(torch.float64).equal(x.to("cpu", torch.float64))


@in_native_process
def test_an_executor_failure_is_raised_at_the_next_readback_and_every_later_one():
    from cumulus_p2p.native.host import running_host
    from cumulus_p2p.native.session import NativeSession, NativeSessionError

    with running_host(quota_bytes=4096) as (host, port), NativeSession.connect(host, port):
        small = torch.ones(4).to("cumulus")
        assert small.sum().item() == 4.0
        torch.empty(2048, device="cumulus")  # 8 KiB: over the quota
        with pytest.raises(NativeSessionError, match="needs 8192 more bytes") as error:
            small.cpu()
        assert error.value.kind == "out_of_memory"
        with pytest.raises(NativeSessionError, match="needs 8192 more bytes"):
            small.sum().item()
