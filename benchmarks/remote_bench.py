"""Remote device benchmark: client cost per op, streaming rate, sync round trip, transfer
rates and training step time, with the executor as a separate process on loopback.

Prints one JSON object (keys below) and writes ``benchmarks/results/remote.json``::

    python benchmarks/remote_bench.py [--quick] [--device cpu|cuda]

``raw_tcp_rtt_us`` is a plain socket client that sleeps in ``recv``;
``raw_tcp_spin_rtt_us`` polls before each read as the cumulus client does, so the sync
round trip can be read against both.
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import cumulus_p2p.remote as remote
from cumulus_p2p.channel.transport import DEFAULT_SPIN_S, ReadySpinner
from cumulus_p2p.testing.benchargs import executor_bench_args
from cumulus_p2p.testing.executor import executor_process
from cumulus_p2p.testing.models import TASKS, WORKLOADS, Task

ECHO_SERVER = """
import trio, sys
async def echo(stream):
    try:
        while data := await stream.receive_some(65536):
            await stream.send_all(data)
    except trio.BrokenResourceError:
        pass
async def main():
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    print(listeners[0].socket.getsockname()[1], flush=True)
    await trio.serve_listeners(echo, listeners)
trio.run(main)
"""


def raw_tcp_rtt_us(rounds: int, *, spin: bool = False) -> float:
    """Median round trip of a 64-byte ping to a trio echo server in another process.

    With ``spin``, the client polls before each read as the cumulus client does
    (``ReadySpinner``); without, it sleeps in ``recv`` like a plain socket client.
    """
    proc = subprocess.Popen([sys.executable, "-c", ECHO_SERVER], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        spinner = ReadySpinner(sock, DEFAULT_SPIN_S if spin else 0.0)
        samples = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            sock.sendall(b"x" * 64)
            got = 0
            while got < 64:
                spinner.spin()
                got += len(sock.recv(64 - got))
            samples.append(time.perf_counter() - t0)
        sock.close()
        return statistics.median(samples) * 1e6
    finally:
        proc.kill()
        proc.wait()


def dispatch_cost(n: int) -> tuple[float, float]:
    """(client µs per op with a warm plan cache, ops per second including the final sync)."""
    a = torch.randn(64, 64, device="cumulus")
    b = torch.randn(64, 64, device="cumulus")
    for _ in range(100):  # warm the plan cache
        c = a * b
    torch.cumulus.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        c = a * b  # noqa: F841 - the op, and the free of the previous c, is the workload
    t1 = time.perf_counter()
    torch.cumulus.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / n * 1e6, n / (t2 - t0)


def sync_rtt_us(rounds: int) -> float:
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        torch.cumulus.synchronize()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def transfer_mb_s(mbytes: int, repeats: int) -> tuple[float, float]:
    host = torch.randn(mbytes * 1024 * 1024 // 4)
    up, down = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dev = host.to("cumulus")
        torch.cumulus.synchronize()
        up.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        back = dev.cpu()
        down.append(time.perf_counter() - t0)
        del dev, back
    return mbytes / min(up), mbytes / min(down)


#: Models sized like small real workloads, where per-op overhead meets real compute.
BENCH_TASKS = {"mlp": WORKLOADS["mlp_bench"], "transformer": WORKLOADS["transformer_bench"]}


def trainer(spec: Task, device: str):
    """One training step of ``spec`` on ``device`` per call, ending at a sync point."""
    torch.manual_seed(0)
    model = spec.make_model().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    batches = [tuple(t.to(device) for t in spec.make_batch(gen)) for _ in range(4)]
    count = iter(range(1 << 62))

    def one() -> float:
        x, y = batches[next(count) % len(batches)]
        opt.zero_grad()
        loss = spec.loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()  # a sync point every step, as real loops log the loss

    return one


def step_ratio(spec: Task, steps: int) -> float:
    """Median remote step time over median local step time.

    Local and remote steps alternate, so load from other processes on this small machine
    falls on both sides alike instead of on whichever ran second.
    """
    local, far = trainer(spec, "cpu"), trainer(spec, "cumulus")
    for _ in range(3):
        local(), far()
    samples: dict[str, list[float]] = {"local": [], "far": []}
    for _ in range(steps):
        for name, step in (("local", local), ("far", far)):
            t0 = time.perf_counter()
            step()
            samples[name].append(time.perf_counter() - t0)
    return statistics.median(samples["far"]) / statistics.median(samples["local"])


def main() -> None:
    args = executor_bench_args(__doc__)
    q = args.quick
    with executor_process(device=args.device) as (address, _):
        with remote.attach(address) as session:
            us_per_op, ops_per_s = dispatch_cost(5_000 if q else 50_000)
            rtt = sync_rtt_us(300 if q else 3000)
            up, down = transfer_mb_s(32 if q else 128, 2 if q else 5)
            ratios = {}
            for task in ("mlp", "transformer"):
                for label, spec in ((task, BENCH_TASKS[task]), (task + "_tiny", TASKS[task])):
                    ratios[label] = step_ratio(spec, 5 if q else 20)
            device = session.info["device"]
    result = {
        "executor_device": device,
        "dispatch_us_per_op": round(us_per_op, 2),
        "ops_per_s": round(ops_per_s),
        "sync_rtt_us": round(rtt, 1),
        "raw_tcp_rtt_us": round(raw_tcp_rtt_us(300 if q else 3000), 1),
        "raw_tcp_spin_rtt_us": round(raw_tcp_rtt_us(300 if q else 3000, spin=True), 1),
        "upload_mb_s": round(up, 1),
        "download_mb_s": round(down, 1),
        "step_ratio_mlp": round(ratios["mlp"], 3),
        "step_ratio_transformer": round(ratios["transformer"], 3),
        "step_ratio_mlp_tiny": round(ratios["mlp_tiny"], 3),
        "step_ratio_transformer_tiny": round(ratios["transformer_tiny"], 3),
    }
    print(json.dumps(result, indent=2))
    out = Path(__file__).parent / "results" / "remote.json"
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
