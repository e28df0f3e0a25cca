"""One process, two devices (issue 33): tensors moved between hosts, and a split model.

A process attaches two CPU executors as ``cumulus:0`` and ``cumulus:1``
(``remote.attach([a, b])``). Every figure is measured in one run against its baseline:

- ``device_move_gb_s``: a float32 tensor moved ``cumulus:0`` to ``cumulus:1``
  (``t.to("cumulus:1")``: the hosts move it between themselves), bytes per second of
  wall time, the receiving host's sync included;
- ``move_through_consumer_gb_s``: the same move read back to this process and written
  to the other host (``t.cpu().to("cumulus:1")``: what a move costs without it);
- ``pipeline_step_s``: the median training step (forward, backward, SGD) of a model
  split in two stages across the devices, its activations and their gradients moving
  host to host (its batches uploaded before); ``pipeline_consumer_bytes_share``: the
  bytes a step adds to this process's links, over the bytes it moves between the hosts;
  ``pipeline_loss_max_diff``: its losses against the same model on this CPU.

Prints JSON and writes ``benchmarks/results/devices.json`` (not with ``--quick``)::

    python benchmarks/devices_bench.py [--quick]
    sudo .venv/bin/python benchmarks/devices_bench.py --shaped [--quick]

``--shaped`` runs on real links (``netns.shaped_mesh``, root): the executors in host
namespaces joined at 1 Gbit/s, this process in the consumer's behind 100 Mbit/s, at real
sizes: a 1 GiB model (two stages of 512 MiB weights, made on their hosts) and a 512 MiB
tensor moved. Its keys start ``shaped_``: ``shaped_move_s`` against
``shaped_move_via_consumer_floor_s`` (the tensor up and down the consumer's link at its
rate), ``shaped_pipeline_step_s`` and ``shaped_consumer_bytes_share``, and
``shaped_pipeline_via_consumer_added_floor_s``: what a step would add at least if its
moves crossed the consumer's link. It writes ``devices_shaped.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def move_gb_s(megabytes: int, rounds: int, *, through_consumer: bool) -> float:
    """Bytes per second of ``rounds`` moves of a ``megabytes`` tensor, cumulus:0 to 1."""
    tensor = torch.ones(megabytes * 2**20 // 4, device="cumulus:0")
    _move(tensor, through_consumer)  # warm: the hosts' group forms at the first move
    torch.cumulus.synchronize(1)
    started = time.perf_counter()
    moved = [_move(tensor, through_consumer) for _ in range(rounds)]
    torch.cumulus.synchronize(1)  # the receiving host has them all
    seconds = time.perf_counter() - started
    del moved
    return megabytes * 2**20 * rounds / seconds / 1e9


def _move(tensor: torch.Tensor, through_consumer: bool) -> torch.Tensor:
    return tensor.cpu().to("cumulus:1") if through_consumer else tensor.to("cumulus:1")


def stages(width: int, depth: int, device: str | None) -> tuple[torch.nn.Module, ...]:
    """A model of two stages, ``width`` wide; made on ``device`` (their hosts: nothing
    to upload) or on this CPU."""
    first = torch.nn.Sequential(torch.nn.Linear(depth, width, device=device), torch.nn.Tanh())
    second = torch.nn.Linear(width, depth, device=device)
    return first, second


def pipeline(
    first, second, batches, devices: tuple[str, str] | None, meter
) -> tuple[list[float], list[float], int]:
    """SGD steps, each stage on its device; each step's loss and seconds, and the bytes
    ``meter()`` counted on this process's links across the steps after the first. The
    batches are on their devices before the first step: the links' count is the moves'."""
    if devices is not None:
        first.to(devices[0])
        second.to(devices[1])
        batches = [(x.to(devices[0]), y.to(devices[1])) for x, y in batches]
        torch.cumulus.synchronize(0)
        torch.cumulus.synchronize(1)
    optimizer = torch.optim.SGD([*first.parameters(), *second.parameters()], lr=1e-3)
    losses, seconds, before = [], [], 0
    for step, (x, y) in enumerate(batches):
        if step == 1:
            before = meter()
        started = time.perf_counter()
        hidden = first(x)
        if devices is not None:
            hidden = hidden.to(devices[1])
        loss = torch.nn.functional.mse_loss(second(hidden), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if devices is not None:
            torch.cumulus.synchronize(0)
        seconds.append(time.perf_counter() - started)
    return losses, seconds, meter() - before


def data(steps: int, rows: int, depth: int) -> list:
    generator = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(rows, depth, generator=generator),
            torch.randn(rows, depth, generator=generator),
        )
        for _ in range(steps)
    ]


def loopback(quick: bool) -> dict:
    """Every arm on two loopback executors, this process's links metered by forwarders."""
    from cumulus_p2p import remote
    from cumulus_p2p.testing.executor import executor_process
    from cumulus_p2p.testing.tap import tap

    megabytes, rounds = (16, 5) if quick else (64, 10)
    steps, rows, width, depth = (4, 256, 1024, 256) if quick else (10, 1024, 2048, 512)
    result = {"megabytes": megabytes, "rounds": rounds, "steps": steps, "quick": quick}
    batches = data(steps, rows, depth)
    torch.manual_seed(0)
    local, _, _ = pipeline(*stages(width, depth, None), batches, None, lambda: 0)
    with executor_process() as (a, _), executor_process() as (b, _):
        with tap(a) as first, tap(b) as second, remote.attach([first.address, second.address]):
            result["device_move_gb_s"] = move_gb_s(megabytes, rounds, through_consumer=False)
            result["move_through_consumer_gb_s"] = move_gb_s(
                megabytes, rounds, through_consumer=True
            )
            torch.manual_seed(0)
            meter = lambda: first.bytes + second.bytes  # noqa: E731
            losses, seconds, crossed = pipeline(
                *stages(width, depth, None), batches, ("cumulus:0", "cumulus:1"), meter
            )
    moved = 2 * rows * width * 4 * (steps - 1)  # activations forward, gradients back
    result["pipeline_step_s"] = statistics.median(seconds[1:])
    result["pipeline_consumer_bytes_share"] = crossed / moved
    result["pipeline_loss_max_diff"] = max(abs(a - b) for a, b in zip(losses, local, strict=True))
    result["move_speedup"] = result["device_move_gb_s"] / result["move_through_consumer_gb_s"]
    return result


def shaped(quick: bool, work: Path) -> dict:
    """Real sizes on shaped links: hosts at 1 Gbit/s, this process at 100 Mbit/s."""
    from cumulus_p2p.testing.executor import executor_in
    from cumulus_p2p.testing.netns import shaped_mesh

    with shaped_mesh(hosts=2, consumer_mbit=100, host_mbit=1000) as mesh:
        with contextlib.ExitStack() as stack:
            addresses = [
                stack.enter_context(executor_in(host, work / host.name))[0] for host in mesh.hosts
            ]
            child = [sys.executable, __file__, "--shaped-child", ",".join(addresses)]
            if quick:
                child.append("--quick")
            done = subprocess.run(
                mesh.consumer.command(*child), capture_output=True, text=True, timeout=1800
            )
        if done.returncode != 0:
            raise RuntimeError(f"the consumer's side failed: {done.stderr[-3000:]}")
        result = json.loads(done.stdout)
        rate = mesh.consumer_mbit * 1e6
        move_bits = result["shaped_move_mib"] * 2**20 * 8
        result["shaped_move_via_consumer_floor_s"] = 2 * move_bits / rate
        # Each step's activations forward and gradients back, up and down that link.
        step_bits = 2 * 2 * result["shaped_moved_per_step_bytes"] * 8
        result["shaped_pipeline_via_consumer_added_floor_s"] = step_bits / rate
        result |= {"consumer_mbit": mesh.consumer_mbit, "host_mbit": mesh.host_mbit}
    return result


def shaped_child(addresses: str, quick: bool) -> dict:
    """The consumer's side of ``shaped``, run in its namespace."""
    from cumulus_p2p import remote
    from cumulus_p2p.testing.netns import interface_bytes

    move_mib = 512
    # Two stages of width x depth float32 weights: 512 MiB each, a 1 GiB model.
    width, depth, rows, steps = 16384, 8192, 64, (3 if quick else 5)
    result = {"shaped_move_mib": move_mib, "shaped_steps": steps}
    with remote.attach(addresses.split(",")):
        gb_s = result["shaped_move_gb_s"] = move_gb_s(move_mib, 1, through_consumer=False)
        result["shaped_move_s"] = move_mib * 2**20 / (gb_s * 1e9)
        torch.manual_seed(0)
        first, second = stages(width, depth, "cumulus:0")
        second.to("cumulus:1")
        weights = [p for module in (first, second) for p in module.parameters()]
        result["shaped_model_gib"] = sum(p.nbytes for p in weights) / 2**30
        result["shaped_largest_tensor_mib"] = max(p.nbytes for p in weights) / 2**20
        meter = lambda: sum(interface_bytes())  # noqa: E731
        losses, seconds, crossed = pipeline(
            first, second, data(steps, rows, depth), ("cumulus:0", "cumulus:1"), meter
        )
    moved = 2 * rows * width * 4 * (steps - 1)
    result["shaped_moved_per_step_bytes"] = rows * width * 4
    result["shaped_pipeline_step_s"] = statistics.median(seconds[1:])
    result["shaped_consumer_bytes_share"] = crossed / moved
    result["shaped_losses"] = losses
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller and fewer (< 1 minute)")
    parser.add_argument("--shaped", action="store_true", help="on shaped links (root)")
    parser.add_argument("--shaped-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.shaped_child:
        print(json.dumps(shaped_child(args.shaped_child, args.quick)))
        return
    if args.shaped:
        work = Path(os.environ.get("TMPDIR", "/tmp")) / f"devices-bench-{os.getpid()}"
        work.mkdir(parents=True, exist_ok=True)
        result, name = shaped(args.quick, work), "devices_shaped.json"
    else:
        result, name = loopback(args.quick), "devices.json"
    print(json.dumps(result, indent=2))
    if not args.quick:
        (ROOT / "benchmarks" / "results" / name).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
