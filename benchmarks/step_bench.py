"""Training-step benchmark: what the cumulus device adds per op on real steps.

Each workload (``cumulus_p2p.testing.models.WORKLOADS``) trains with a plain
``torch.optim.Adam(model.parameters())``, ``loss.item()`` every step, on a real executor
process over loopback. Prints one JSON object and writes ``benchmarks/results/step.json``::

    python benchmarks/step_bench.py [--quick] [--device cpu|cuda] [--workloads a,b]
                                    [--isolation shared|worker] [--compile]
                                    [--graph-compiler loop|inductor]

Per workload:

- ``<name>_ops_per_step``: ops the executor ran per step (views never leave the client);
- ``<name>_records_per_step``: records the client sent per step (an op, or a graph call);
- ``<name>_client_ms``: time to build a step (zero_grad, forward, backward, ``opt.step()``)
  before its final sync; ``<name>_client_us_per_op`` is that over the ops;
- ``<name>_dispatches_per_step``: aten ops the client's ``__torch_dispatch__`` saw in a
  step, views included; ``<name>_client_us_per_dispatch`` is ``client_ms`` over them
  (compare with ``dispatch_floor.py``, what any Python subclass pays per dispatch);
- ``<name>_executor_us_per_op``: the executor's busy time per op (session stats);
- ``<name>_plans_per_step``: op plans the client had to build in a steady step (0 is right);
- ``<name>_phase_ms``: ``client_ms`` by part (``PHASES``), each the median over the steps;
- ``<name>_step_ratio``: median remote step over median local CPU step (steps alternate,
  so load on this small machine falls on both alike). CPU executor only.

With ``--device cuda`` the executor runs on CUDA and native CUDA is timed in a separate
process that never imports ``cumulus_p2p.remote``: ``<name>_native_cuda_ms``,
``<name>_remote_ms`` and ``<name>_cuda_ratio``; with ``--compile`` each compiled arm has its
native counterpart, compiled the same way (``<name>_compiled_cuda_ratio``,
``<name>_compiled_opt_cuda_ratio``).

``--compile`` also trains each workload with ``torch.compile(model)`` (issue 13), locally
too, and adds the same keys with ``compiled_`` after the name: ``<name>_compiled_client_ms``,
``<name>_compiled_step_ratio`` (remote compiled over local compiled, inductor on the CPU)...
and then with the optimizer step compiled as well (``torch.compile(opt.step)``), as
``<name>_compiled_opt_...``.

``--native`` times each workload on the native C++ device instead (issue 30), each in a
process of its own that loads it, against a ``cumulus-executor`` on the same device, and
writes ``step[_cuda]_native.json``: ``<name>_native_client_ms`` (building a step before
its sync), ``<name>_native_ops_per_step`` (op records sent), ``<name>_native_client_us_per_op``,
``<name>_native_remote_ms`` and, on a CPU executor, ``<name>_local_ms`` and
``<name>_native_step_ratio``. ``plain_us_per_dispatch`` is measured in the same run
(``dispatch_floor.py``'s plain tiny step, compute negligible), and
``<name>_native_client_per_op_over_plain`` is the client's cost per sent op over it
(issue 30's target: 3 or less). On a CUDA executor, ``<name>_native_cuda_ms`` is the
same step on native CUDA in a process without cumulus, and ``<name>_native_over_cuda``
the native device's step over it (issue 30's GPU targets: 1.3, and 1.05 for gpt_large).

``--isolation worker`` runs the session in a worker process of its own behind the
executor's supervisor (issue 12), to compare with ``shared`` (every session in the
executor's process); results then go to ``step[_cuda]_worker.json``.
``--graph-compiler inductor`` has the executor compile the graphs of compiled steps for
its device (``graph_compiler.py``); results then go to ``step[_cuda]_inductor.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from cumulus_p2p.testing.models import WORKLOADS

CPU_WORKLOADS = ["mlp_tiny", "transformer_tiny", "transformer_bench", "gpt"]
CUDA_WORKLOADS = [*CPU_WORKLOADS, "gpt_large"]


#: What ``--compile`` compiles: the model, then the model and the optimizer step.
COMPILED = {"": "", "model": "compiled_", "step": "compiled_opt_"}


#: The parts of building a step, timed one by one into ``step.phases``.
PHASES = ("zero_grad", "forward", "loss", "backward", "optimizer")


def trainer(name: str, device: str, compiled: str = ""):
    """One step of workload ``name`` on ``device`` per call: returns (build_s, step_s),
    and leaves the seconds each of ``PHASES`` took in ``step.phases``.

    ``compiled`` is a key of ``COMPILED``: nothing, the model, or the model and the step.
    """
    spec = WORKLOADS[name]
    torch.manual_seed(0)
    model = spec.make_model().to(device)
    opt = torch.optim.Adam(model.parameters())
    forward = torch.compile(model) if compiled else model
    opt_step = torch.compile(opt.step) if compiled == "step" else opt.step
    gen = torch.Generator().manual_seed(0)
    batches = [tuple(t.to(device) for t in spec.make_batch(gen)) for _ in range(2)]
    count = iter(range(1 << 62))

    def step() -> tuple[float, float]:
        x, y = batches[next(count) % len(batches)]
        t0 = time.perf_counter()
        opt.zero_grad()
        t_zero = time.perf_counter()
        out = forward(x)
        t_forward = time.perf_counter()
        loss = spec.loss(out, y)
        t_loss = time.perf_counter()
        loss.backward()
        t_backward = time.perf_counter()
        opt_step()
        t1 = time.perf_counter()
        marks = (t0, t_zero, t_forward, t_loss, t_backward, t1)
        step.phases = [b - a for a, b in itertools.pairwise(marks)]
        loss.item()  # a sync point every step, as real loops log the loss
        return t1 - t0, time.perf_counter() - t0

    return step


def native_cuda_ms(name: str, steps: int, compiled: str = "") -> float:
    """Median native CUDA step of ``name`` (compiled as ``compiled`` says), timed in a fresh
    process without cumulus."""
    code = (
        "import json, statistics, sys; sys.path.insert(0, 'benchmarks'); import step_bench; "
        f"step = step_bench.trainer({name!r}, 'cuda', {compiled!r}); [step() for _ in range(3)]; "
        f"ms = [step()[1] * 1e3 for _ in range({steps})]; "
        "assert 'cumulus_p2p.remote' not in sys.modules; "
        "print(json.dumps(statistics.median(ms)))"
    )
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def native_cuda_arms(name: str, steps: int, arms, remote_keys: dict) -> dict:
    """Each arm's native CUDA step (in processes of their own) and remote over native."""
    out = {}
    for compiled in arms:
        prefix = f"{name}_{COMPILED[compiled]}"
        native = native_cuda_ms(name, steps, compiled)
        out[f"{prefix}native_cuda_ms"] = round(native, 2)
        out[f"{prefix}cuda_ratio"] = round(remote_keys[f"{prefix}remote_ms"] / native, 3)
    return out


@contextmanager
def counting_dispatches() -> Iterator[list[int]]:
    """Count the calls to ``RemoteTensor.__torch_dispatch__`` while inside."""
    from cumulus_p2p.remote.tensor import RemoteTensor

    dispatch = RemoteTensor.__torch_dispatch__.__func__
    count = [0]

    def counted(cls, func, types, args=(), kwargs=None):
        count[0] += 1
        return dispatch(cls, func, types, args, kwargs)

    RemoteTensor.__torch_dispatch__ = classmethod(counted)
    try:
        yield count
    finally:
        RemoteTensor.__torch_dispatch__ = classmethod(dispatch)


def measure(name: str, steps: int, device: str, compiled: str = "") -> dict:
    """Time ``name`` through the attached session (and locally on CPU, alternating)."""
    from cumulus_p2p.remote import current_session
    from cumulus_p2p.remote.tensor import plan_count

    session = current_session()
    far = trainer(name, "cumulus", compiled)
    local = trainer(name, "cpu", compiled) if device == "cpu" else None
    for _ in range(3):  # the first steps build plans and optimizer state
        far()
        if local is not None:
            local()
    with counting_dispatches() as dispatches:
        far()
    before, plans, records = session.stats(), plan_count(), session.ops_sent
    builds, remote_steps, local_steps, phases = [], [], [], []
    for _ in range(steps):
        build, total = far()
        builds.append(build)
        phases.append(far.phases)
        remote_steps.append(total)
        if local is not None:
            local_steps.append(local()[1])
    plans = plan_count() - plans
    records = (session.ops_sent - records) / steps
    after = session.stats()
    ops = (after["ops"] - before["ops"]) / steps
    client_ms = statistics.median(builds) * 1e3
    out = {
        "ops_per_step": round(ops),
        "records_per_step": round(records),
        "client_ms": round(client_ms, 2),
        "client_us_per_op": round(client_ms * 1e3 / ops, 1),
        "dispatches_per_step": dispatches[0],
        "client_us_per_dispatch": round(client_ms * 1e3 / dispatches[0], 1),
        "executor_us_per_op": round((after["busy_s"] - before["busy_s"]) / steps / ops * 1e6, 1),
        "plans_per_step": plans / steps,
        "remote_ms": round(statistics.median(remote_steps) * 1e3, 2),
        "phase_ms": {
            phase: round(statistics.median(times) * 1e3, 3)
            for phase, times in zip(PHASES, zip(*phases, strict=True), strict=True)
        },
    }
    if local_steps:
        out["local_ms"] = round(statistics.median(local_steps) * 1e3, 2)
        out["step_ratio"] = round(out["remote_ms"] / out["local_ms"], 3)
    prefix = f"{name}_{COMPILED[compiled]}"
    return {prefix + key: value for key, value in out.items()}


def native_arm(name: str, steps: int, device: str) -> dict:
    """Workload ``name`` on the native device, in this process, which must not have
    imported ``cumulus_p2p.remote``; alternating with local CPU steps on a CPU."""
    from cumulus_p2p import native

    ext = native.load()  # before any backward: autograd sizes its device queues once
    from cumulus_p2p.native.session import NativeSession
    from cumulus_p2p.testing.executor import executor_process

    with executor_process(device=device, quota="64GiB") as (address, _):
        host, _, port = address.rpartition(":")
        with NativeSession.connect(host, int(port)):
            far = trainer(name, "cumulus")
            local = trainer(name, "cpu") if device == "cpu" else None
            for _ in range(3):
                far()
                if local is not None:
                    local()
            ops_before = ext.ops_recorded()
            builds, remote_steps, local_steps = [], [], []
            for _ in range(steps):
                build, total = far()
                builds.append(build)
                remote_steps.append(total)
                if local is not None:
                    local_steps.append(local()[1])
            ops = (ext.ops_recorded() - ops_before) / steps
    client_ms = statistics.median(builds) * 1e3
    out = {
        "native_ops_per_step": round(ops),
        "native_client_ms": round(client_ms, 2),
        "native_client_us_per_op": round(client_ms * 1e3 / ops, 2),
        "native_remote_ms": round(statistics.median(remote_steps) * 1e3, 2),
    }
    if local_steps:
        out["local_ms"] = round(statistics.median(local_steps) * 1e3, 2)
        out["native_step_ratio"] = round(out["native_remote_ms"] / out["local_ms"], 3)
    return {f"{name}_{key}": value for key, value in out.items()}


def _native_main(names: list[str], steps_for, device: str) -> dict:
    """Every workload's native arm in a process of its own, and the plain floor."""
    import dispatch_floor

    torch.set_num_threads(1)
    plain_us, _ = dispatch_floor.plain_us_per_dispatch(30)
    result: dict = {"executor_device": device, "plain_us_per_dispatch": round(plain_us, 2)}
    for name in names:
        command = [sys.executable, __file__, "--native-arm", name, "--device", device]
        command += ["--steps", str(steps_for(name))]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"the native arm of {name} failed:\n{done.stderr}")
        workload = json.loads(done.stdout.strip().splitlines()[-1])
        per_op = workload[f"{name}_native_client_us_per_op"]
        workload[f"{name}_native_client_per_op_over_plain"] = round(per_op / plain_us, 2)
        if device == "cuda":
            cuda_ms = native_cuda_ms(name, 2 * steps_for(name))
            workload[f"{name}_native_cuda_ms"] = round(cuda_ms, 2)
            ratio = workload[f"{name}_native_remote_ms"] / cuda_ms
            workload[f"{name}_native_over_cuda"] = round(ratio, 3)
        result.update(workload)
        print(f"step_bench: {name} {json.dumps(workload)}", file=sys.stderr, flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (within 60 s)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--workloads", help="comma-separated subset of the workloads")
    parser.add_argument(
        "--isolation",
        choices=["shared", "worker"],
        default="shared",
        help="sessions in the executor's process, or each in a worker process",
    )
    parser.add_argument(
        "--graph-compiler",
        choices=["loop", "inductor"],
        default="loop",
        help="how the executor runs compiled graphs (default loop: node by node)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="also time torch.compile(model) steps, then with torch.compile(opt.step) too",
    )
    parser.add_argument("--native", action="store_true", help="the native C++ device")
    parser.add_argument("--native-arm", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.native_arm:
        print(json.dumps(native_arm(args.native_arm, args.steps, args.device)))
        return
    names = args.workloads.split(",") if args.workloads else None
    names = names or (CUDA_WORKLOADS if args.device == "cuda" else CPU_WORKLOADS)
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {sorted(WORKLOADS)}")

    def steps_for(name: str) -> int:
        return 5 if args.quick or name.startswith("gpt") else 20

    if args.native:
        result = _native_main(names, steps_for, args.device)
        print(json.dumps(result, indent=2))
        suffix = "" if args.device == "cpu" else f"_{args.device}"
        out = Path(__file__).parent / "results" / f"step{suffix}_native.json"
        out.write_text(json.dumps(result, indent=2) + "\n")
        return

    import cumulus_p2p.remote as remote
    from cumulus_p2p.testing.executor import executor_process

    result: dict = {
        "executor_device": args.device,
        "isolation": args.isolation,
        "graph_compiler": args.graph_compiler,
    }
    mode = "--worker-per-session" if args.isolation == "worker" else "--shared-process"
    extra = [mode, "--graph-compiler", args.graph_compiler]
    arms = ("", "model", "step") if args.compile else ("",)
    with executor_process(device=args.device, quota="64GiB", extra=extra) as (address, _):
        with remote.attach(address):
            for name in names:
                steps = steps_for(name)
                workload: dict = {}
                for compiled in arms:
                    workload.update(measure(name, steps, args.device, compiled))
                if args.device == "cuda":
                    workload.update(
                        native_cuda_arms(name, 10 if args.quick else 30, arms, workload)
                    )
                result.update(workload)
                # Each workload as it ends: a run cut short still shows what it measured.
                print(f"step_bench: {name} {json.dumps(workload)}", file=sys.stderr, flush=True)
    print(json.dumps(result, indent=2))
    suffix = "" if args.device == "cpu" else f"_{args.device}"
    suffix += "_worker" if args.isolation == "worker" else ""
    suffix += "_inductor" if args.graph_compiler == "inductor" else ""
    out = Path(__file__).parent / "results" / f"step{suffix}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
