"""``torch.compile(opt.step)`` on cumulus: the step captured once, then one record per step."""

from __future__ import annotations

import warnings

import pytest
import torch

from cumulus_p2p.remote import compiled
from cumulus_p2p.testing.models import TinyTransformer

OPTIMIZERS = {
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "adamw_fused": lambda params: torch.optim.AdamW(params, lr=1e-2, fused=True),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
}


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(compiled, "_warned", set())


def _train(device: str, make_opt, *, steps: int = 4, compile_step: bool, **opt_kwargs):
    """A small MLP's parameters after ``steps`` regression steps, and its optimizer.

    Dense inputs: every parameter gets a real gradient each step. (Adam normalises each
    gradient, so one that is nearly zero turns a rounding difference into a full step.)
    """
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).to(
        device
    )
    opt = make_opt(model.parameters(), **opt_kwargs)
    step = torch.compile(opt.step) if compile_step else opt.step
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
        torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
        step()
        opt.zero_grad()
    return [p.detach().cpu() for p in model.parameters()], opt


def _adam(params, **kwargs):
    return torch.optim.Adam(params, lr=1e-2, **kwargs)


def test_a_compiled_adam_step_is_bit_identical_to_eager_capturable_adam(cumulus):
    compiled_params, _ = _train("cumulus", _adam, compile_step=True)
    eager_params, _ = _train("cumulus", _adam, compile_step=False, capturable=True)
    assert all(torch.equal(a, b) for a, b in zip(compiled_params, eager_params, strict=True))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_compiled_optimizers_track_the_same_optimizer_on_a_local_cpu(cumulus, name):
    initial, _ = _train("cpu", OPTIMIZERS[name], steps=0, compile_step=False)
    remote, _ = _train("cumulus", OPTIMIZERS[name], compile_step=True)
    local, _ = _train("cpu", OPTIMIZERS[name], compile_step=False)
    for a, b in zip(remote, local, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)  # capturable rounds otherwise
    assert cumulus.graphs_defined == 1  # captured, not run eagerly
    assert all(not torch.equal(a, b) for a, b in zip(remote, initial, strict=True))


def test_a_steady_compiled_optimizer_step_is_one_record(cumulus):
    torch.manual_seed(0)
    model = TinyTransformer(dropout=0.0, layers=2).to("cumulus")
    opt = torch.optim.Adam(model.parameters())
    step = torch.compile(opt.step)
    idx = torch.randint(0, 64, (4, 16)).to("cumulus")
    sent = []
    for _ in range(4):
        model(idx).float().mean().backward()
        cumulus.flush()
        before = cumulus.ops_sent
        step()
        cumulus.flush()
        sent.append(cumulus.ops_sent - before)
        opt.zero_grad()
    assert sent[2:] == [1, 1]
    assert cumulus.graphs_defined == 1


def test_the_first_compiled_step_makes_the_optimizer_capturable(cumulus):
    _, opt = _train("cumulus", _adam, steps=1, compile_step=True)
    assert all(group["capturable"] for group in opt.param_groups)
    assert all(state["step"].device.type == "cumulus" for state in opt.state.values())


def test_counters_an_eager_step_left_on_the_cpu_move_to_the_device(cumulus):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).to("cumulus")
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(3, 4, device="cumulus")).sum().backward()
    opt.step()  # eager, not capturable: the counters live on the CPU
    assert all(state["step"].device.type == "cpu" for state in opt.state.values())
    torch.compile(opt.step)()
    assert all(state["step"].device.type == "cumulus" for state in opt.state.values())
    assert [s["step"].item() for s in opt.state.values()] == [2.0, 2.0]
    assert cumulus.graphs_defined == 1


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_an_adam_learning_rate_schedule_needs_no_new_capture(cumulus, fused):
    def schedule(step: int) -> float:  # warm-up, then decay, as nanoGPT sets it by hand
        return 1e-2 * min(1.0, (step + 1) / 3) / (1 + step)

    def train(compile_step: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4).to("cumulus")
        opt = torch.optim.AdamW(model.parameters(), capturable=True, fused=fused)
        step = torch.compile(opt.step) if compile_step else opt.step
        gen = torch.Generator().manual_seed(1)
        for k in range(6):
            opt.param_groups[0]["lr"] = schedule(k)
            model(torch.randn(16, 8, generator=gen).to("cumulus")).square().mean().backward()
            step()
            opt.zero_grad()
        return [p.detach().cpu() for p in model.parameters()]

    compiled_params = train(compile_step=True)
    assert cumulus.graphs_defined == 1
    eager_params = train(compile_step=False)
    # The rate is a float32 tensor here and a Python float eagerly: rounding differs.
    for a, b in zip(compiled_params, eager_params, strict=True):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), (a - b).abs().max()


def test_a_new_sgd_learning_rate_captures_again_and_is_used(cumulus):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2, bias=False).to("cumulus")
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    step = torch.compile(opt.step)
    for lr in (1.0, 1.0, 0.5):
        opt.param_groups[0]["lr"] = lr
        before = model.weight.detach().cpu()
        model.weight.grad = torch.ones(2, 4, device="cumulus")
        step()
        assert torch.equal(model.weight.detach().cpu(), before - lr)
    assert cumulus.graphs_defined == 2  # lr 1.0 once, then lr 0.5


def test_after_too_many_learning_rates_the_step_runs_eagerly(cumulus, fresh_warnings):
    model = torch.nn.Linear(4, 2, bias=False).to("cumulus")
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    step = torch.compile(opt.step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in range(compiled.MAX_CAPTURES + 2):
            opt.param_groups[0]["lr"] = 1.0 / (k + 1)
            model.weight.grad = torch.ones(2, 4, device="cumulus")
            step()
    assert cumulus.graphs_defined == compiled.MAX_CAPTURES
    assert any("more than 8 optimizer signatures" in str(w.message) for w in caught)


def _eager_with_warning(opt, step, *args) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(*args)
    return [str(w.message) for w in caught]


def test_an_optimizer_with_step_hooks_runs_eagerly_and_calls_them(cumulus, fresh_warnings):
    model = torch.nn.Linear(4, 2).to("cumulus")
    opt = torch.optim.Adam(model.parameters())
    calls = []
    opt.register_step_post_hook(lambda *_: calls.append("post"))
    model(torch.ones(3, 4, device="cumulus")).sum().backward()
    messages = _eager_with_warning(opt, torch.compile(opt.step))
    assert calls == ["post"]
    assert any("step hooks" in m for m in messages)
    assert cumulus.graphs_defined == 0


def test_a_step_with_a_closure_runs_eagerly(cumulus, fresh_warnings):
    model = torch.nn.Linear(4, 2).to("cumulus")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def closure():
        opt.zero_grad()
        loss = model(torch.ones(3, 4, device="cumulus")).sum()
        loss.backward()
        return loss

    messages = _eager_with_warning(opt, torch.compile(opt.step), closure)
    assert any("closure" in m for m in messages)
    assert model.weight.grad is not None  # the closure ran


def test_a_tensor_learning_rate_runs_eagerly(cumulus, fresh_warnings):
    model = torch.nn.Linear(4, 2).to("cumulus")
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01), capturable=True)
    model(torch.ones(3, 4, device="cumulus")).sum().backward()
    messages = _eager_with_warning(opt, torch.compile(opt.step))
    assert any("tensor hyperparameter" in m for m in messages)


def test_a_compiled_optimizer_step_on_the_cpu_is_still_compiled(cumulus):
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()
    model(torch.ones(3, 4)).sum().backward()
    torch.compile(opt.step, backend="eager")()
    assert not torch.equal(model.weight, before)
    assert cumulus.graphs_defined == 0


def test_autograd_refuses_a_backward_through_parameters_a_compiled_step_changed(cumulus):
    model = torch.nn.Linear(4, 2).to("cumulus")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = torch.compile(opt.step)
    x = torch.ones(3, 4, device="cumulus", requires_grad=True)
    model(x).sum().backward()
    step()  # captured from here on
    loss = (model(x) * model.weight.sum()).sum()  # saves the weight for backward
    model.weight.grad = torch.ones(2, 4, device="cumulus")
    step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_a_step_an_lr_scheduler_wrapped_is_captured_and_counted_for_the_scheduler(cumulus):
    model = torch.nn.Linear(4, 2).to("cumulus")
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
    step = torch.compile(opt.step)  # opt.step is now the scheduler's wrapper
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            model(torch.ones(3, 4, device="cumulus")).sum().backward()
            step()
            sched.step()
    assert cumulus.graphs_defined == 1
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
    assert not any("lr_scheduler.step()" in str(w.message) for w in caught)


def test_a_compiled_function_reaching_the_optimizer_through_its_closure_runs_eagerly(
    cumulus, fresh_warnings
):
    def train(compiled: bool) -> torch.Tensor:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2).to("cumulus")
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)

        def step():  # the PyTorch recipe for a compiled optimizer with a scheduler
            opt.step()
            sched.step()

        fn = torch.compile(step) if compiled else step
        for _ in range(3):
            model(torch.ones(3, 4, device="cumulus")).sum().backward()
            fn()
        return model.weight.detach().cpu()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled_weight = train(compiled=True)
    assert torch.equal(compiled_weight, train(compiled=False))
    assert any("through its closure or globals" in str(w.message) for w in caught)


def test_a_fullgraph_optimizer_step_with_hooks_raises(cumulus):
    from torch._dynamo.exc import Unsupported

    model = torch.nn.Linear(4, 2).to("cumulus")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.register_step_pre_hook(lambda *_: None)
    model(torch.ones(3, 4, device="cumulus")).sum().backward()
    with pytest.raises(Unsupported, match="step hooks"):
        torch.compile(opt.step, fullgraph=True)()
