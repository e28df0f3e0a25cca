"""A session's memory off the device and back (issue 32): GB/s and resume latency.

One executor session (``host.session.ExecutorSession``, in this process) holds a storage
of 1 GiB (``--quick``: 128 MiB). It is evicted to the host's memory and brought back by
its next batch, then to the disk tier (the host's blob store, in a temporary directory)
and back, each timed, beside a plain ``copy_`` of the same bytes in the same run. The
next batch's result is checked against the same batch on a session never evicted.

On a CPU executor the device is the host's memory, so the RAM tier moves nothing (its
rates are left out) and its resume is the cost of the next batch alone; ``--device
cuda`` moves the storages to pinned host memory and back (the plain copy is then a
pinned device-to-host copy).

Prints JSON (``benchmarks/results/eviction[_cuda][_quick].json``)::

    python benchmarks/eviction_bench.py [--quick] [--device cpu|cuda]

Then the overcommit run: a ``cumulus-executor --shared-process --device-memory``
process with room for two training tenants' tensors, and four tenants (client processes
on the Python device, each an MLP of 32 MiB of weights, ``--quick`` 8 MiB, trained with
SGD) at once, against two tenants alone on the same executor settings.

Keys: ``evict_gb_s`` and ``restore_gb_s`` (the disk tier: written to the blob store as
named pieces, and read back checked), ``ram_evict_gb_s`` and ``ram_restore_gb_s``,
``copy_gb_s``, ``resume_from_ram_s`` and ``resume_from_disk_s`` (the first batch after
an eviction, a small op on the storage, bringing it back included), ``exact`` (1 when
every result matched the session never evicted); ``overcommit_steps_ratio`` (the four
tenants' steps per second together over the two's, each tenant's time from its own
clock, after its process started), ``overcommit_evictions`` (sessions sent to disk to
make room), ``overcommit_evicted_mib`` (what those evictions moved: a session gives up
only the storages the room needs) and ``overcommit_losses_exact`` (1
when every tenant's losses equal the same training run locally, bit for bit). The same
run with a worker process per session (the supervisor asks workers to evict as their
reports come, each second) gives the ``overcommit_workers_*`` keys.

The native device's session (``native.executor.ReplaySession``, the C++ replay loop) is
evicted and brought back the same way, on the same bytes: ``native_evict_gb_s`` and
``native_restore_gb_s`` (the disk tier), ``native_ram_*`` on a GPU,
``native_resume_from_disk_s`` and ``native_exact``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cumulus_p2p.blobs.store import BlobStore  # noqa: E402 - after the path fix
from cumulus_p2p.host.eviction import Tier  # noqa: E402
from cumulus_p2p.host.session import DeviceContext, ExecutorSession, parse_batch  # noqa: E402
from cumulus_p2p.testing.executor import executor_process, log_tail  # noqa: E402
from cumulus_p2p.wire.protocol import (  # noqa: E402
    decode_frame,
    encode_frame,
    tensor_ext,
    tensor_layout,
)

GB = 1e9


def batch(session: ExecutorSession, seq: int, ops: list, query: list) -> bytes:
    frame = b"".join(encode_frame(["batch", seq, ops, [], query, []]))
    reply = session.run_batch(parse_batch(*decode_frame(bytearray(frame))))
    if reply.error is not None:
        raise RuntimeError(reply.error)
    return b"".join(bytes(b) for b in reply.blobs)


def probe(session: ExecutorSession, seq: int, n: int) -> bytes:
    """A small op on the big storage, read back: what a resumed tenant's next step does."""
    ref = tensor_ext(1, tensor_layout(torch.float32, (n - 1024) * 4 // 4, (1024,), (1,)))
    out = [[1000 + seq, [1024], [1], 0]]
    done = tensor_ext(1000 + seq, tensor_layout(torch.float32, 0, (1024,), (1,)))
    return batch(session, seq, [["aten.mul.Tensor", [ref, 3.0], {}, out]], ["fetch", done])


def native_arm(device: torch.device, data: torch.Tensor, store: BlobStore) -> dict:
    """A native session holding ``data`` (flat float32), evicted to each tier and brought
    back by a small op on its storage, read back and checked against one never evicted."""
    from cumulus_p2p.native import records
    from cumulus_p2p.native.executor import ReplaySession, new_replayer
    from cumulus_p2p.wire import native as wire

    nbytes = data.numel() * 4
    whole = records.TensorRef(1, 0, "float32", (data.numel(),), (1,))
    head = records.TensorRef(1, 0, "float32", (1024,), (1,))
    out = records.TensorRef(2, 0, "float32", (1024,), (1,))
    sessions = [ReplaySession(new_replayer(str(device), 2 * nbytes), store) for _ in range(2)]
    tables: dict[int, list[str]] = {id(session): [] for session in sessions}

    def run(session: ReplaySession, *recs) -> list[bytes]:
        table = tables[id(session)]  # each session's op name table
        known = len(table)
        batch = records.encode(recs, table)
        _, reply = session.run(b"".join(wire.request(wire.BATCH, table[known:], batch, True)))
        answer = wire.parse_reply(b"".join(reply))
        if isinstance(answer, tuple):
            raise RuntimeError(answer)
        return [bytes(part) for part in answer]

    def probe(session: ReplaySession) -> bytes:
        (value,) = run(
            session, records.Op("aten::mul.Scalar", (head, 3.0), (out,)), records.Readback(out),
            records.Free(2),
        )  # fmt: skip
        return value

    host = records.HostTensor("float32", (data.numel(),), data.numpy().tobytes())
    for session in sessions:
        run(session, records.Alloc(1, nbytes), records.Upload(whole, host))
    stayed, moved = sessions
    expected, result, exact = probe(stayed), {}, True
    for tier, name in ((Tier.RAM, "ram"), (Tier.DISK, "disk")):
        if tier is Tier.RAM and device.type == "cpu":
            continue  # nothing moves: a rate would be meaningless
        started = time.perf_counter()
        moved.evict(tier)
        evict_s = time.perf_counter() - started
        started = time.perf_counter()
        exact = exact and probe(moved) == expected
        resume_s = time.perf_counter() - started
        prefix = "native_ram_" if tier is Tier.RAM else "native_"
        result[f"{prefix}evict_gb_s"] = nbytes / evict_s / GB
        result[f"{prefix}restore_gb_s"] = nbytes / resume_s / GB
        result[f"native_resume_from_{name}_s"] = resume_s
    for session in sessions:
        session.close()
    return result | {"native_exact": int(exact)}


def train(device: str, mib: int, steps: int, seed: int) -> list[float]:
    """An MLP with ``mib`` MiB of weights, ``steps`` of SGD on ``device``; its losses."""
    torch.manual_seed(seed)
    width = 1024
    model = torch.nn.Sequential(
        torch.nn.Linear(width, mib * 2**20 // 4 // width), torch.nn.ReLU(), torch.nn.LazyLinear(1)
    )
    x, y = torch.randn(16, width), torch.randn(16, 1)
    model(x)  # the lazy layer takes its shape
    model, x, y = model.to(device), x.to(device), y.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def tenant(address: str, mib: int, steps: int, seed: int) -> None:
    """One tenant's process: train on the executor at ``address``; print losses, seconds."""
    import cumulus_p2p.remote as remote

    with remote.attach(address) as session:
        started = time.perf_counter()
        losses = train("cumulus", mib, steps, seed)
        seconds = time.perf_counter() - started
        stats = session.stats()
        moved = {"evictions": stats["evictions"], "evicted_bytes": stats["evicted_bytes"]}
        print(json.dumps({"losses": losses, "seconds": seconds} | moved))


def tenants_at_once(executor: subprocess.Popen, address: str, count: int, mib: int, steps: int):
    """Each tenant's run: its losses, seconds and evictions. A tenant that fails stops the
    bench with its error and the end of the executor's log."""
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--tenant", address, str(mib), str(steps), str(seed)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for seed in range(count)
    ]
    runs = []
    for proc in procs:
        out, err = proc.communicate(timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(
                f"a tenant failed: {err[-2000:]}\nthe executor: {log_tail(executor)}"
            )
        runs.append(json.loads(out.strip().splitlines()[-1]))
    return runs


def overcommit(quick: bool, isolation: str = "shared-process") -> dict:
    """Four tenants on room for two, against two alone: steps per second, losses.

    ``isolation``: ``shared-process`` (the executor evicts before a batch) or
    ``worker-per-session`` (the supervisor asks workers to evict, as reports come)."""

    mib, steps = (8, 6) if quick else (32, 8)
    # A tenant holds its weights and, during a step, their gradients: twice them.
    room = f"{2 * 2 * mib + 8}MiB"
    rates, evictions, evicted, exact = {}, {}, {}, True
    torch.set_num_threads(1)
    for count in (2, 4):
        with tempfile.TemporaryDirectory(prefix="cumulus-overcommit-") as blobs:
            flags = [f"--{isolation}", "--device-memory", room, "--blob-dir", blobs]
            flags += ["--pool", "4"] if isolation == "worker-per-session" else []
            with executor_process(extra=flags, env={"OMP_NUM_THREADS": "1"}) as (address, proc):
                runs = tenants_at_once(proc, address, count, mib, steps)
        # From the tenants' own clocks: their processes' start-up is not the executor's.
        rates[count] = count * steps / max(run["seconds"] for run in runs)
        evictions[count] = sum(run["evictions"] for run in runs)
        evicted[count] = sum(run["evicted_bytes"] for run in runs)
        for seed, run in enumerate(runs):
            exact = exact and run["losses"] == train("cpu", mib, steps, seed)
    prefix = "overcommit_" if isolation == "shared-process" else "overcommit_workers_"
    return {
        "overcommit_tenant_mib": mib,
        f"{prefix}steps_per_s_two": rates[2],
        f"{prefix}steps_per_s_four": rates[4],
        f"{prefix}steps_ratio": rates[4] / rates[2],
        f"{prefix}evictions": evictions[4],
        f"{prefix}evicted_mib": round(evicted[4] / 2**20, 1),
        f"{prefix}losses_exact": int(exact),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="128 MiB instead of 1 GiB")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--tenant", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tenant:
        address, mib, steps, seed = args.tenant
        tenant(address, int(mib), int(steps), int(seed))
        return
    nbytes = (128 if args.quick else 1024) << 20
    n = nbytes // 4
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory(prefix="cumulus-eviction-") as root:
        store = BlobStore(root, cap=4 * nbytes)
        ctx = DeviceContext(device, blobs=store)
        sessions = [ExecutorSession(ctx, quota_bytes=2 * nbytes) for _ in range(2)]
        for session in sessions:
            batch(session, 1, [["aten.randn.default", [[n]], {}, [[1, [n], [1], 0]]]], ["sync"])
        stayed, moved = sessions
        result = {"device": args.device, "bytes": nbytes}
        src = torch.randn(n, device=device)
        dst = torch.empty(n, pin_memory=device.type == "cuda")
        dst.copy_(src)  # the first copy faults the pages in; the second is the figure
        started = time.perf_counter()
        dst.copy_(src)
        result["copy_gb_s"] = nbytes / (time.perf_counter() - started) / GB
        expected, exact = probe(stayed, 2, n), True
        for tier, name in ((Tier.RAM, "ram"), (Tier.DISK, "disk")):
            started = time.perf_counter()
            moved.evict(tier)
            if device.type == "cuda":
                torch.cuda.synchronize()
            evict_s = time.perf_counter() - started
            started = time.perf_counter()
            exact = exact and probe(moved, 2 if tier is Tier.RAM else 3, n) == expected
            resume_s = time.perf_counter() - started
            result[f"resume_from_{name}_s"] = resume_s
            if tier is Tier.RAM and device.type == "cpu":
                continue  # nothing moved: a rate would be meaningless
            prefix = "ram_" if tier is Tier.RAM else ""
            result[f"{prefix}evict_gb_s"] = nbytes / evict_s / GB
            result[f"{prefix}restore_gb_s"] = nbytes / resume_s / GB
        result["exact"] = int(exact)
        result |= native_arm(device, src.cpu(), store)
    if args.device == "cpu":
        result |= overcommit(args.quick)
        result |= overcommit(args.quick, "worker-per-session")
    result = {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}
    print(json.dumps(result, indent=2))
    name = (
        "eviction" + ("_cuda" if args.device == "cuda" else "") + ("_quick" if args.quick else "")
    )
    (ROOT / "benchmarks" / "results" / f"{name}.json").write_text(
        json.dumps(result, indent=2) + "\n"
    )


if __name__ == "__main__":
    main()
