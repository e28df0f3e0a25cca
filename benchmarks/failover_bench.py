"""Failover benchmark: what surviving a lost host costs, with executors as separate
processes on loopback and an MLP sized like a small real workload (3.2 M parameters, Adam).

Prints one JSON object and writes ``benchmarks/results/failover.json``
(``failover_quick.json`` with ``--quick``)::

    python benchmarks/failover_bench.py [--quick] [--device cpu|cuda]

Keys:

- ``failover_s``: from SIGKILL of the host, mid-run, to the first op completed on the
  replacement (reconnect, checkpoint upload, replay of the steps since it, the op).
- ``checkpoint_overhead``: step time with failover on (replay log plus a checkpoint every
  ``checkpoint_interval_s``) over step time without, minus 1. Target: at most 0.05. On a
  busy machine this is within a few percent of noise; ``checkpoint_time_share`` (time in
  checkpoints over time between them) is the same cost computed from the pauses alone.
- ``failover_replayed_steps``: steps re-run on the replacement. The host is killed half an
  interval after a checkpoint, so ``failover_s`` is mostly their replay: a shorter interval
  trades checkpoint overhead for a shorter failover.
- ``cache_resume_s``: from a network cut (host alive) to the first op completed, resuming
  from the host's cache; ``cold_restore_s``: the same, restoring onto a fresh host from a
  checkpoint taken just before the cut. Same state, same (empty) replay log.
"""

from __future__ import annotations

import json
import socket
import statistics
import time
from contextlib import ExitStack
from pathlib import Path

import torch

import cumulus_p2p.remote as remote
from cumulus_p2p.channel.transport import SocketFrameChannel
from cumulus_p2p.remote.client import CURRENT, RemoteSession
from cumulus_p2p.testing.benchargs import executor_bench_args
from cumulus_p2p.testing.executor import executor_process
from cumulus_p2p.testing.models import MLP


def dial(address: str):
    host, port = address.split(":")
    return lambda: SocketFrameChannel.connect(host, int(port))


def cuttable(address: str) -> tuple[SocketFrameChannel, socket.socket]:
    host, port = address.split(":")
    sock = socket.create_connection((host, int(port)))
    return SocketFrameChannel(sock), sock


class Trainer:
    """An MLP and Adam on the attached session; ``step()`` ends with a sync, as real loops do."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = MLP(width=1024, depth=4).to("cumulus")
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(0)
        self.batches = [
            (torch.randn(256, 32, generator=gen), torch.randint(0, 10, (256,), generator=gen))
            for _ in range(4)
        ]
        self.i = 0

    def step(self) -> float:
        x, y = self.batches[self.i % len(self.batches)]
        self.i += 1
        self.opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(self.model(x.to("cumulus")), y.to("cumulus"))
        loss.backward()
        self.opt.step()
        return loss.item()

    def probe(self) -> float:
        """One small op and its answer: "the first op completed"."""
        return self.model.net[0].bias.sum().item()


def warm(address: str) -> None:
    """A standby host has run torch before: do not bill its first-kernel costs to failover."""
    with remote.attach(address):
        trainer = Trainer()
        for _ in range(2):
            trainer.step()


def checkpoint_overhead(address: str, *, interval: float, steps: int) -> dict:
    """Step time of a session with failover on over one without, minus 1.

    The two sessions alternate step by step on one executor, so the machine's load falls on
    both alike. The guarded session's checkpoint clock runs on wall time, which it shares
    with the plain one, so it gets twice ``interval``: a checkpoint per ``interval`` of its
    own steps. ``checkpoint_every_s`` reports the spacing it really had.
    """
    plain = RemoteSession(dial(address)())
    guarded = RemoteSession(
        dial(address)(), reconnect=dial(address), checkpoint_interval=2 * interval
    )
    trainers, spent = {}, {plain: 0.0, guarded: 0.0}
    try:
        for session in (plain, guarded):
            CURRENT.session = session
            trainers[session] = Trainer()
            for _ in range(3):
                trainers[session].step()
        for i in range(steps):
            for session in (plain, guarded) if i % 2 else (guarded, plain):
                CURRENT.session = session
                t0 = time.perf_counter()
                trainers[session].step()
                spent[session] += time.perf_counter() - t0
        stats = guarded.failover_statistics()
    finally:
        CURRENT.session = None
        trainers.clear()
        plain.close()
        guarded.close()
    every = spent[guarded] / max(stats.checkpoints, 1)
    return {
        "checkpoint_overhead": round(spent[guarded] / spent[plain] - 1, 4),
        "step_s": round(spent[plain] / steps, 5),
        "step_s_with_failover": round(spent[guarded] / steps, 5),
        "checkpoint_every_s": round(every, 2),
        "checkpoint_s": round(stats.last_checkpoint_s or 0.0, 4),
        "checkpoint_time_share": round((stats.last_checkpoint_s or 0.0) / every, 4),
        "checkpoint_mb": round(stats.checkpoint_bytes / 1e6, 1),
    }


def failover_after_kill(device: str, standby: str, *, interval: float) -> dict:
    """Kill the host half an interval after a periodic checkpoint: an average replay."""
    with executor_process(device=device) as (address, proc):
        with remote.attach(
            channel=dial(address)(), reconnect=dial(standby), checkpoint_interval=interval
        ) as session:
            trainer = Trainer()
            seen, since, replayed = 0, time.perf_counter(), 0
            while seen == 0 or time.perf_counter() - since < interval / 2:
                trainer.step()
                replayed += 1
                if session.failover_statistics().checkpoints != seen:
                    seen, since, replayed = (
                        session.failover_statistics().checkpoints,
                        time.perf_counter(),
                        0,
                    )
            proc.kill()
            t0 = time.perf_counter()
            trainer.probe()
            elapsed = time.perf_counter() - t0
            proc.wait()
            assert session.failovers == 1
            return {
                "failover_s": round(elapsed, 4),
                "failover_replayed_steps": replayed,
            }


def resume_after_cut(address: str, target: str) -> tuple[float, dict]:
    channel, sock = cuttable(address)
    with remote.attach(channel=channel, reconnect=dial(target)) as session:
        trainer = Trainer()
        trainer.step()
        session.checkpoint()
        sock.shutdown(socket.SHUT_RDWR)
        t0 = time.perf_counter()
        trainer.probe()
        elapsed = time.perf_counter() - t0
        return elapsed, vars(session.failover_statistics())


def cache_versus_cold(address: str, fresh: str, repeats: int) -> dict:
    cache, cold = [], []
    for _ in range(repeats):
        seconds, stats = resume_after_cut(address, address)
        assert stats["cache_resumes"] == 1, stats
        cache.append(seconds)
        seconds, stats = resume_after_cut(address, fresh)
        assert stats["cold_restores"] == 1, stats
        cold.append(seconds)
    return {
        "cache_resume_s": round(statistics.median(cache), 4),
        "cold_restore_s": round(statistics.median(cold), 4),
    }


def main() -> None:
    args = executor_bench_args(__doc__)
    q = args.quick
    interval = 1.0 if q else 5.0
    with ExitStack() as stack:
        a, _ = stack.enter_context(executor_process(device=args.device))
        b, _ = stack.enter_context(executor_process(device=args.device))
        warm(a)
        warm(b)
        result = {"executor_device": args.device, "checkpoint_interval_s": interval}
        result |= failover_after_kill(args.device, b, interval=interval)
        result |= checkpoint_overhead(a, interval=interval, steps=60 if q else 300)
        result |= cache_versus_cold(a, b, 2 if q else 7)
    print(json.dumps(result, indent=2))
    name = "failover_quick.json" if q else "failover.json"
    (Path(__file__).parent / "results" / name).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
