"""``torch.compile`` of code on cumulus tensors runs that code eagerly, never crashes."""

from __future__ import annotations

import warnings

import pytest
import torch

from cumulus_p2p.remote import compile_fallback
from cumulus_p2p.testing.models import train


class _CountingBackend:
    """A dynamo backend that runs the captured graph as is and counts captures."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, graph_module, example_inputs):
        self.graphs += 1
        return graph_module.forward


@pytest.fixture
def fresh_warning(monkeypatch):
    monkeypatch.setattr(compile_fallback, "_warned", [False])


def test_compiled_model_on_cumulus_trains_as_the_local_eager_model(cumulus):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        remote, remote_params = train("transformer", "cumulus", steps=3, compiled=True)
    local, local_params = train("transformer", "cpu", steps=3)
    assert remote == local
    assert all(torch.equal(remote_params[k], local_params[k]) for k in local_params)


def test_compiled_model_on_cumulus_never_reaches_dynamo(cumulus):
    backend = _CountingBackend()
    model = torch.nn.Linear(4, 2).to("cumulus")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = torch.compile(model, backend=backend)(torch.ones(3, 4, device="cumulus"))
    assert out.shape == (3, 2)
    assert backend.graphs == 0


def test_compiled_cpu_model_is_still_compiled(cumulus):
    backend = _CountingBackend()
    model = torch.nn.Linear(4, 2)
    expected = model(torch.ones(3, 4))
    assert torch.equal(torch.compile(model, backend=backend)(torch.ones(3, 4)), expected)
    assert backend.graphs == 1


def test_compiled_function_with_cumulus_arguments_runs_eagerly(cumulus):
    backend = _CountingBackend()

    def scaled_sum(a, b):
        return (a * 2 + b).sum()

    compiled = torch.compile(scaled_sum, backend=backend)
    a, b = torch.arange(4.0), torch.ones(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert compiled(a.to("cumulus"), b.to("cumulus")).item() == 16.0
    assert backend.graphs == 0
    assert compiled(a, b).item() == 16.0
    assert backend.graphs == 1


def test_decorator_form_falls_back_too(cumulus):
    @torch.compile(dynamic=False)
    def double(x):
        return x * 2

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert double(torch.ones(2, device="cumulus")).tolist() == [2.0, 2.0]


def test_fallback_warns_once_per_process(cumulus, fresh_warning):
    model = torch.nn.Linear(4, 2).to("cumulus")
    first = torch.compile(model, backend=_CountingBackend())
    second = torch.compile(lambda x: x + 1, backend=_CountingBackend())
    x = torch.ones(1, 4, device="cumulus")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first(x)
        first(x)
        second(x)
    assert [str(w.message) for w in caught] == [compile_fallback.EAGER_WARNING]
