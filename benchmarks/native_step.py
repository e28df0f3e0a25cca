"""Eager steps through the native device and its C++ executor, against local eager CPU.

Issue 30's tiny-width arm: ``client_floor.py``'s shape (transformer_bench's 4 layers and
52 parameter tensors at vocab 64, dim 16, 2 heads, 16 tokens, batch 2; dropout 0), so
compute is negligible, as on a GPU, and what is timed is the per-step work of the
libraries. Each arm runs in a process of its own (the native device cannot share a
process with ``cumulus_p2p.remote``), arms in turn, over several passes:

- ``local``: the step on local CPU tensors, eager (forward, backward, foreach Adam,
  ``loss.item()``).
- ``cumulus``: the same step on the native ``cumulus`` device, its batches sent over
  loopback TCP to a ``cumulus-executor`` process (one thread) whenever they hold 16 KiB
  (the session's default), and at the ``item()`` sync. The executor replays them with
  the C++ loop (``csrc/replay.cpp``) while the client records the rest, and sends the
  loss back. Then, in the same process, ``eager_cumulus_sync_only_ms``: the same with
  the whole step sent at the sync; ``eager_cumulus_compat_ms``: the default with CUDA
  compatibility mode on, as the shim runs a script (its torch function mode sees every
  torch call); ``eager_cumulus_secure_ms``: the default over the secure channel to
  ``cumulus-executor --secure``, as a leased session runs. Then the
  executor's cost alone: the same step's batches replayed by a ``Replayer`` in-process,
  timed around ``replay`` only.
- ``compiled``: the same step with ``torch.compile(model)``: locally (inductor), and on
  the native device, whose forward and backward graphs go to the host whole and run
  there node by node (the executor's default ``--graph-compiler loop``), or as code
  inductor compiled for the host's device (``--graph-compiler inductor``).

Prints JSON and writes ``benchmarks/results/native_step.json``::

    python benchmarks/native_step.py [--quick] [--steps N] [--passes N]

Keys: ``eager_local_ms`` and ``eager_cumulus_ms`` (median step, median over passes),
``cumulus_over_local`` (issue 30's target: ≤ 1.5), ``compat_over_cumulus`` (what CUDA
compatibility mode adds), ``executor_us_per_op`` (replay time
per op record) beside ``local_us_per_op`` (the local step over the same op count) and
their ratio (target ≤ 2), plus ``ops_per_step``, ``records_per_step`` and
``batch_bytes_per_step``. Compiled: ``compiled_local_ms``, ``compiled_cumulus_ms``,
``compiled_cumulus_inductor_ms``, ``compiled_records_per_step`` (the step's op
records: two graph calls and the optimizer's ops) and
``compiled_cumulus_over_eager_local``. Compiled at changing lengths (``LENGTHS`` in turn,
so dynamo's graphs get symbolic sizes): ``dynamic_compiled_local_ms``,
``dynamic_compiled_cumulus_ms`` and ``dynamic_compiled_records_per_step``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cumulus_p2p.testing.benchargs import median_seconds

VOCAB, DIM, HEADS, LAYERS, CTX, BATCH = 64, 16, 2, 4, 16, 2


def _setup(device: str, compiled: bool = False, lengths: tuple[int, ...] = (CTX,)):
    """One training step per call; each call's batch as long as the next of ``lengths``."""
    import itertools

    import torch
    import torch.nn.functional as F

    from cumulus_p2p.testing.models import TinyTransformer

    torch.manual_seed(0)
    model = TinyTransformer(vocab=VOCAB, dim=DIM, heads=HEADS, layers=LAYERS, ctx=CTX, dropout=0.0)
    x = torch.randint(0, VOCAB, (BATCH, CTX))
    y = torch.roll(x, -1, dims=1)
    model, x, y = model.to(device), x.to(device), y.to(device)
    opt = torch.optim.Adam(model.parameters(), foreach=True)
    forward = torch.compile(model) if compiled else model
    cycle = itertools.cycle(lengths)

    def step() -> float:
        n = next(cycle)
        opt.zero_grad()
        loss = F.cross_entropy(forward(x[:, :n]).reshape(-1, VOCAB), y[:, :n].reshape(-1))
        loss.backward()
        opt.step()
        return loss.item()

    return step


#: The dynamic arm's batch lengths, in turn: dynamo's graphs get symbolic sizes.
LENGTHS = (16, 12, 14)


def _local_arm(steps: int) -> dict:
    import torch

    torch.set_num_threads(1)
    return {
        "eager_local_ms": median_seconds(_setup("cpu"), steps) * 1e3,
        "compiled_local_ms": median_seconds(_setup("cpu", compiled=True), steps) * 1e3,
        "dynamic_compiled_local_ms": median_seconds(_dynamic_step("cpu"), steps, warmup=0) * 1e3,
    }


def _dynamic_step(device: str):
    """The compiled step at ``LENGTHS`` in turn, run past each length's capture."""
    step = _setup(device, compiled=True, lengths=LENGTHS)
    for _ in range(2 * len(LENGTHS)):
        step()
    return step


class _InProcess:
    """Readback and sync hooks that replay the batch in this process, timing ``replay``
    alone; attention takes the CPU's fused kernel, as in a session with a CPU executor."""

    def __init__(self, ext) -> None:
        from cumulus_p2p.native.executor import new_replayer
        from cumulus_p2p.native.records import decode

        self.ext, self.decode = ext, decode
        self.replayer = new_replayer("cpu")
        self.names_sent = 0
        self.replay_s: list[float] = []
        self.last: tuple[bytes, list[str]] = (b"", [])
        ext.begin_session()
        ext.set_readback_hook(self)
        ext.set_sync_hook(self.sync)
        ext.set_executor_device("cpu")

    def _replay(self) -> list[bytes]:
        batch, _ = self.ext.take_batch()
        names = self.ext.op_names(self.names_sent)
        self.names_sent += len(names)
        started = time.perf_counter()
        out = self.replayer.replay(batch, names)
        self.replay_s.append(time.perf_counter() - started)
        self.last = (batch, self.ext.op_names())
        return out

    def __call__(self, src, dst) -> None:
        import torch

        (data,) = self._replay()
        dst.copy_(torch.frombuffer(bytearray(data), dtype=src.dtype).reshape(src.shape))

    def sync(self) -> bytes:
        return self._replay()[-1]

    def close(self) -> None:
        self.ext.set_readback_hook(None)
        self.ext.set_sync_hook(None)
        self.ext.set_executor_device("")


def _cumulus_arm(steps: int) -> dict:
    import torch

    from cumulus_p2p import cuda_compat, native
    from cumulus_p2p.native.records import Op

    ext = native.load()
    torch.set_num_threads(1)
    from cumulus_p2p.native.session import NativeSession
    from cumulus_p2p.testing.executor import executor_process, secure_executor_channel

    one_thread = {"OMP_NUM_THREADS": "1"}
    with executor_process(env=one_thread) as (address, _):
        host, port = address.split(":")
        with NativeSession.connect(host, int(port)):
            eager_cumulus_ms = median_seconds(_setup("cumulus"), steps) * 1e3
        with NativeSession.connect(host, int(port), flush_bytes=0):
            sync_only_ms = median_seconds(_setup("cumulus"), steps) * 1e3
        with NativeSession.connect(host, int(port)), cuda_compat.cuda_compat(native.load):
            compat_ms = median_seconds(_setup("cumulus"), steps) * 1e3
        with NativeSession.connect(host, int(port)):
            compiled_step = _setup("cumulus", compiled=True)
            compiled_ms = median_seconds(compiled_step, steps) * 1e3
            before = ext.ops_recorded()
            compiled_step()
            compiled_records = ext.ops_recorded() - before
        torch._dynamo.reset()  # the compiled arm's captures go: these lengths get their own
        with NativeSession.connect(host, int(port)):
            dynamic_step = _dynamic_step("cumulus")
            before = ext.ops_recorded()
            for _ in range(len(LENGTHS)):
                dynamic_step()
            dynamic_records = (ext.ops_recorded() - before) / len(LENGTHS)
            dynamic_ms = median_seconds(dynamic_step, steps, warmup=0) * 1e3
    inductor = ["--graph-compiler", "inductor"]
    with executor_process(env=one_thread, extra=inductor) as (address, _):
        host, port = address.split(":")
        with NativeSession.connect(host, int(port)):
            inductor_ms = median_seconds(_setup("cumulus", compiled=True), steps) * 1e3
    with tempfile.TemporaryDirectory() as data_dir:
        with secure_executor_channel(data_dir, env=one_thread) as (channel, _):
            with NativeSession(channel):
                secure_ms = median_seconds(_setup("cumulus"), steps) * 1e3
    hook = _InProcess(ext)
    median_seconds(_setup("cumulus"), steps)  # the batches the executor's figure replays
    batch, names = hook.last
    records = hook.decode(batch, names)
    ops = sum(isinstance(r, Op) for r in records)
    executor_ms = statistics.median(hook.replay_s[3:]) * 1e3
    hook.close()
    return {
        "eager_cumulus_ms": eager_cumulus_ms,
        "eager_cumulus_sync_only_ms": sync_only_ms,
        "eager_cumulus_compat_ms": compat_ms,
        "eager_cumulus_secure_ms": secure_ms,
        "compiled_cumulus_ms": compiled_ms,
        "compiled_records_per_step": compiled_records,
        "compiled_cumulus_inductor_ms": inductor_ms,
        "dynamic_compiled_cumulus_ms": dynamic_ms,
        "dynamic_compiled_records_per_step": dynamic_records,
        "executor_ms_per_step": executor_ms,
        "ops_per_step": ops,
        "records_per_step": len(records),
        "batch_bytes_per_step": len(batch),
    }


def run_arm(arm: str, steps: int) -> dict:
    """``arm`` ("local" or "cumulus") timed over ``steps`` in a process of its own."""
    done = subprocess.run(
        [sys.executable, __file__, "--arm", arm, "--steps", str(steps)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"arm {arm} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 pass of 10 timed steps")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--arm", choices=("local", "cumulus"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:
        arm = _local_arm if args.arm == "local" else _cumulus_arm
        print(json.dumps(arm(args.steps)))
        return
    from cumulus_p2p import native

    reason = native.missing_toolchain()
    if reason is not None:
        print(json.dumps({"skipped": f"the native device cannot be built here: {reason}"}))
        return
    steps, passes = (10, 1) if args.quick else (args.steps, args.passes)
    runs: dict[str, list] = {}
    for _ in range(passes):
        for arm in ("local", "cumulus"):
            for key, value in run_arm(arm, steps).items():
                runs.setdefault(key, []).append(value)
    m = {key: statistics.median(values) for key, values in runs.items()}
    ops = int(m["ops_per_step"])
    executor_us = m["executor_ms_per_step"] * 1e3 / ops
    local_us = m["eager_local_ms"] * 1e3 / ops
    result = {
        "eager_local_ms": round(m["eager_local_ms"], 2),
        "eager_cumulus_ms": round(m["eager_cumulus_ms"], 2),
        "cumulus_over_local": round(m["eager_cumulus_ms"] / m["eager_local_ms"], 2),
        "eager_cumulus_sync_only_ms": round(m["eager_cumulus_sync_only_ms"], 2),
        "eager_cumulus_compat_ms": round(m["eager_cumulus_compat_ms"], 2),
        "compat_over_cumulus": round(m["eager_cumulus_compat_ms"] / m["eager_cumulus_ms"], 2),
        "eager_cumulus_secure_ms": round(m["eager_cumulus_secure_ms"], 2),
        "compiled_local_ms": round(m["compiled_local_ms"], 2),
        "compiled_cumulus_ms": round(m["compiled_cumulus_ms"], 2),
        "compiled_cumulus_over_eager_local": round(
            m["compiled_cumulus_ms"] / m["eager_local_ms"], 2
        ),
        "compiled_cumulus_inductor_ms": round(m["compiled_cumulus_inductor_ms"], 2),
        "compiled_records_per_step": int(m["compiled_records_per_step"]),
        "dynamic_compiled_local_ms": round(m["dynamic_compiled_local_ms"], 2),
        "dynamic_compiled_cumulus_ms": round(m["dynamic_compiled_cumulus_ms"], 2),
        "dynamic_compiled_records_per_step": round(m["dynamic_compiled_records_per_step"], 1),
        "executor_ms_per_step": round(m["executor_ms_per_step"], 2),
        "executor_us_per_op": round(executor_us, 2),
        "local_us_per_op": round(local_us, 2),
        "executor_over_local_per_op": round(executor_us / local_us, 2),
        "ops_per_step": ops,
        "records_per_step": int(m["records_per_step"]),
        "batch_bytes_per_step": int(m["batch_bytes_per_step"]),
        "passes": passes,
        "steps_per_pass": steps,
    }
    print(json.dumps(result, indent=2))
    out = Path(__file__).parent / "results" / "native_step.json"
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
