"""Real sizes on shaped links (issue 28): what a model of a gigabyte costs over a home uplink.

A consumer and three hosts (A, B, C) are network namespaces on one switch
(``netns.shaped_mesh``): the consumer's link is shaped to 100 Mbit/s each way, the hosts' to
1 Gbit/s, and a one-stream TCP transfer checks both first. Real ``cumulus-executor``
processes, each with a blob store, serve in the host namespaces; the consumer's training
loop runs in the consumer's namespace (this file, with ``--consumer``) and reads its link's
bytes from the kernel's interface counters, never from its own. The model is a large
embedding and two small layers: bytes without compute.

Prints one JSON object and writes ``benchmarks/results/realsize.json`` (``realsize_quick.json``
with ``--quick``: the same at 48 MiB, a checkpoint interval of 3 s, in about a minute)::

    sudo .venv/bin/python benchmarks/realsize_bench.py [--quick] [--checkpoint-to PLACE]
        [--device cpu|cuda]

``--device cuda`` runs the executors on the machine's GPU (all three share it), and writes
``realsize_cuda[_quick].json``: the failover's replayed steps then cost what they cost on a
GPU, not seconds each on CPU executors.
``--checkpoint-to`` is where checkpoints go: ``standby`` (the default: host B keeps them,
copied from the session's host, host to host), ``consumer`` (the consumer's disk, as before
standbys existed; writes ``realsize_consumer[_quick].json``) or ``both``.

The sessions, in order (every one with failover on to host C, the consumer's default
checkpoint interval, and its own checkpoint directory shared with the previous session):

1. On host A, fresh: the first step, then one checkpoint cycle (from just after a checkpoint
   to just after the next).
2. On host A again, the same model: the first step; then, a few steps after a checkpoint
   that the standby holds, SIGKILL of host A. The session fails over to host C, which
   pulls the state from the standby (or the consumer uploads it, with ``consumer``).
3. On host C: the base frozen, small LoRA adapters trained with Adam; one checkpoint cycle.

Keys (targets from the issue; "link" is the consumer's, both directions, headers included):

- ``first_step_over_floor``: session 1's first step (upload included) over the parameter bytes'
  time at the consumer's nominal rate. Target: at most 1.15.
- ``second_session_consumer_bytes_share``: link bytes of session 2, from attaching to the end of
  its first step, over the parameter bytes. Target: at most 0.01. ``..._tx_share`` and
  ``..._rx_share`` split it: rx is checkpoint data pulled back in that step.
- ``checkpoint_time_share``: session 1's checkpoint time (the pause the op stream sees) over
  its cycle's time. Target: 0.05.
- ``checkpoint_consumer_bytes_share``: link bytes of that checkpoint (less an ordinary step's)
  over the checkpoint's bytes. Target: at most 0.05.
- ``adapter_checkpoint_bytes_ratio``: session 3's checkpoint bytes per interval (what it moved
  anywhere: read to the consumer, copied to the standby; only the pieces that changed) over
  the adapters' bytes and their Adam state's. Target: at most 2.
- ``failover_consumer_bytes_share``: link bytes of the step that failed over, over the session's
  state (its latest checkpoint's bytes). Target: at most 0.05.
- ``failover_resume_over_floor``: the failover's pause over the state's time at the hosts'
  nominal rate. Target: at most 1.2. ``failover_restore_over_floor``: the part of it that
  moved the state (with a standby); the rest is dialling and replaying the steps since the
  checkpoint (seconds each on a CPU executor, for this model).
- ``losses_identical``: 1 when every loss of session 2 (before and after the kill) equals the
  same step's loss in session 1, bit for bit; ``losses_compared`` says how many steps.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import cumulus_p2p.remote as remote
from cumulus_p2p.channel.transport import SocketFrameChannel
from cumulus_p2p.remote.checkpoint import DirectoryCheckpointStore
from cumulus_p2p.testing.executor import executor_in, stop
from cumulus_p2p.testing.linkrate import measure_mbit
from cumulus_p2p.testing.netns import interface_bytes, shaped_mesh

RESULTS = Path(__file__).parent / "results"
#: Steps run after a checkpoint before host A is killed: they are what failover replays.
STEPS_BEFORE_KILL = 3
#: Steps run after the kill; the first is the one that fails over.
STEPS_AFTER_KILL = 3


@dataclass(frozen=True)
class Size:
    """How big a run is. ``vocab`` x ``dim`` fp32 is the embedding, the one large tensor."""

    vocab: int
    dim: int
    checkpoint_interval_s: float


#: 1 GiB of embedding: over 256 MiB in one tensor, the case that once could not move at all.
FULL = Size(vocab=262_144, dim=1024, checkpoint_interval_s=30.0)
#: 48 MiB: each transfer over the consumer's link takes about 4 s, so the run fits 2 minutes.
#: The interval shrinks with it, or no checkpoint would come due within the run.
QUICK = Size(vocab=12_288, dim=1024, checkpoint_interval_s=3.0)


# --- the orchestrator (root namespace) -----------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="48 MiB instead of 1 GiB (~2 min)")
    parser.add_argument(
        "--checkpoint-to",
        choices=["standby", "consumer", "both"],
        default="standby",
        help="where checkpoints go (consumer: the placement before standbys existed)",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--consumer", help=argparse.SUPPRESS)  # the consumer's role: JSON
    args = parser.parse_args()
    if args.consumer:
        print(json.dumps(consume(**json.loads(args.consumer))), flush=True)
        return
    # SIGTERM unwinds like Ctrl-C, so the executors stop and the namespaces go.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    size = QUICK if args.quick else FULL
    result = run(size, quick=args.quick, checkpoint_to=args.checkpoint_to, device=args.device)
    text = json.dumps(result, indent=2)
    print(text)
    placement = "" if args.checkpoint_to == "standby" else f"_{args.checkpoint_to}"
    device = "" if args.device == "cpu" else f"_{args.device}"
    name = f"realsize{placement}{device}{'_quick' if args.quick else ''}.json"
    (RESULTS / name).write_text(text + "\n")


def run(size: Size, *, quick: bool, checkpoint_to: str, device: str) -> dict:
    with shaped_mesh(hosts=3, consumer_mbit=100, host_mbit=1000) as mesh:
        c, (a, b, fresh) = mesh.consumer, mesh.hosts
        progress("checking the shaping with one TCP stream per link")
        result = {
            "quick": quick,
            "device": device,
            "consumer_link_mbit_nominal": mesh.consumer_mbit,
            "host_link_mbit_nominal": mesh.host_mbit,
            "consumer_link_mbit_measured": round(measure_mbit(c, a, seconds=2.0), 1),
            "host_link_mbit_measured": round(measure_mbit(a, b, seconds=2.0), 1),
            "checkpoint_interval_s": size.checkpoint_interval_s,
            "checkpoint_to": checkpoint_to,
        }
        with tempfile.TemporaryDirectory() as work, ExitStack() as stack:
            address_a, proc_a = stack.enter_context(executor_in(a, Path(work) / "a", device))
            address_b, _ = stack.enter_context(executor_in(b, Path(work) / "b", device))
            address_c, _ = stack.enter_context(executor_in(fresh, Path(work) / "c", device))
            plan = {
                "size": asdict(size),
                "checkpoint_to": checkpoint_to,
                "host_a": address_a,
                "standby": address_b,
                "host_c": address_c,
                "kill_pid": proc_a.pid,
                "consumer_mbit": mesh.consumer_mbit,
                "host_mbit": mesh.host_mbit,
            }
            result |= run_consumer(c, plan)
    return result


def run_consumer(consumer, plan: dict) -> dict:
    """Run the consumer's sessions in its namespace; its progress goes to our stderr."""
    cmd = [sys.executable, __file__, "--consumer", json.dumps(plan)]
    proc = subprocess.Popen(consumer.command(*cmd), stdout=subprocess.PIPE, text=True)
    try:
        out, _ = proc.communicate()
    finally:
        stop(proc)
    if proc.returncode != 0:
        raise RuntimeError(f"the consumer failed (exit {proc.returncode})")
    return json.loads(out.strip().splitlines()[-1])


def progress(message: str) -> None:
    print(f"realsize: {message}", file=sys.stderr, flush=True)


# --- the consumer (its own namespace) ------------------------------------------------------


@dataclass(frozen=True)
class Hosts:
    """Where the consumer's sessions go: host A runs sessions 1 and 2, the standby keeps
    checkpoints (with ``--checkpoint-to standby`` or ``both``), host C takes the failover
    and session 3. ``checkpoints`` is the consumer's checkpoint directory."""

    a: str
    standby: str
    c: str
    checkpoint_to: str
    checkpoints: Path

    def attach(self, address: str, interval: float, name: str):
        """``remote.attach`` as a consumer node does it: failover on (to host C),
        checkpoints on a clock, the consumer's in a directory shared with the previous
        session (``node.attach.attach_leased``)."""
        store = DirectoryCheckpointStore(self.checkpoints, name=name, keep_others=1)

        def dial():
            host, port = self.c.split(":")
            return SocketFrameChannel.connect(host, int(port))

        on_standby = self.checkpoint_to != "consumer"
        return remote.attach(
            address,
            reconnect=dial,
            checkpoint_interval=interval,
            checkpoint_store=store,
            standby=self.standby if on_standby else None,
            checkpoint_to=self.checkpoint_to,
        )


def consume(
    *,
    size: dict,
    checkpoint_to: str,
    host_a: str,
    standby: str,
    host_c: str,
    kill_pid: int,
    consumer_mbit: float,
    host_mbit: float,
) -> dict:
    interface_bytes()  # fail now, not mid-run, if this is not the mesh's namespace
    checkpoints = Path(tempfile.mkdtemp(prefix="realsize-consumer-"))
    hosts = Hosts(host_a, standby, host_c, checkpoint_to, checkpoints)
    size = Size(**size)
    param_bytes = model_bytes(size)
    result = {"param_bytes": param_bytes, "largest_tensor_bytes": size.vocab * size.dim * 4}
    floor_s = param_bytes * 8 / (consumer_mbit * 1e6)
    first, losses = fresh_host(size, hosts)
    result |= {"first_step_floor_s": round(floor_s, 2), **first}
    result["first_step_over_floor"] = round(first["first_step_s"] / floor_s, 3)
    result["first_step_upload_over_floor"] = round(first["first_step_upload_s"] / floor_s, 3)
    result |= second_session(size, hosts, kill_pid, losses, param_bytes, host_mbit)
    result |= adapters(size, hosts)
    shutil.rmtree(checkpoints, ignore_errors=True)
    return result


class Trainer:
    """The model, its optimizer and a fixed cycle of batches; ``step()`` ends at a sync point.

    ``adapters``: the base is frozen and only LoRA adapters on the small layer train, with
    Adam. Otherwise everything trains with plain SGD, whose state is the parameters alone:
    the smallest checkpoint a full model can have (Adam's would be three times as large).
    """

    def __init__(self, size: Size, *, adapters: bool = False) -> None:
        torch.manual_seed(0)
        self.model = EmbeddingModel(size, adapters=adapters)
        self.adapters = adapters
        self.opt = None
        gen = torch.Generator().manual_seed(0)
        self.batches = [
            (
                torch.randint(0, size.vocab, (32, 16), generator=gen),
                torch.randint(0, 16, (32,), generator=gen),
            )
            for _ in range(8)
        ]
        self.i = 0

    def place(self) -> None:
        """Move the model to the attached session (the upload) and make its optimizer."""
        # Loaded the way pretrained weights are, into empty device tensors: copy_ streams a
        # tensor of any size, while module.to("cumulus") sends each tensor as one frame and
        # fails on any over the 256 MiB frame limit (FrameTooLargeError, as of this bench).
        weights = self.model.state_dict()
        self.model = self.model.to_empty(device="cumulus")
        self.model.load_state_dict(weights)
        trained = [p for p in self.model.parameters() if p.requires_grad]
        if self.adapters:
            self.opt = torch.optim.Adam(trained, lr=1e-3)
        else:
            self.opt = torch.optim.SGD(trained, lr=0.5)

    def step(self) -> float:
        x, y = self.batches[self.i % len(self.batches)]
        self.i += 1
        loss = F.cross_entropy(self.model(x.to("cumulus")), y.to("cumulus"))
        loss.backward()
        self.opt.step()
        # Gradients dropped before the sync point are freed before a checkpoint reads the
        # session, so it carries the parameters and optimizer state only, as a real one would.
        self.opt.zero_grad(set_to_none=True)
        return loss.item()

    def trained_state_bytes(self) -> int:
        """The trained parameters' bytes and their optimizer state's."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        state = [
            t for s in self.opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)
        ]
        return sum(t.numel() * t.element_size() for t in [*params, *state])


def model_bytes(size: Size) -> int:
    """The full model's parameter bytes, counted on the meta device (no memory)."""
    with torch.device("meta"):
        model = EmbeddingModel(size)
    return sum(p.numel() * p.element_size() for p in model.parameters())


class EmbeddingModel(nn.Module):
    """A large embedding and two small layers: many bytes, little compute.

    ``adapters``: the base is frozen and a LoRA adapter on the hidden layer trains instead.
    """

    def __init__(self, size: Size, *, adapters: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(size.vocab, size.dim)
        self.hidden = nn.Linear(size.dim, 64)
        self.head = nn.Linear(64, 16)
        self.lora = None
        if adapters:
            self.requires_grad_(False)
            self.lora = nn.Sequential(nn.Linear(size.dim, 16, bias=False), nn.Linear(16, 64))
            nn.init.zeros_(self.lora[1].weight)  # LoRA starts as the base model

    def forward(self, tokens):
        x = self.embed(tokens).mean(1)
        h = self.hidden(x) if self.lora is None else self.hidden(x) + self.lora(x)
        return self.head(torch.relu(h))


@dataclass(frozen=True)
class Step:
    """One metered step: its loss, time, link bytes and the checkpoint it took, if any."""

    loss: float
    seconds: float
    link_bytes: int
    link_sent: int
    checkpoint_s: float | None
    checkpoint_bytes: int
    checkpoint_read_bytes: int


def metered_step(trainer: Trainer, session) -> Step:
    seen = session.failover_statistics().checkpoints
    (rx0, tx0), start = interface_bytes(), time.perf_counter()
    loss = trainer.step()
    seconds, (rx, tx) = time.perf_counter() - start, interface_bytes()
    stats = session.failover_statistics()
    took = stats.last_checkpoint_s if stats.checkpoints != seen else None
    link, sent = rx - rx0 + tx - tx0, tx - tx0
    return Step(
        loss, seconds, link, sent, took, stats.checkpoint_bytes, stats.checkpoint_read_bytes
    )


def until_checkpoint(trainer: Trainer, session) -> list[Step]:
    """Steps up to and including the first that takes a checkpoint."""
    steps = [metered_step(trainer, session)]
    while steps[-1].checkpoint_s is None:
        steps.append(metered_step(trainer, session))
    return steps


def checkpoint_cycle(trainer: Trainer, session, steps: list[Step]) -> tuple[list[Step], float]:
    """Train on to just after a checkpoint (``steps`` may already end at one), then to just
    after the next: one whole cycle of training and checkpointing, and its seconds."""
    if steps[-1].checkpoint_s is None:
        steps += until_checkpoint(trainer, session)
    start = time.perf_counter()
    cycle = until_checkpoint(trainer, session)
    steps += cycle
    return cycle, time.perf_counter() - start


def checkpoint_link_bytes(cycle: list[Step]) -> int:
    """The cycle's checkpoint's link bytes, less what an ordinary step of it moved."""
    ordinary = sorted(s.link_bytes for s in cycle[:-1]) or [0]
    return cycle[-1].link_bytes - ordinary[len(ordinary) // 2]


def fresh_host(size: Size, hosts: Hosts) -> tuple[dict, list[float]]:
    """Session 1: the first step on a host that never saw the model, then a checkpoint
    cycle. Returns its figures and every step's loss (session 2's reference)."""
    progress(f"session 1 on a fresh host: uploading {size.vocab * size.dim * 4 / 2**20:.0f} MiB")
    trainer = Trainer(size)
    with hosts.attach(hosts.a, size.checkpoint_interval_s, "one") as session:
        start = time.perf_counter()
        trainer.place()
        upload_s = time.perf_counter() - start
        steps = [metered_step(trainer, session)]
        first_s = time.perf_counter() - start
        progress(f"first step took {first_s:.1f} s; training through a checkpoint cycle")
        cycle, cycle_s = checkpoint_cycle(trainer, session, steps)
    share = checkpoint_link_bytes(cycle) / cycle[-1].checkpoint_bytes
    return {
        "first_step_s": round(first_s, 2),
        "first_step_upload_s": round(upload_s, 2),
        "first_step_checkpoints": int(steps[0].checkpoint_s is not None),
        "checkpoint_s": round(cycle[-1].checkpoint_s, 2),
        "checkpoint_cycle_s": round(cycle_s, 2),
        "checkpoint_bytes": cycle[-1].checkpoint_bytes,
        "checkpoint_time_share": round(cycle[-1].checkpoint_s / cycle_s, 4),
        "checkpoint_consumer_bytes_share": round(share, 4),
    }, [s.loss for s in steps]


def second_session(
    size: Size,
    hosts: Hosts,
    kill_pid: int,
    reference: list[float],
    param_bytes: int,
    host_mbit: float,
) -> dict:
    """Session 2 on the same host: its first step's link bytes; then SIGKILL of the host a
    few steps after a checkpoint, and the failover to host B."""
    progress("session 2 on the same host")
    trainer = Trainer(size)
    rx0, tx0 = interface_bytes()
    with hosts.attach(hosts.a, size.checkpoint_interval_s, "two") as session:
        start = time.perf_counter()
        trainer.place()
        steps = [metered_step(trainer, session)]
        first_s = time.perf_counter() - start
        rx, tx = (now - then for now, then in zip(interface_bytes(), (rx0, tx0), strict=True))
        failed_over = kill_mid_run(trainer, session, kill_pid, steps)
        stats = session.failover_statistics()
    compared = min(len(steps), len(reference))
    return {
        "second_session_first_step_s": round(first_s, 2),
        "second_session_consumer_bytes_share": round((rx + tx) / param_bytes, 4),
        "second_session_consumer_tx_share": round(tx / param_bytes, 4),
        "second_session_consumer_rx_share": round(rx / param_bytes, 4),
        "failover_cold_restores": stats.cold_restores,
        "failover_restore_pulled_bytes": stats.restore_pulled_bytes,
        **failover_figures(failed_over, stats, host_mbit),
        "losses_identical": int([s.loss for s in steps[:compared]] == reference[:compared]),
        "losses_compared": compared,
    }


def kill_mid_run(trainer: Trainer, session, kill_pid: int, steps: list[Step]) -> Step:
    """Train to a checkpoint and a few steps past it, SIGKILL the host, train on; returns
    the step that failed over (``steps`` gets every step)."""
    if steps[-1].checkpoint_s is None:
        steps += until_checkpoint(trainer, session)
    # A checkpoint counts once the standby holds it; a host lost while it copies would
    # restore from the one before (and replay longer). Not timed: no step runs meanwhile.
    session.wait_for_standby()
    steps += [metered_step(trainer, session) for _ in range(STEPS_BEFORE_KILL)]
    progress(f"SIGKILL of host A (pid {kill_pid}), {STEPS_BEFORE_KILL} steps after a checkpoint")
    os.kill(kill_pid, signal.SIGKILL)
    failed_over = metered_step(trainer, session)
    steps.append(failed_over)
    steps += [metered_step(trainer, session) for _ in range(STEPS_AFTER_KILL - 1)]
    return failed_over


def failover_figures(failed_over: Step, stats, host_mbit: float) -> dict:
    """The failover's cost against the session's state (its latest checkpoint).

    ``failover_restore_s`` is the part that moved the state (the fresh host's pull into
    its storages, with a standby); ``failover_reconnect_s`` reached the new host, and
    ``failover_replay_s`` replayed the steps since the checkpoint, whose compute a CPU
    executor makes seconds long.
    """
    state = failed_over.checkpoint_bytes
    floor_s = state * 8 / (host_mbit * 1e6)
    resume_s = stats.last_failover_s
    restore = {}
    if stats.restore_pull_s is not None:
        restore = {
            "failover_restore_s": round(stats.restore_pull_s, 2),
            "failover_restore_over_floor": round(stats.restore_pull_s / floor_s, 3),
        }
    parts = {"failover_reconnect_s": stats.reconnect_s, "failover_replay_s": stats.replay_s}
    restore |= {key: round(value, 2) for key, value in parts.items() if value is not None}
    return {
        "failover_state_bytes": state,
        "failover_resume_s": round(resume_s, 2),
        "failover_resume_floor_s": round(floor_s, 2),
        "failover_resume_over_floor": round(resume_s / floor_s, 3),
        **restore,
        "failover_step_took_checkpoint": int(failed_over.checkpoint_s is not None),
        "failover_consumer_bytes_share": round(failed_over.link_bytes / state, 4),
        "failover_consumer_tx_share": round(failed_over.link_sent / state, 4),
    }


def adapters(size: Size, hosts: Hosts) -> dict:
    """Session 3: the base frozen, LoRA adapters trained with Adam; one checkpoint cycle.
    Its checkpoint's bytes are those moved anywhere: read to the consumer, copied to the
    standby (only the pieces it lacked)."""
    progress("session 3: frozen base, small adapters")
    trainer = Trainer(size, adapters=True)
    with hosts.attach(hosts.c, size.checkpoint_interval_s, "three") as session:
        trainer.place()
        cycle, _ = checkpoint_cycle(trainer, session, [metered_step(trainer, session)])
        session.wait_for_standby()
        copied = session.failover_statistics().last_replication_bytes
        trained = trainer.trained_state_bytes()
    moved = cycle[-1].checkpoint_read_bytes + copied
    return {
        "adapter_state_bytes": trained,
        "adapter_checkpoint_bytes": cycle[-1].checkpoint_bytes,
        "adapter_checkpoint_read_bytes": cycle[-1].checkpoint_read_bytes,
        "adapter_checkpoint_copied_bytes": copied,
        "adapter_checkpoint_link_bytes": checkpoint_link_bytes(cycle),
        "adapter_checkpoint_bytes_ratio": round(moved / trained, 2),
    }


if __name__ == "__main__":
    main()
