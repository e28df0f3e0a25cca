"""One process, several devices: ``cumulus:0`` and ``cumulus:1`` on two hosts.

Each spec attaches two real executor processes as the devices of this process. The
executors' links are metered by forwarders (``testing/tap.py``): what crosses them is
what this process sent or read, so a move that crossed them went through this process.
"""

from __future__ import annotations

import pytest
import torch

from cumulus_p2p import cuda_compat, remote
from cumulus_p2p._errors import SessionClosedError
from cumulus_p2p.testing.executor import executor_process
from cumulus_p2p.testing.tap import tap


@pytest.fixture(scope="module")
def two_hosts():
    with executor_process() as (first, _), executor_process() as (second, _):
        yield first, second


@pytest.fixture
def devices(two_hosts):
    """Both hosts attached as ``cumulus:0`` and ``cumulus:1``, through meters."""
    with tap(two_hosts[0]) as first, tap(two_hosts[1]) as second:
        attached = remote.attach([first.address, second.address])
        with attached:
            yield attached.sessions, (first, second)


def pipeline(seed: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(seed)
    first = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh())
    second = torch.nn.Sequential(
        torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1)
    )
    return first, second


def train(first, second, data, devices: tuple[str, str] | None) -> list[float]:
    """SGD steps of the two stages; with ``devices``, each stage on its own."""
    if devices is not None:
        first.to(devices[0])
        second.to(devices[1])
    params = [*first.parameters(), *second.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    losses = []
    for x, y in data:
        if devices is not None:
            x, y = x.to(devices[0]), y.to(devices[1])
        hidden = first(x)
        if devices is not None:
            hidden = hidden.to(devices[1])
        loss = torch.nn.functional.mse_loss(second(hidden), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def batches(steps: int, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [
        (torch.randn(rows, 64, generator=generator), torch.randn(rows, 1, generator=generator))
        for _ in range(steps)
    ]


@pytest.mark.slow
def test_a_model_split_across_two_devices_trains_with_a_local_runs_losses(devices):
    data = batches(steps=12, rows=512)
    local = train(*pipeline(seed=3), data, None)
    sessions, _ = devices
    first, second = pipeline(seed=3)
    remote_losses = train(first, second, data, ("cumulus:0", "cumulus:1"))
    assert remote_losses == pytest.approx(local, abs=1e-6)
    assert first[0].weight.device == torch.device("cumulus:0")
    assert second[0].weight.device == torch.device("cumulus:1")


@pytest.mark.slow
def test_activations_and_their_gradients_move_host_to_host_not_through_this_process(devices):
    sessions, meters = devices
    first, second = pipeline(seed=3)
    first.to("cumulus:0")
    second.to("cumulus:1")
    data = [(x.to("cumulus:0"), y.to("cumulus:1")) for x, y in batches(steps=8, rows=2048)]
    for session in sessions:
        session.synchronize()
    before = sum(m.bytes for m in meters)
    for x, y in data:
        loss = torch.nn.functional.mse_loss(second(first(x).to("cumulus:1")), y)
        loss.backward()
    for session in sessions:
        session.synchronize()
    crossed = sum(m.bytes for m in meters) - before
    moved = 2 * len(data) * 2048 * 256 * 4  # each step: activations forward, gradients back
    assert crossed < moved / 50, f"{crossed} bytes crossed this process's links for {moved} moved"
    assert first[0].weight.grad.abs().sum().item() > 0  # the gradients reached the first host


def test_a_moved_tensor_keeps_its_values_shape_and_strides_order(devices):
    source = torch.arange(24.0).reshape(4, 6)
    on_first = source.to("cumulus:0")
    moved = on_first.t().to("cumulus:1")
    assert moved.device == torch.device("cumulus:1")
    assert torch.equal(moved.cpu(), source.t())
    halved = on_first.to("cumulus:1", torch.float16)
    assert halved.dtype == torch.float16
    assert torch.equal(halved.cpu(), source.half())
    assert torch.equal(moved.to("cumulus:0").cpu(), source.t())


def test_copy_into_a_tensor_on_another_device_moves_the_values(devices):
    target = torch.zeros(3, 5, device="cumulus:1")
    target.copy_(torch.ones(3, 5, device="cumulus:0") * 2)
    assert torch.equal(target.cpu(), torch.full((3, 5), 2.0))


def test_an_op_on_tensors_of_two_devices_is_refused_naming_both(devices):
    a = torch.ones(3, device="cumulus:0")
    b = torch.ones(3, device="cumulus:1")
    with pytest.raises(RuntimeError, match="at least two devices, cumulus:0 and cumulus:1"):
        a + b
    assert torch.equal((a + a).cpu(), torch.full((3,), 2.0))  # neither session is harmed
    assert torch.equal((b * 3).cpu(), torch.full((3,), 3.0))


def test_the_current_device_is_the_one_a_bare_cumulus_names(devices):
    assert torch.cumulus.device_count() == 2
    assert torch.zeros(2, device="cumulus").device == torch.device("cumulus:0")
    torch.cumulus.set_device(1)
    assert torch.cumulus.current_device() == 1
    assert torch.zeros(2, device="cumulus").device == torch.device("cumulus:1")
    assert torch.arange(3, device="cumulus").device == torch.device("cumulus:1")
    torch.cumulus.set_device("cumulus:0")
    assert torch.ones(2, device="cumulus").device == torch.device("cumulus:0")


def test_a_device_that_was_not_attached_is_refused_saying_how_many_were(devices):
    with pytest.raises(RuntimeError, match="cumulus:2 does not exist: this process attached 2"):
        torch.zeros(2, device="cumulus:2")
    with pytest.raises(ValueError, match="cumulus:5 does not exist"):
        torch.cumulus.set_device(5)


def test_each_device_counts_its_own_memory(devices):
    kept = torch.zeros(1024, device="cumulus:1")
    assert torch.cumulus.memory_allocated(1) >= kept.nbytes
    assert torch.cumulus.memory_allocated(0) < kept.nbytes


def test_moves_to_a_host_that_takes_no_peer_links_go_through_this_process(two_hosts):
    with executor_process(extra=["--no-peer-links"]) as (closed, _), tap(closed) as meter:
        with remote.attach([two_hosts[0], meter.address]):
            source = torch.randn(256, 256)
            moved = source.to("cumulus:0").to("cumulus:1")
            assert torch.equal(moved.cpu(), source)
            assert meter.bytes > source.nbytes  # it came through this process's link


def test_failover_is_refused_for_several_devices_saying_why(two_hosts):
    with pytest.raises(ValueError, match="failover is for one device per process yet"):
        remote.attach(list(two_hosts), reconnect=lambda: None)


def test_a_tensor_of_a_detached_device_is_refused_clearly(two_hosts):
    with remote.attach(list(two_hosts)):
        kept = torch.ones(2, device="cumulus:1")
    with pytest.raises(SessionClosedError, match="the session of this cumulus:1 tensor is closed"):
        kept + 1


def test_one_address_is_still_the_one_device_cumulus_0(two_hosts):
    attached = remote.attach(two_hosts[0])
    with attached:
        assert attached.sessions == [attached.session]
        assert torch.cumulus.device_count() == 1
        assert torch.ones(1, device="cumulus").device == torch.device("cumulus:0")


def test_under_cuda_compatibility_each_device_is_a_cuda_device_of_its_index(devices):
    with cuda_compat.cuda_compat():
        assert torch.cuda.device_count() == 2
        layer = torch.nn.Linear(4, 4).to("cuda:1")
        assert layer.weight.device == torch.device("cumulus:1")
        assert torch.ones(2, device="cuda:0").device == torch.device("cumulus:0")
        assert torch.ones(2).cuda(1).device == torch.device("cumulus:1")
        torch.cuda.set_device(1)
        assert torch.cuda.current_device() == 1
        assert torch.zeros(2, device="cuda").device == torch.device("cumulus:1")
        assert torch.cuda.memory_allocated(1) >= layer.weight.nbytes
        torch.cuda.synchronize(1)
        with pytest.raises(ValueError, match="CUDA device 2 does not exist"):
            torch.ones(2, device="cuda:2")
