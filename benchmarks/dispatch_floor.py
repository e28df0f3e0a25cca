"""What any Python tensor subclass pays per aten op on a real training step (issue 11).

The ``cumulus`` device is a ``__torch_dispatch__`` wrapper subclass, so every aten op a
step dispatches, views included, crosses from torch's C++ dispatcher into Python and back
with a new wrapper per output. This script measures that floor without cumulus: the
same tiny transformer step (forward, backward, foreach Adam) runs once on plain CPU
tensors and once with every tensor wrapped in the smallest useful wrapper subclass (it
unwraps the arguments, runs the op, wraps the outputs). Widths are tiny so that compute
is negligible and what remains is per-op overhead. Prints JSON and writes
``benchmarks/results/dispatch_floor.json``::

    python benchmarks/dispatch_floor.py [--steps 30] [--quick]

- ``dispatches_per_step``: aten ops the step dispatches (views and detaches included);
- ``plain_us_per_dispatch``: the plain CPU step over its dispatches;
- ``wrapper_us_per_dispatch``: the wrapped step over the same dispatches;
- ``subclass_overhead_us_per_dispatch``: the difference, which no Python subclass avoids;
- ``cumulus_us_per_dispatch``: the same step on the native C++ ``cumulus`` device
  (``cumulus_p2p.native``, issue 30) over the same dispatches, and
  ``cumulus_over_plain``: its ratio to plain, the issue's target being 2 or less. The
  device only *records* here: each step's ops become wire records in a batch, which the
  step takes (as a flush would), but no executor runs them. So this is the client's
  cost alone. ``cumulus_records_per_step`` and ``cumulus_batch_bytes_per_step`` say
  what one step sends. Without a C++ compiler the arm is skipped and
  ``cumulus_skipped`` says why.

The native device owns PrivateUse1 in its process, so this script must not import
``cumulus_p2p.remote`` (it does not).

Compare with ``step_bench``'s ``<name>_client_us_per_dispatch``: the cumulus client's cost
per dispatch on real steps, of which this floor is the larger part.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from cumulus_p2p import native
from cumulus_p2p.testing.benchargs import median_seconds
from cumulus_p2p.testing.models import TinyTransformer

VOCAB = 16


class Wrapped(torch.Tensor):
    """The least a wrapper subclass can do: forward each op to the tensor it wraps."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, inner: torch.Tensor):  # noqa: D102
        outer = torch.Tensor._make_wrapper_subclass(
            cls,
            inner.shape,
            strides=inner.stride(),
            storage_offset=inner.storage_offset(),
            dtype=inner.dtype,
            device=inner.device,
        )
        outer.inner = inner
        return outer

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        args, kwargs = tree_map_only(Wrapped, lambda t: t.inner, (args, kwargs or {}))
        return tree_map_only(torch.Tensor, Wrapped, func(*args, **kwargs))


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _wrap(model: torch.nn.Module, *tensors: torch.Tensor):
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                module._parameters[name] = torch.nn.Parameter(Wrapped(param.detach()))
    return [Wrapped(t) for t in tensors]


class _Flush:
    """Takes the native device's batch at the end of each step, as a session's flush would."""

    def __init__(self) -> None:
        self.take_batch = native.load().take_batch
        self.last: tuple[bytes, int] = (b"", 0)

    def __call__(self) -> None:
        self.last = self.take_batch()


def _step_fn(arm: str, flush: _Flush | None = None):
    """One training step on `arm`: "plain" CPU, "wrapped" in ``Wrapped``, or "cumulus"."""
    torch.manual_seed(0)
    model = TinyTransformer(vocab=VOCAB, dim=8, heads=2, layers=4, ctx=4)
    x = torch.randint(0, VOCAB, (1, 4))
    y = torch.roll(x, -1, dims=1)
    if arm == "wrapped":
        x, y = _wrap(model, x, y)
    elif arm == "cumulus":
        model, x, y = model.to("cumulus"), x.to("cumulus"), y.to("cumulus")
    opt = torch.optim.Adam(model.parameters(), foreach=True)

    def step() -> None:
        opt.zero_grad()
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        opt.step()
        if flush is not None:
            flush()

    return step


def plain_us_per_dispatch(steps: int) -> tuple[float, int]:
    """The plain CPU step's time per aten dispatch (median over ``steps``), and its
    dispatches per step: the floor any device's client is measured against."""
    plain = _step_fn("plain")
    plain()
    counter = _Count()
    with counter:
        plain()
    return median_seconds(plain, steps) / counter.ops * 1e6, counter.ops


def _cumulus_arm(plain_us: float, ops: int, steps: int) -> dict:
    """The native device's keys, or why it was skipped."""
    reason = native.missing_toolchain()
    if reason is not None:
        return {"cumulus_skipped": reason}
    flush = _Flush()
    step = _step_fn("cumulus", flush)
    cumulus_us = median_seconds(step, steps) / ops * 1e6
    data, records = flush.last
    return {
        "cumulus_us_per_dispatch": round(cumulus_us, 1),
        "cumulus_over_plain": round(cumulus_us / plain_us, 2),
        "cumulus_records_per_step": records,
        "cumulus_batch_bytes_per_step": len(data),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="5 timed steps per arm")
    args = parser.parse_args()
    steps = 5 if args.quick else args.steps
    torch.set_num_threads(1)
    if native.missing_toolchain() is None:
        # Before any backward: autograd sizes its per-device queues once per process.
        native.load()
    plain_us, ops = plain_us_per_dispatch(steps)
    wrapped = _step_fn("wrapped")
    wrapped_us = median_seconds(wrapped, steps) / ops * 1e6
    result = {
        "dispatches_per_step": ops,
        "plain_us_per_dispatch": round(plain_us, 1),
        "wrapper_us_per_dispatch": round(wrapped_us, 1),
        "subclass_overhead_us_per_dispatch": round(wrapped_us - plain_us, 1),
        **_cumulus_arm(plain_us, ops, steps),
    }
    print(json.dumps(result, indent=2))
    out = Path(__file__).parent / "results" / "dispatch_floor.json"
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
