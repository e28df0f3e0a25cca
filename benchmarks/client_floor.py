"""What a compiled training step costs the client, against what PyTorch alone costs.

Issue 13 asks for ``transformer_bench_compiled_client_ms`` ≤ 1 ms on this machine. This
puts that figure beside the same step run by PyTorch alone: each arm in a process of its
own, the arms in turn, three passes, so that drift on a small machine falls on all of
them. Every arm trains ``transformer_bench``'s shape (4 layers, 52 parameter tensors,
Adam) at widths shrunk until compute is negligible (vocab 64, dim 16, 2 heads, 16 tokens,
batch 2), so what is timed is the per-step work of the libraries, not arithmetic:

- ``cumulus``: the model and the optimizer step compiled, through cumulus (a CPU
  executor in another process): ``step_bench``'s loop and timing (the step's build, up
  to the ``item`` sync).
- ``local_compiled``: the same code on local CPU tensors, ``torch.compile`` (dynamo,
  inductor) of the model and of the optimizer step.
- ``local_eager``: the same code on local CPU tensors, nothing compiled.
- ``torch_floor``: only what PyTorch's API costs per step once the model is one autograd
  node: ``zero_grad``, one ``autograd.Function`` over the 52 parameters, the eager loss
  and its backward, 52 fresh gradients stored by ``AccumulateGrad``, no optimizer
  arithmetic. No remote design that keeps ``loss.backward()`` and ``.grad`` goes below it.
- ``*_loss_in_model``: the loss computed inside the compiled model, as nanoGPT's
  ``forward(idx, targets)`` does, for ``cumulus`` and ``local_compiled``.

Prints JSON and writes ``benchmarks/results/client_floor.json``::

    python benchmarks/client_floor.py [--quick] [--steps N]

Per arm: ``<arm>_client_ms`` (median step; the median over passes) and, where the step
has them, ``<arm>_phase_ms`` (median per part, as ``step_bench``'s). Then issue 30's
tiny-width arm, ``native_step.py``'s: ``eager_local_ms`` and ``eager_cumulus_ms``, the
whole eager step (to its ``loss.item()``) locally and on the native device, and
``eager_cumulus_over_local`` (target: 1.5 or less).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from cumulus_p2p.testing import models

sys.path.insert(0, str(Path(__file__).parent))

import step_bench  # noqa: E402

VOCAB, DIM, HEADS, LAYERS, CTX, BATCH = 64, 16, 2, 4, 16, 2
NAME = "transformer_bench_shape"  # registered in ``models.WORKLOADS`` for step_bench


def _model() -> nn.Module:
    return models.TinyTransformer(vocab=VOCAB, dim=DIM, heads=HEADS, layers=LAYERS, ctx=CTX)


class _LossInModel(nn.Module):
    """nanoGPT's shape of ``forward``: the loss is part of the compiled model."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _model()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return models._lm_loss(self.model(idx), targets)


def loss_in_model(device: str) -> Callable[[], float]:
    """A step with the loss inside the compiled model; returns its build seconds."""
    torch.manual_seed(0)
    model = _LossInModel().to(device)
    opt = torch.optim.Adam(model.parameters())
    forward, opt_step = torch.compile(model), torch.compile(opt.step)
    gen = torch.Generator().manual_seed(0)
    x, y = (t.to(device) for t in models._lm_batches(VOCAB, BATCH, CTX)(gen))

    def step() -> float:
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = forward(x, y)
        loss.backward()
        opt_step()
        t1 = time.perf_counter()
        loss.item()
        return t1 - t0

    return step


def torch_floor() -> Callable[[], float]:
    """PyTorch's per-step API alone, the model standing in as one autograd node."""
    torch.manual_seed(0)
    params = list(_model().parameters())
    opt = torch.optim.Adam(params)
    gen = torch.Generator().manual_seed(0)
    _, y = models._lm_batches(VOCAB, BATCH, CTX)(gen)
    logits = torch.zeros(BATCH, CTX, VOCAB)

    class Model(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            return logits.clone()

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, grad):
            return tuple(torch.empty_like(p) for p in params)  # as a backward graph makes

    def step() -> tuple[float, float]:
        marks = [time.perf_counter()]
        opt.zero_grad()
        marks.append(time.perf_counter())
        out = Model.apply(*params)
        marks.append(time.perf_counter())
        loss = models._lm_loss(out, y)
        marks.append(time.perf_counter())
        loss.backward()
        marks.append(time.perf_counter())
        marks.append(time.perf_counter())  # no optimizer arithmetic
        step.phases = [b - a for a, b in itertools.pairwise(marks)]
        loss.item()
        return marks[-1] - marks[0], 0.0

    return step


ARMS = {
    "cumulus": lambda: step_bench.trainer(NAME, "cumulus", "step"),
    "cumulus_loss_in_model": lambda: loss_in_model("cumulus"),
    "local_compiled": lambda: step_bench.trainer(NAME, "cpu", "step"),
    "local_compiled_loss_in_model": lambda: loss_in_model("cpu"),
    "local_eager": lambda: step_bench.trainer(NAME, "cpu"),
    "torch_floor": torch_floor,
}


def run_arm(arm: str, steps: int) -> dict:
    """Time ``steps`` steps of ``arm`` in this process: median build and phases (ms)."""
    step = ARMS[arm]()
    for _ in range(5):  # captures, compiles, optimizer state
        step()
    builds, phases = [], []
    for _ in range(steps):
        result = step()
        builds.append(result[0] if isinstance(result, tuple) else result)
        if hasattr(step, "phases"):
            phases.append(step.phases)
    out: dict = {"client_ms": statistics.median(builds) * 1e3}
    if phases:
        out["phase_ms"] = [statistics.median(times) * 1e3 for times in zip(*phases, strict=True)]
    return out


def arm_process(arm: str, steps: int) -> dict:
    """``run_arm`` in a fresh process: arms sharing one would share dynamo's caches for
    the same model code, and the local ones would pay for guards on each other's."""
    command = [sys.executable, __file__, "--arm", arm, "--steps", str(steps)]
    out = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one pass over the arms")
    parser.add_argument("--arm", choices=sorted(ARMS), help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=200, help="timed steps per arm and pass")
    args = parser.parse_args()
    models.WORKLOADS[NAME] = models.Task(
        _model, models._lm_batches(VOCAB, BATCH, CTX), models._lm_loss
    )
    torch.set_num_threads(1)  # as the executor runs
    if args.arm is not None:
        with _device_for(args.arm):
            print(json.dumps(run_arm(args.arm, args.steps)))
        return
    passes = 1 if args.quick else 3
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for done in range(passes):  # arms in turn, then again: drift falls on all of them
        for arm in ARMS:
            runs[arm].append(arm_process(arm, args.steps))
        print(f"client_floor: pass {done + 1}/{passes}", file=sys.stderr, flush=True)
    result: dict = {"shape": dict(vocab=VOCAB, dim=DIM, heads=HEADS, layers=LAYERS, ctx=CTX)}
    for arm, measured in runs.items():
        result[f"{arm}_client_ms"] = round(statistics.median(m["client_ms"] for m in measured), 3)
        if "phase_ms" in measured[0]:
            per_phase = zip(*(m["phase_ms"] for m in measured), strict=True)
            result[f"{arm}_phase_ms"] = {
                phase: round(statistics.median(values), 3)
                for phase, values in zip(step_bench.PHASES, per_phase, strict=True)
            }
    result |= _native_eager(passes)
    print(json.dumps(result, indent=2))
    out = Path(__file__).parent / "results" / "client_floor.json"
    out.write_text(json.dumps(result, indent=2) + "\n")


def _native_eager(passes: int) -> dict:
    """Issue 30's tiny-width arm: the same shape's eager step, local and on the native
    device (``native_step.py``'s arms, each in its own process), medians over passes."""
    import native_step

    from cumulus_p2p import native

    if native.missing_toolchain() is not None:
        return {}
    runs: dict[str, list[float]] = {"eager_local_ms": [], "eager_cumulus_ms": []}
    for _ in range(passes):
        runs["eager_local_ms"].append(native_step.run_arm("local", 30)["eager_local_ms"])
        runs["eager_cumulus_ms"].append(native_step.run_arm("cumulus", 30)["eager_cumulus_ms"])
    out = {key: round(statistics.median(values), 3) for key, values in runs.items()}
    out["eager_cumulus_over_local"] = round(out["eager_cumulus_ms"] / out["eager_local_ms"], 2)
    return out


@contextmanager
def _device_for(arm: str) -> Iterator[None]:
    """An attached session on a CPU executor in another process, for the cumulus arms."""
    if not arm.startswith("cumulus"):
        yield
        return
    import cumulus_p2p.remote as remote
    from cumulus_p2p.testing.executor import executor_process

    with executor_process(device="cpu", quota="1GiB") as (address, _):
        with remote.attach(address):
            yield


if __name__ == "__main__":
    main()
