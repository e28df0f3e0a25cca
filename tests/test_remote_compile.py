"""``torch.compile`` on cumulus: graphs sent once, steps run as graphs, eager where it must."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import cumulus_p2p.remote as remote_device
from cumulus_p2p._errors import RemoteExecutionError
from cumulus_p2p.channel.transport import SocketFrameChannel
from cumulus_p2p.remote import compiled
from cumulus_p2p.remote.tensor import RemoteTensor
from cumulus_p2p.testing.executor import executor_process
from cumulus_p2p.testing.models import TinyTransformer, train


class _CountingBackend:
    """A dynamo backend that runs the captured graph as is and counts captures."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, graph_module, example_inputs):
        self.graphs += 1
        return graph_module.forward


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(compiled, "_warned", set())


def _gpt_losses(
    device: str, *, layers: int = 2, steps: int = 4, on_step=lambda: None, compile_step=False
):
    """nanoGPT's training loop in miniature: tied weights, causal sdpa, fused AdamW, clipping
    (and with ``compile_step``, the optimizer step compiled too)."""
    torch.manual_seed(0)
    model = TinyTransformer(dropout=0.0, layers=layers).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    forward = torch.compile(model)
    opt_step = torch.compile(opt.step) if compile_step else opt.step
    gen = torch.Generator().manual_seed(2)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, 64, (8, 16), generator=gen)
        idx, target = idx.to(device), torch.roll(idx, -1, dims=1).to(device)
        logits = forward(idx)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt_step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        on_step()
    return losses


@pytest.mark.slow  # compiles and trains a GPT on both sides
def test_compiled_gpt_trains_as_the_same_compiled_code_on_a_local_cpu(cumulus):
    remote = _gpt_losses("cumulus")
    local = _gpt_losses("cpu")
    assert remote == pytest.approx(local, abs=1e-5)
    assert remote[-1] < remote[0]
    assert cumulus.graphs_defined == 2  # captured, not run eagerly


def _dial(address: str):
    host, port = address.split(":")
    return lambda: SocketFrameChannel.connect(host, int(port))


@pytest.mark.slow  # kills and restarts executor processes
@pytest.mark.parametrize(
    ("interval", "compile_step"),
    [(None, False), (0.0, False), (0.0, True)],
    ids=["replay_from_start", "checkpoint_every_sync", "optimizer_compiled_too"],
)
def test_a_compiled_run_whose_host_is_killed_finishes_on_another_host(
    executor_address, interval, compile_step
):
    with remote_device.attach(executor_address):
        uninterrupted = _gpt_losses("cumulus", steps=5, compile_step=compile_step)
    with (
        executor_process(quota="2GiB") as (doomed, proc),
        executor_process(quota="2GiB") as (standby, _),
        remote_device.attach(
            channel=_dial(doomed)(), reconnect=_dial(standby), checkpoint_interval=interval
        ) as session,
    ):
        steps = iter(range(5))
        kill = lambda: next(steps) == 2 and proc.kill()  # noqa: E731
        losses = _gpt_losses("cumulus", steps=5, on_step=kill, compile_step=compile_step)
        assert session.failovers == 1
        assert session.graphs_defined == (3 if compile_step else 2)
    assert losses == uninterrupted


def test_a_compiled_step_sends_its_graphs_once_per_session(cumulus):
    _gpt_losses("cumulus", steps=3)
    assert cumulus.graphs_defined == 2  # forward and backward, whatever the step count


@pytest.mark.slow  # compiles and trains a GPT on both sides
def test_a_steady_compiled_step_sends_as_many_records_at_any_depth(cumulus):
    def records_per_step(layers: int) -> list[int]:
        sent: list[int] = []
        _gpt_losses(
            "cumulus", layers=layers, steps=4, on_step=lambda: sent.append(cumulus.ops_sent)
        )
        return [sent[2] - sent[1], sent[3] - sent[2]]  # steps 3 and 4: steady

    shallow, deep = records_per_step(1), records_per_step(4)
    assert shallow[0] == shallow[1] == deep[0] == deep[1]


def test_a_new_input_shape_captures_again_and_stays_correct(cumulus):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    inputs = [torch.randn(3, 4), torch.randn(5, 4), torch.randn(3, 4)]
    expected = [model(x).detach() for x in inputs]
    fast = torch.compile(model.to("cumulus"))
    got = [fast(x.to("cumulus")).cpu() for x in inputs]
    assert all(torch.allclose(g, e, atol=1e-6) for g, e in zip(got, expected, strict=True))
    assert cumulus.graphs_defined == 2  # a forward graph per shape; no backward ran


def test_inference_under_no_grad_sends_the_forward_graph_only(cumulus):
    model = torch.nn.Linear(4, 2).to("cumulus")
    fast = torch.compile(model)
    with torch.no_grad():
        out = fast(torch.ones(3, 4, device="cumulus"))
    assert not out.requires_grad
    assert torch.allclose(out.cpu(), model(torch.ones(3, 4, device="cumulus")).detach().cpu())
    assert cumulus.graphs_defined == 1


def test_gradients_flow_to_compiled_function_arguments(cumulus):
    def loss_of(w, x):
        return (torch.tanh(x @ w) ** 2).sum()

    w = torch.randn(4, 3, requires_grad=True)
    x = torch.randn(5, 4)
    loss_of(w, x).backward()
    remote_w = w.detach().to("cumulus").requires_grad_()
    torch.compile(loss_of)(remote_w, x.to("cumulus")).backward()
    assert torch.allclose(remote_w.grad.cpu(), w.grad, atol=1e-6)


def _mlp_and_batch():
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    return model, torch.randn(5, 6)


def _remote_copy(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model).to("cumulus")


def test_a_compiled_backward_gives_each_parameter_what_eager_autograd_gives(cumulus):
    local, x = _mlp_and_batch()
    remote = _remote_copy(local)
    compiled_remote = torch.compile(remote)
    for _ in range(2):  # the second pass accumulates into the first's gradients
        local(x).square().sum().backward()
        compiled_remote(x.to("cumulus")).square().sum().backward()
    for mine, theirs in zip(remote.parameters(), local.parameters(), strict=True):
        assert mine.grad.stride() == mine.stride()
        assert mine.grad.grad_fn is None and not mine.grad.requires_grad
        assert torch.allclose(mine.grad.cpu(), theirs.grad, atol=1e-5)


def test_a_compiled_backward_stores_gradients_without_a_dispatch_per_parameter(
    cumulus, monkeypatch
):
    local, x = _mlp_and_batch()
    remote = _remote_copy(local)
    loss = torch.compile(remote)(x.to("cumulus")).square().sum()
    dispatched = []
    dispatch = RemoteTensor.__torch_dispatch__.__func__

    def counting(cls, func, types, args=(), kwargs=None):
        dispatched.append(func)
        return dispatch(cls, func, types, args, kwargs)

    monkeypatch.setattr(RemoteTensor, "__torch_dispatch__", classmethod(counting))
    loss.backward()
    assert torch.ops.aten.detach.default not in dispatched
    assert all(p.grad is not None for p in remote.parameters())


def test_hooks_on_parameters_of_a_compiled_module_still_run(cumulus):
    local, x = _mlp_and_batch()
    remote = _remote_copy(local)
    seen, accumulated = [], []
    weight = remote[0].weight
    weight.register_hook(lambda grad: seen.append(grad.cpu()))
    weight.register_post_accumulate_grad_hook(lambda p: accumulated.append(p.grad.cpu()))
    torch.compile(remote)(x.to("cumulus")).square().sum().backward()
    local(x).square().sum().backward()
    assert len(seen) == 1 and len(accumulated) == 1
    assert torch.allclose(seen[0], local[0].weight.grad, atol=1e-5)
    assert torch.allclose(accumulated[0], local[0].weight.grad, atol=1e-5)


def test_autograd_grad_through_a_compiled_module_leaves_dot_grad_alone(cumulus):
    local, x = _mlp_and_batch()
    remote = _remote_copy(local)
    loss = torch.compile(remote)(x.to("cumulus")).square().sum()
    grads = torch.autograd.grad(loss, list(remote.parameters()))
    expected = torch.autograd.grad(local(x).square().sum(), list(local.parameters()))
    assert all(p.grad is None for p in remote.parameters())
    for mine, theirs in zip(grads, expected, strict=True):
        assert torch.allclose(mine.cpu(), theirs, atol=1e-5)


def test_backward_with_inputs_fills_only_the_gradients_asked_for(cumulus):
    local, x = _mlp_and_batch()
    remote = _remote_copy(local)
    first, *others = remote.parameters()
    torch.compile(remote)(x.to("cumulus")).square().sum().backward(inputs=[first])
    local(x).square().sum().backward()
    assert torch.allclose(first.grad.cpu(), local[0].weight.grad, atol=1e-5)
    assert all(p.grad is None for p in others)


def test_an_error_inside_a_compiled_graph_names_the_failing_op(cumulus):
    embed = torch.nn.Embedding(10, 4).to("cumulus")
    fast = torch.compile(embed)
    with pytest.raises(RemoteExecutionError, match=r"aten\.embedding\.default \(node \d+ of"):
        fast(torch.tensor([3, 12], device="cumulus")).sum().item()
    assert fast(torch.tensor([3], device="cumulus")).shape == (1, 4)  # the session carries on


def test_data_dependent_code_runs_eagerly_with_one_warning(cumulus, fresh_warnings):
    def clipped(x):
        return x * 2 if x.sum() > 0 else x

    fast = torch.compile(clipped)
    x = torch.arange(4.0, device="cumulus")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert fast(x).tolist() == [0.0, 2.0, 4.0, 6.0]
        assert fast(x).tolist() == [0.0, 2.0, 4.0, 6.0]
    messages = [str(w.message) for w in caught if "torch.compile on cumulus" in str(w.message)]
    assert len(messages) == 1
    assert "runs eagerly" in messages[0]


def test_batchnorm_statistics_are_written_back_on_the_executor(cumulus, fresh_warnings):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        remote, remote_params = train("cnn", "cumulus", steps=3, compiled=True)
    local, local_params = train("cnn", "cpu", steps=3)
    assert remote == local
    assert all(torch.equal(remote_params[k], local_params[k]) for k in local_params)
    assert local_params["bn.num_batches_tracked"].item() == 3  # the statistics moved
    assert not [w for w in caught if "torch.compile on cumulus" in str(w.message)]
    assert cumulus.graphs_defined == 2


def test_compiled_model_on_cumulus_never_reaches_dynamo(cumulus):
    backend = _CountingBackend()
    model = torch.nn.Linear(4, 2).to("cumulus")
    out = torch.compile(model, backend=backend)(torch.ones(3, 4, device="cumulus"))
    assert out.shape == (3, 2)
    assert backend.graphs == 0


def test_compiled_cpu_model_is_still_compiled(cumulus):
    backend = _CountingBackend()
    model = torch.nn.Linear(4, 2)
    expected = model(torch.ones(3, 4))
    assert torch.equal(torch.compile(model, backend=backend)(torch.ones(3, 4)), expected)
    assert backend.graphs == 1


def test_one_compiled_function_serves_cpu_and_cumulus_arguments(cumulus):
    backend = _CountingBackend()

    def scaled_sum(a, b):
        return (a * 2 + b).sum()

    fast = torch.compile(scaled_sum, backend=backend)
    a, b = torch.arange(4.0), torch.ones(4)
    assert fast(a.to("cumulus"), b.to("cumulus")).item() == 16.0
    assert backend.graphs == 0
    assert fast(a, b).item() == 16.0
    assert backend.graphs == 1


def test_decorator_form_reaches_cumulus_too(cumulus):
    @torch.compile(dynamic=False)
    def double(x):
        return x * 2

    assert double(torch.ones(2, device="cumulus")).tolist() == [2.0, 2.0]
    assert cumulus.graphs_defined == 1


def test_an_autocast_region_is_captured_with_the_devices_casts(cumulus):
    def losses(compile_model: bool) -> list[float]:
        torch.manual_seed(0)
        model = TinyTransformer(dropout=0.0).to("cumulus")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        forward = torch.compile(model) if compile_model else model
        idx = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(2))
        idx, target = idx.to("cumulus"), torch.roll(idx, -1, dims=1).to("cumulus")
        out = []
        for _ in range(3):
            with torch.autocast("cumulus", dtype=torch.bfloat16):
                logits = forward(idx)
                loss = F.cross_entropy(logits.reshape(-1, 64).float(), target.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.append(loss.item())
        return out

    eager = losses(compile_model=False)
    assert losses(compile_model=True) == eager  # the same casts, the same kernels
    assert cumulus.graphs_defined == 2


def test_fullgraph_code_that_cannot_be_captured_raises_instead_of_running_eagerly(cumulus):
    from torch._dynamo.exc import Unsupported

    def halve_if_large(x):
        return x / 2 if x.sum().item() > 10 else x  # data-dependent: no single graph

    x = torch.full((4,), 5.0, device="cumulus")
    with pytest.raises(Unsupported, match="fullgraph=True"):
        torch.compile(halve_if_large, fullgraph=True)(x)
    assert torch.compile(halve_if_large)(x).tolist() == [2.5] * 4  # without: eager, warned


class _Gated(torch.nn.Module):
    """A GPT whose own forward breaks the graph: it reads a value back mid-way."""

    def __init__(self) -> None:
        super().__init__()
        self.body = TinyTransformer(dropout=0.0, layers=2)

    def forward(self, idx):
        logits = self.body(idx)
        if logits.abs().max().item() > 1e6:  # data-dependent: no single graph
            logits = logits.clamp(-1e6, 1e6)
        return logits


class _Reads(torch.nn.Module):
    """A layer that reads a value back around an inner layer."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(8, 8)

    def forward(self, x):
        scale = 2.0 if x.sum().item() > 0 else 1.0
        return self.inner(x) * scale


def _train(make_model, batch, compile_model: bool, steps: int = 3) -> list[float]:
    torch.manual_seed(0)
    model = make_model().to("cumulus")
    forward = torch.compile(model) if compile_model else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        loss = forward(batch.to("cumulus")).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_around_a_graph_break_the_submodules_are_captured_one_by_one(cumulus, fresh_warnings):
    idx = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled_losses = _train(_Gated, idx, compile_model=True)
    assert compiled_losses == _train(_Gated, idx, compile_model=False)
    assert cumulus.graphs_defined == 2  # the GPT body's forward and backward
    assert any("captured one by one" in str(w.message) for w in caught)


def test_a_submodule_that_breaks_the_graph_splits_again(cumulus, fresh_warnings):
    def make():
        return torch.nn.Sequential(torch.nn.Linear(8, 8), _Reads(), torch.nn.Linear(8, 1))

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    compiled_losses = _train(make, x, compile_model=True)
    assert compiled_losses == _train(make, x, compile_model=False)
    assert cumulus.graphs_defined == 6  # three Linear layers, forward and backward
