"""CUDA compatibility mode: CUDA-style code runs on the ``cumulus`` device unchanged."""

from __future__ import annotations

import runpy
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import cumulus_p2p.remote as remote
from cumulus_p2p import cuda_compat
from cumulus_p2p._errors import RemoteExecutionError, SessionClosedError
from cumulus_p2p.remote import RemoteTensor
from cumulus_p2p.remote.device import CumulusModule

SCRIPTS = Path(__file__).parent / "scripts"
CUMULUS0 = torch.device("cumulus", 0)


@pytest.fixture
def compat():
    """CUDA compatibility mode on for one test; off (and everything restored) after."""
    cuda_compat.enable()
    yield
    cuda_compat.disable()


def run_script(path: Path, *args: str) -> dict:
    """Run a script as ``__main__`` with ``sys.argv`` set, as ``python path args`` would."""
    saved = sys.argv
    sys.argv = [str(path), *args]
    try:
        return runpy.run_path(str(path), run_name="__main__")
    finally:
        sys.argv = saved


def test_cuda_training_script_matches_the_cpu_bit_for_bit(cumulus, capsys):
    local = run_script(SCRIPTS / "cuda_train.py", "2")
    with cuda_compat.cuda_compat():
        remote_ = run_script(SCRIPTS / "cuda_train.py", "2")
    capsys.readouterr()

    assert local["param_device"] == "cpu"
    assert remote_["param_device"] == "cumulus:0"
    assert remote_["losses"] == local["losses"]
    assert remote_["eval_loss"] == local["eval_loss"]
    assert remote_["peak_memory"] > 0


def test_device_queries_describe_the_session(cumulus, compat):
    assert torch.cuda.is_available()
    assert torch.cuda.is_initialized()
    assert torch.cuda.device_count() == 1
    assert torch.cuda.current_device() == 0
    torch.cuda.set_device(0)
    torch.cuda.set_device("cuda:0")
    assert torch.cuda.get_device_name(0).startswith("cumulus")
    props = torch.cuda.get_device_properties(0)
    assert props.name == torch.cuda.get_device_name()
    assert props.total_memory == cumulus.info["quota"]
    assert torch.cuda.get_device_capability() == (props.major, props.minor)
    assert torch.cuda.is_bf16_supported()


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.ones(2).cuda(),
        lambda: torch.ones(2).cuda(0),
        lambda: torch.ones(2).cuda(device="cuda:0", non_blocking=True),
        lambda: torch.ones(2).to("cuda"),
        lambda: torch.ones(2).to("cuda:0", torch.float16),
        lambda: torch.ones(2).to(device="cuda", dtype=torch.float64),
        lambda: torch.ones(2).to(torch.device("cuda"), non_blocking=True),
        lambda: torch.ones(2).to(torch.ones(1, device="cuda")),
        lambda: torch.ones(2).pin_memory().to("cuda", non_blocking=True),
        lambda: torch.randn(3, device="cuda"),
        lambda: torch.rand(3, device="cuda"),
        lambda: torch.randint(0, 5, (3,), device="cuda"),
        lambda: torch.zeros(2, 3, device="cuda"),
        lambda: torch.ones(4, device=torch.device("cuda", 0)),
        lambda: torch.empty(3, device="cuda", pin_memory=True),
        lambda: torch.full((2,), 7.0, device="cuda"),
        lambda: torch.arange(5, device="cuda"),
        lambda: torch.linspace(0, 1, 5, device="cuda"),
        lambda: torch.eye(3, device="cuda"),
        lambda: torch.tensor([1.0, 2.0], device="cuda"),
        lambda: torch.as_tensor([1.0, 2.0], device="cuda"),
        lambda: torch.zeros(2, device=0),
        lambda: torch.zeros_like(torch.ones(2), device="cuda"),
        lambda: torch.randn_like(torch.ones(2), device="cuda"),
        lambda: torch.full_like(torch.ones(2), 3.0, device="cuda"),
        lambda: torch.ones(2).new_zeros(3, device="cuda"),
        lambda: torch.ones(2).new_tensor([1.0], device="cuda"),
    ],
)
def test_cuda_devices_land_on_cumulus(cumulus, compat, make):
    t = make()
    assert isinstance(t, RemoteTensor)
    assert t.device == CUMULUS0


def test_redirected_tensors_keep_their_values(cumulus, compat):
    assert torch.tensor([[1, 2], [3, 4]], device="cuda").sum().item() == 10
    assert torch.arange(2, 11, 3, device="cuda").tolist() == [2, 5, 8]
    assert torch.ones(3).mul(2).cuda().cpu().tolist() == [2.0, 2.0, 2.0]
    assert torch.ones(2).to("cuda", torch.float16).dtype == torch.float16


@pytest.mark.parametrize("move", [lambda m: m.cuda(), lambda m: m.to("cuda")], ids=["cuda", "to"])
def test_modules_move_parameters_and_buffers(cumulus, compat, move):
    model = move(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)))
    tensors = [*model.parameters(), *model.buffers()]
    assert tensors and all(type(t) is RemoteTensor for t in tensors)
    assert all(isinstance(p, torch.nn.Parameter) for p in model.parameters())


def test_cpu_and_cumulus_devices_are_left_alone(cumulus, compat):
    assert torch.zeros(2, device="cpu").device.type == "cpu"
    assert torch.ones(2, device="cuda").to("cpu").device.type == "cpu"
    assert torch.ones(2).to(torch.float64).device.type == "cpu"
    assert torch.ones(2, device="cumulus").device == CUMULUS0


@pytest.mark.parametrize(
    "call",
    [
        lambda: torch.ones(2).cuda(1),
        lambda: torch.zeros(2, device="cuda:1"),
        lambda: torch.ones(2).to("cuda:1"),
        lambda: torch.cuda.set_device(1),
    ],
)
def test_other_cuda_devices_are_refused(cumulus, compat, call):
    with pytest.raises(ValueError, match="this process has 1 cumulus device"):
        call()


def test_synchronize_raises_queued_executor_errors(cumulus, compat):
    F.embedding(torch.tensor([0, 9], device="cuda"), torch.randn(4, 3, device="cuda"))
    with pytest.raises(RemoteExecutionError, match="index out of range"):
        torch.cuda.synchronize()


def test_memory_queries_count_the_sessions_tensors(cumulus, compat):
    before = torch.cuda.memory_allocated()
    x = torch.empty(1024, device="cuda")
    assert torch.cuda.memory_allocated() == before + 4096
    assert torch.cuda.memory_reserved() == torch.cuda.memory_allocated()
    assert torch.cuda.max_memory_allocated() >= before + 4096
    del x
    torch.cuda.empty_cache()
    assert torch.cuda.memory_allocated() == before
    torch.cuda.reset_peak_memory_stats()
    assert torch.cuda.max_memory_allocated() == before
    free, total = torch.cuda.mem_get_info()
    assert total == cumulus.info["quota"] and free == total - before
    assert torch.cuda.memory_stats()["allocated_bytes.all.current"] == before


def test_cuda_manual_seed_seeds_the_remote_generator(cumulus, compat):
    torch.cuda.manual_seed(7)
    first = torch.randn(5, device="cuda").cpu()
    torch.cuda.manual_seed_all(7)
    assert torch.equal(torch.randn(5, device="cuda").cpu(), first)
    torch.manual_seed(7)
    assert torch.equal(torch.randn(5), first)  # the CPU executor draws the CPU's stream


def test_cuda_rng_state_saves_and_restores_the_remote_generator(cumulus, compat):
    torch.manual_seed(5)
    state = torch.cuda.get_rng_state()
    first = torch.randn(5, device="cuda").cpu()
    torch.cuda.set_rng_state(state)
    assert torch.equal(torch.randn(5, device="cuda").cpu(), first)
    torch.cuda.set_rng_state_all(torch.cuda.get_rng_state_all())


@pytest.mark.parametrize("scope", ["default_device", "device_context"])
def test_default_cuda_device_means_cumulus(cumulus, compat, scope):
    if scope == "default_device":
        torch.set_default_device("cuda")
        try:
            t = torch.zeros(2)
        finally:
            torch.set_default_device(None)
    else:
        with torch.device("cuda"):
            t = torch.zeros(2)
    assert t.device == CUMULUS0
    assert torch.zeros(2).device.type == "cpu"


def test_events_streams_and_device_contexts_work(cumulus, compat):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.ones(8, device="cuda").sum()
    end.record()
    end.synchronize()
    assert start.elapsed_time(end) >= 0.0
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.device(0):
        torch.ones(2, device="cuda")
    torch.cuda.current_stream().synchronize()
    assert not torch.cuda.is_current_stream_capturing()


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_pin_memory_degrades_to_plain_batches(cumulus, compat, workers):
    data = torch.utils.data.TensorDataset(torch.arange(8.0))
    loader = torch.utils.data.DataLoader(data, batch_size=4, pin_memory=True, num_workers=workers)
    sums = [batch.cuda(non_blocking=True).sum().item() for (batch,) in loader]
    assert sums == [6.0, 22.0]


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW])
def test_optimizers_match_the_cpu_on_cuda_parameters(cumulus, optimizer):
    def train(use_cuda: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        if use_cuda:
            model.cuda()
        device = "cuda" if use_cuda else "cpu"
        opt = optimizer(model.parameters(), lr=0.05, weight_decay=0.01)
        x = torch.linspace(-1, 1, 64, device=device).reshape(8, 8)
        for _ in range(3):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        return [p.detach().cpu() for p in model.parameters()]

    local = train(use_cuda=False)
    with cuda_compat.cuda_compat():
        remote_ = train(use_cuda=True)
    for a, b in zip(local, remote_, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW])
def test_cpu_optimizers_are_unchanged_by_compat_mode(cumulus, optimizer):
    # torch.cuda.is_available() is True in the mode; CPU-only training must not notice.
    def train() -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = optimizer(model.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            model(torch.ones(3, 4)).sum().backward()
            opt.step()
        assert opt.param_groups[0].get("fused") in (None, False)
        return [p.detach().clone() for p in model.parameters()]

    local = train()
    with cuda_compat.cuda_compat():
        with_compat = train()
    assert all(torch.equal(a, b) for a, b in zip(local, with_compat, strict=True))


def test_optimizer_kernel_defaults_are_unchanged_and_never_fused(cumulus):
    from torch.optim.optimizer import _default_to_fused_or_foreach

    params = [
        [torch.nn.Parameter(torch.ones(2, device="cumulus"))],
        [torch.nn.Parameter(torch.ones(2))],
    ]
    without = [_default_to_fused_or_foreach(p, False, False) for p in params]
    with cuda_compat.cuda_compat():
        within = [_default_to_fused_or_foreach(p, False, False) for p in params]
    assert within == without
    assert not any(fused for fused, _ in within)


def test_autocast_cuda_runs_matmuls_in_the_autocast_dtype(cumulus, compat):
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 4)
    x = torch.randn(2, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        local = layer(x)
    layer.cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = layer(x.cuda())
    assert out.dtype == torch.bfloat16
    assert torch.equal(out.cpu(), local)


def test_autocast_cuda_keeps_reductions_and_losses_in_float32(cumulus, compat):
    x = torch.randn(4, 8, device="cuda")
    w = torch.randn(3, 8, device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        logits = F.linear(x, w)
        assert logits.dtype == torch.float16
        assert F.softmax(logits, -1).dtype == torch.float32
        assert logits.sum().dtype == torch.float32
        assert F.cross_entropy(logits, torch.tensor([0, 1, 2, 0], device="cuda")).dtype == (
            torch.float32
        )
        assert torch.softmax(logits, -1, dtype=torch.float64).dtype == torch.float64
        assert torch.cat([logits, logits.float()]).dtype == torch.float32


def test_grad_scaler_trains_with_float16_autocast(cumulus, compat):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1).cuda()
    before = model.weight.detach().cpu().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cuda", init_scale=1024.0)
    for _ in range(2):
        opt.zero_grad()
        with torch.autocast("cuda"):
            loss = model(torch.randn(4, 8, device="cuda")).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    assert scaler.get_scale() == 1024.0  # no overflow, no growth yet
    assert not torch.equal(model.weight.detach().cpu(), before)


def test_torch_load_to_cuda_lands_on_cumulus(cumulus, compat, tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save({"w": torch.arange(4.0), "step": 3, "nested": [torch.ones(2)]}, path)
    ckpt = torch.load(path, map_location="cuda")
    assert type(ckpt["w"]) is RemoteTensor and ckpt["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert type(ckpt["nested"][0]) is RemoteTensor
    assert ckpt["step"] == 3
    assert torch.load(path)["w"].device.type == "cpu"
    assert torch.load(path, map_location="cpu")["w"].device.type == "cpu"


def test_torch_load_of_a_gpu_checkpoint_lands_on_cumulus(cumulus, compat, tmp_path, monkeypatch):
    path = tmp_path / "gpu.pt"
    with monkeypatch.context() as patch:  # write it as a GPU machine would
        patch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        torch.save(torch.nn.Linear(2, 2).state_dict(), path)
    state = torch.load(path)
    assert all(type(t) is RemoteTensor for t in state.values())
    torch.nn.Linear(2, 2).cuda().load_state_dict(state)


def test_compat_without_a_session_says_how_to_attach(monkeypatch):
    remote.detach()
    monkeypatch.setattr(CumulusModule, "_pending_seed", CumulusModule._pending_seed)
    with cuda_compat.cuda_compat():
        assert torch.cuda.is_available()
        torch.manual_seed(0)  # seeding before attach is fine: the session takes it later
        for call in (
            lambda: torch.zeros(2, device="cuda"),
            lambda: torch.ones(2).cuda(),
            lambda: torch.ones(2).to("cuda"),
            torch.cuda.synchronize,
        ):
            with pytest.raises(SessionClosedError, match="cumulus-node --consume.*attach"):
                call()


def test_disable_restores_everything_it_replaced():
    import torch.amp.autocast_mode as autocast_mode
    import torch.utils.data._utils.pin_memory as pin_memory
    from torch.utils._device import DeviceContext

    def snapshot():
        return (
            dict(vars(torch.cuda)),
            vars(autocast_mode.autocast)["__init__"],
            vars(DeviceContext)["__init__"],
            pin_memory.pin_memory,
            torch.load,
            torch.serialization.load,
            torch._C._len_torch_function_stack(),
        )

    before = snapshot()
    cuda_compat.enable()
    assert torch.cuda.is_available is not before[0]["is_available"]
    cuda_compat.disable()
    after = snapshot()

    assert after[0].keys() == before[0].keys()
    assert all(after[0][k] is v for k, v in before[0].items())
    assert all(a is b for a, b in zip(after[1:], before[1:], strict=True))
    assert not cuda_compat.is_enabled()


def test_disable_works_under_a_mode_pushed_later():
    depth = torch._C._len_torch_function_stack()
    cuda_compat.enable()
    with torch.device("meta"):  # a function mode of its own, above compat's
        cuda_compat.disable()
        assert torch.empty(1).device.type == "meta"
    assert torch._C._len_torch_function_stack() == depth
    assert torch.empty(1).device.type == "cpu"


def test_nested_contexts_leave_the_outer_one_on():
    with cuda_compat.cuda_compat():
        with cuda_compat.cuda_compat():
            pass
        assert cuda_compat.is_enabled()
    assert not cuda_compat.is_enabled()


def test_disable_from_another_thread_is_refused():
    errors = []
    with cuda_compat.cuda_compat():
        thread = threading.Thread(target=lambda: errors.append(_try(cuda_compat.disable)))
        thread.start()
        thread.join()
        assert cuda_compat.is_enabled()
    assert isinstance(errors[0], RuntimeError)


def _try(fn):
    try:
        fn()
    except Exception as exc:  # handed back to the test thread
        return exc
    return None


def test_modes_pushed_by_the_script_still_see_cuda_redirected(cumulus, compat):
    class Recorder(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Recorder():
        assert torch.zeros(2, device="cuda").device == CUMULUS0


def test_the_mode_imports_before_either_device_exists():
    # A script (or the native shim) may import it first: "cumulus" is no device type yet.
    code = "import cumulus_p2p.cuda_compat as c; assert not c.is_enabled()"
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
