"""Priority between tenants of one executor: what a dear on-demand lease gains.

One CPU executor serves several tenants, each a client process of its own:

- *background*: ``BACKGROUND_TENANTS`` interruptible leases at a low price that keep the
  device busy (matmul steps back to back);
- *foreground*: an on-demand lease at a high price, timing short steps (a few small
  matmuls, then ``.item()``).

The foreground step time is measured alone, then beside the background tenant with the
executor ranking sessions by lease (``scheduler.lease_rank``), then beside them with all
sessions at the same rank (first come, first served, as before priorities existed). A
session has at most one batch waiting for the device, so with one background tenant the
two orders are the same; the difference grows with the number of tenants waiting.

Prints JSON and writes ``benchmarks/results/priority.json``::

    python benchmarks/priority_bench.py [--quick] [--isolation shared|worker]

``--isolation worker`` serves every tenant in a worker process of its own, with the
supervisor granting device turns across them (issue 12); results then go to
``priority_worker.json``.

Keys: ``foreground_alone_ms``, ``foreground_ranked_ms``, ``foreground_fifo_ms`` (median
step times), ``background_steps_per_s_ranked``, ``background_steps_per_s_fifo`` (all
background tenants together).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cumulus_p2p.host.scheduler import lease_rank  # noqa: E402 - after the path fix
from cumulus_p2p.testing.benchargs import last_json_line, serve_ranks, spawn_role  # noqa: E402

FOREGROUND = lease_rank(True, 900)  # on-demand at a high price
BACKGROUND = lease_rank(False, 100)  # interruptible at a low price
BACKGROUND_TENANTS = 3


def serve(ranked: bool, isolation: str = "shared", pool: int = 4) -> None:
    """The executor: port 1 serves the foreground rank, port 2 the background rank."""
    import trio

    from cumulus_p2p.host.executor import ExecutorConfig
    from cumulus_p2p.host.executor_main import build_executor
    from cumulus_p2p.host.supervisor import WorkerSupervisor

    config = ExecutorConfig(device="cpu")
    executor = build_executor(config, workers=isolation == "worker", pool=pool)
    ranks = (FOREGROUND, BACKGROUND) if ranked else (FOREGROUND, FOREGROUND)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            if isinstance(executor, WorkerSupervisor):
                await nursery.start(executor.run)
                while executor.ready_workers < pool:  # tenants find their workers warm
                    await trio.sleep(0.1)
            ports = await serve_ranks(nursery, executor, ranks)
            print(*ports, flush=True)

    trio.run(main)


def client(role: str, address: str, seconds: float) -> None:
    """Run one tenant's loop for ``seconds``; print its step times (ms) as JSON."""
    import torch

    import cumulus_p2p.remote as remote

    with remote.attach(address):
        torch.manual_seed(0)
        size = 384 if role == "background" else 128
        a = torch.randn(size, size, device="cumulus")
        times = []
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            x = a
            for _ in range(4):
                x = torch.tanh(x @ a)
            x.sum().item()
            times.append((time.perf_counter() - t0) * 1e3)
            if role == "foreground":
                time.sleep(0.01)  # an interactive tenant: short steps with pauses
    print(json.dumps(times), flush=True)


def spawn(*args: str) -> subprocess.Popen:
    return spawn_role(__file__, *args, cwd=ROOT)


def times(proc: subprocess.Popen) -> list[float]:
    return last_json_line(proc, timeout=300)


def measure(
    ranked: bool,
    seconds: float,
    *,
    with_background: bool,
    isolation: str = "shared",
    tenants: int = BACKGROUND_TENANTS,
) -> tuple[list, list]:
    """(foreground step times, background step times) for one arrangement."""
    server = spawn("--serve", "ranked" if ranked else "fifo", "--isolation", isolation)
    try:
        fore_port, back_port = server.stdout.readline().split()
        address = f"127.0.0.1:{back_port}"
        count = tenants if with_background else 0
        background = [spawn("--client", "background", address, str(seconds)) for _ in range(count)]
        if background:
            time.sleep(3.0)  # let them start and fill the device
        foreground = spawn("--client", "foreground", f"127.0.0.1:{fore_port}", str(seconds / 2))
        fore = times(foreground)[5:]
        back = [t for proc in background for t in times(proc)]
        return fore, back
    finally:
        server.kill()
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="shorter runs (< 60 s)")
    parser.add_argument("--serve", choices=("ranked", "fifo"), help=argparse.SUPPRESS)
    parser.add_argument("--client", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument(
        "--isolation",
        choices=["shared", "worker"],
        default="shared",
        help="tenants in the executor's process, or each in a worker process",
    )
    args = parser.parse_args()
    if args.serve:
        serve(args.serve == "ranked", args.isolation)
        return
    if args.client:
        role, address, seconds = args.client
        client(role, address, float(seconds))
        return
    seconds = 8.0 if args.quick else 30.0
    mode = args.isolation
    alone, _ = measure(True, seconds, with_background=False, isolation=mode)
    ranked, back_ranked = measure(True, seconds, with_background=True, isolation=mode)
    fifo, back_fifo = measure(False, seconds, with_background=True, isolation=mode)
    result = {
        "isolation": mode,
        "foreground_alone_ms": round(statistics.median(alone), 2),
        "foreground_ranked_ms": round(statistics.median(ranked), 2),
        "foreground_fifo_ms": round(statistics.median(fifo), 2),
        "foreground_ranked_p90_ms": round(statistics.quantiles(ranked, n=10)[-1], 2),
        "foreground_fifo_p90_ms": round(statistics.quantiles(fifo, n=10)[-1], 2),
        "background_steps_per_s_ranked": round(len(back_ranked) / seconds, 1),
        "background_steps_per_s_fifo": round(len(back_fifo) / seconds, 1),
    }
    print(json.dumps(result, indent=2))
    name = "priority.json" if mode == "shared" else f"priority_{mode}.json"
    out = ROOT / "benchmarks" / "results" / name
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
