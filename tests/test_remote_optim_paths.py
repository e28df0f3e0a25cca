"""Training steps on ``cumulus`` take the paths they take on CUDA, and reuse their plans."""

from __future__ import annotations

import pytest
import torch
from torch.optim.optimizer import _default_to_fused_or_foreach
from torch.utils._foreach_utils import _has_foreach_support

from cumulus_p2p.remote.tensor import plan_count
from cumulus_p2p.testing.models import TASKS

OPTIMIZERS = {
    "Adam": lambda params, **kw: torch.optim.Adam(params, lr=1e-3, **kw),
    "AdamW": lambda params, **kw: torch.optim.AdamW(params, lr=1e-3, **kw),
    "SGD": lambda params, **kw: torch.optim.SGD(params, lr=1e-2, momentum=0.9, **kw),
}


def _trainer(make_opt, *, schedule: bool = False):
    spec = TASKS["transformer"]
    torch.manual_seed(0)
    model = spec.make_model().to("cumulus")
    opt = make_opt(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1 / (1 + i)) if schedule else None
    x, y = (t.to("cumulus") for t in spec.make_batch(torch.Generator().manual_seed(0)))

    def step() -> None:
        opt.zero_grad()
        loss = spec.loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if sched is not None:
            sched.step()
        loss.item()

    return model, step


def _ops_per_step(session, make_opt) -> int:
    _, step = _trainer(make_opt)
    step()
    step()
    before = session.stats()["ops"]
    step()
    return session.stats()["ops"] - before


def test_torch_picks_foreach_for_cumulus_parameters_as_for_cuda(cumulus):
    model, step = _trainer(OPTIMIZERS["Adam"])
    step()
    params = list(model.parameters())
    assert _default_to_fused_or_foreach(params, False, False) == (False, True)
    grads = [p.grad for p in params]
    assert _has_foreach_support(grads, grads[0].device)  # clip_grad_norm_, zero_grad


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_default_optimizer_sends_the_foreach_step(cumulus, name):
    make = OPTIMIZERS[name]
    default = _ops_per_step(cumulus, make)
    assert default == _ops_per_step(cumulus, lambda p: make(p, foreach=True))
    assert default < _ops_per_step(cumulus, lambda p: make(p, foreach=False))


def test_fused_adam_runs_as_one_op_per_step(cumulus):
    fused = _ops_per_step(cumulus, lambda p: torch.optim.Adam(p, fused=True))
    foreach = _ops_per_step(cumulus, lambda p: torch.optim.Adam(p, foreach=True))
    assert fused < foreach


def test_a_steady_step_builds_no_plan_even_as_the_learning_rate_changes(cumulus):
    _, step = _trainer(OPTIMIZERS["Adam"], schedule=True)
    step()
    step()
    before = plan_count()
    step()
    assert plan_count() == before


def test_a_foreach_step_bumps_the_versions_of_the_tensors_it_writes(cumulus):
    weight = torch.ones(2, 2, device="cumulus", requires_grad=True)
    x = torch.ones(2, 2, device="cumulus", requires_grad=True)
    loss = (x @ weight).sum()  # saves weight for x's gradient
    with torch.no_grad():
        torch._foreach_add_([weight], [torch.ones(2, 2, device="cumulus")], alpha=-0.1)
    assert weight._version == 1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_fused_adamw_with_a_tensor_learning_rate_is_queued_not_waited_for(cumulus):
    model = torch.nn.Linear(4, 2).to("cumulus")
    lr = torch.tensor(0.01, device="cumulus")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    for _ in range(2):
        model(torch.ones(3, 4, device="cumulus")).sum().backward()
        cumulus.flush()
        sent = cumulus.ops_sent
        opt.step()
    assert cumulus.ops_sent == sent  # planned from its meta kernel: no round trip
    cumulus.synchronize()
