"""A native session's checkpoints at real sizes (issue 30): what they cost, and a move.

A model of frozen tensors (1.1 GiB in four of 288 MiB; ``--quick``: 96 MiB in four of
24 MiB) and a small trained layer, on the native ``cumulus`` device, against a
``cumulus-executor`` with failover to a second one. In order:

1. upload the model; take the first checkpoint;
2. a training step; a second checkpoint (only the trained layer's pieces changed);
3. two more steps; SIGKILL of the first executor; the next step's loss reads the state
   back onto the second executor (the checkpoint's restore, then the batches since) and
   goes on.

Where the checkpoints go (``--checkpoint-to``): ``consumer``, the client reads back every
piece that changed and a move uploads them all again; ``standby``, a third executor
pulls them from the session's host, host to host, and a move's fresh host pulls them
from it.

On loopback (the default), the figures are this machine's copying and hashing costs.
With ``--shaped`` (root: network namespaces) the consumer and three hosts sit on one
switch, the consumer's link shaped to 100 Mbit/s each way and the hosts' to 1 Gbit/s
(``netns.shaped_mesh``), and the consumer's link bytes are read from the kernel's
counters of its interface.

Prints JSON (``benchmarks/results/native_checkpoint[_shaped][_standby][_quick].json``)::

    [sudo] python benchmarks/native_checkpoint.py [--quick] [--shaped]
        [--checkpoint-to consumer|standby]

Keys: ``state_bytes`` (the session's storages), ``upload_s``, ``first_checkpoint_s`` and
``first_checkpoint_bytes`` (read back to the client), ``incremental_checkpoint_s`` and
``incremental_checkpoint_bytes``, ``failover_step_s`` (the step that moved, restore
included) against ``step_s`` (an ordinary one), ``client_checkpoint_bytes`` (the pieces
the client holds), ``standby_copied_bytes`` (what the standby pulled, host to host),
``restored_bytes`` (what the fresh host pulled from it), and ``losses_identical`` (1
when every step's loss is local CPU's). With a standby, a new session then uploads the
same frozen tensors to the standby's host, whose store holds their pieces:
``second_upload_s``, ``second_upload_named_bytes`` (sent by digest). With ``--shaped``:
``consumer_link_mbit_measured``, and the consumer's link bytes (both ways) of the
upload, the first checkpoint, the step that moved and the second upload:
``upload_link_bytes``, ``first_checkpoint_link_bytes``, ``failover_step_link_bytes``,
``second_upload_link_bytes``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MIB = 1 << 20
STEPS = 4  # the first executor dies before the last


def train(device: str, frozen_mib: int, *, before_step: Callable[[int], None]) -> list[float]:
    """``STEPS`` seeded SGD steps of the layer beside the frozen tensors on ``device``;
    ``before_step(i)`` runs before each (the scenario's checkpoints and kill)."""
    import torch

    torch.manual_seed(0)
    frozen = [torch.randn(frozen_mib * MIB // 4).to(device) for _ in range(4)]
    layer = torch.nn.Linear(256, 256).to(device)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    x = torch.randn(64, 256).to(device)
    losses = []
    for index in range(STEPS):
        before_step(index)
        opt.zero_grad()
        loss = (layer(x) + frozen[0][:256]).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def consume(plan: dict) -> dict:
    """The client's side of the scenario (``plan``: the executors' addresses, the size,
    where checkpoints go, the pid to kill); its figures."""
    from cumulus_p2p import native

    native.load()
    from cumulus_p2p.blobs.standby import StandbyLink
    from cumulus_p2p.channel.transport import SocketFrameChannel
    from cumulus_p2p.native.session import NativeSession

    def channel(address: str) -> SocketFrameChannel:
        host, port = address.rsplit(":", 1)
        return SocketFrameChannel.connect(host, int(port))

    link = _link_bytes if plan["shaped"] else (lambda: 0)
    standby = plan.get("standby")
    link_standby = standby and StandbyLink(channel(standby), address=standby)
    figures: dict = {}
    marks: dict[str, tuple[float, int]] = {}

    def mark(name: str) -> None:
        marks[name] = (time.perf_counter(), link())

    def since(name: str, key: str) -> None:
        started, bytes_before = marks[name]
        figures[f"{key}_s"] = time.perf_counter() - started
        if plan["shaped"]:
            figures[f"{key}_link_bytes"] = link() - bytes_before

    with NativeSession(
        channel(plan["first"]),
        reconnect=lambda _: channel(plan["second"]),
        standby=link_standby or None,
    ) as session:

        def before_step(index: int) -> None:
            if index == 0:
                session.synchronize()
                since("upload", "upload")
                mark("first_checkpoint")
                session.checkpoint()
                since("first_checkpoint", "first_checkpoint")
                figures["first_checkpoint_bytes"] = session.checkpoint_bytes
            elif index == 1:
                before = session.checkpoint_bytes
                mark("incremental")
                taken = session.checkpoint()
                since("incremental", "incremental_checkpoint")
                figures["incremental_checkpoint_bytes"] = session.checkpoint_bytes - before
                figures["state_bytes"] = taken.nbytes
                figures["client_checkpoint_bytes"] = session._pieces.nbytes
                mark("step")
            elif index == 2:
                since("step", "step")
            elif index == STEPS - 1:
                os.kill(plan["kill_pid"], signal.SIGKILL)
                mark("failover")

        mark("upload")
        losses = train("cumulus", plan["frozen_mib"], before_step=before_step)
        since("failover", "failover_step")
        figures["failovers"] = session.failovers
        figures["restored_bytes"] = session.restored_bytes
        if link_standby:
            figures["standby_copied_bytes"] = sum(
                r.fetched_bytes for r in link_standby.replications
            )
    figures["losses"] = losses
    if standby:
        figures |= second_upload(channel(standby), plan["frozen_mib"], link)
    return figures


def second_upload(channel, frozen_mib: int, link: Callable[[], int]) -> dict:
    """A new session on the standby's host uploads the same frozen tensors: that host's
    store holds their pieces (the checkpoint's), so they go by digest."""
    import torch

    from cumulus_p2p.native.session import NativeSession

    torch.manual_seed(0)
    frozen = [torch.randn(frozen_mib * MIB // 4) for _ in range(4)]
    with NativeSession(channel) as session:
        started, before = time.perf_counter(), link()
        on_device = [t.to("cumulus") for t in frozen]
        session.synchronize()
        figures = {
            "second_upload_s": time.perf_counter() - started,
            "second_upload_link_bytes": link() - before,
            "second_upload_named_bytes": session.upload_bytes_named,
        }
        del on_device
    return figures


def _link_bytes() -> int:
    from cumulus_p2p.testing.netns import interface_bytes

    return sum(interface_bytes())


def on_loopback(plan: dict) -> dict:
    """Run the executors on loopback and the client in this process."""
    from cumulus_p2p.testing.executor import executor_process

    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        names = ["first", "second"] + (["standby"] if plan["checkpoint_to"] == "standby" else [])
        for name in names:
            extra = ["--blob-dir", str(work / name)]
            address, proc = stack.enter_context(executor_process(quota="16GiB", extra=extra))
            plan[name] = address
            if name == "first":
                plan["kill_pid"] = proc.pid
        return consume(plan)


def on_shaped_links(plan: dict) -> dict:
    """Run the executors in host namespaces and the client in the consumer's, behind a
    100 Mbit/s link."""
    from cumulus_p2p.testing.executor import executor_in
    from cumulus_p2p.testing.linkrate import measure_mbit
    from cumulus_p2p.testing.netns import shaped_mesh

    with shaped_mesh(hosts=3, consumer_mbit=100, host_mbit=1000) as mesh:
        consumer, hosts = mesh.consumer, mesh.hosts
        figures = {
            "consumer_link_mbit_measured": round(measure_mbit(consumer, hosts[0], seconds=2.0), 1)
        }
        with ExitStack() as stack:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            for name, host in zip(("first", "standby", "second"), hosts, strict=True):
                address, proc = stack.enter_context(executor_in(host, work / name))
                plan[name] = address
                if name == "first":
                    plan["kill_pid"] = proc.pid
            if plan["checkpoint_to"] != "standby":
                del plan["standby"]
            cmd = [sys.executable, __file__, "--consumer", json.dumps(plan)]
            done = subprocess.run(consumer.command(*cmd), stdout=subprocess.PIPE, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"the consumer failed (exit {done.returncode})")
            return figures | json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="96 MiB instead of 1.1 GiB")
    parser.add_argument("--shaped", action="store_true", help="a 100 Mbit/s consumer link")
    parser.add_argument("--checkpoint-to", choices=("consumer", "standby"), default="consumer")
    parser.add_argument("--consumer", help=argparse.SUPPRESS)  # the client's role: JSON
    args = parser.parse_args()
    if args.consumer:
        print(json.dumps(consume(json.loads(args.consumer))), flush=True)
        return
    frozen_mib = 24 if args.quick else 288
    plan = {"frozen_mib": frozen_mib, "shaped": args.shaped, "checkpoint_to": args.checkpoint_to}
    moved = (on_shaped_links if args.shaped else on_loopback)(plan)
    local = train("cpu", frozen_mib, before_step=lambda _: None)
    result = {k: round(v, 3) if isinstance(v, float) else v for k, v in moved.items()}
    result |= {"checkpoint_to": args.checkpoint_to, "shaped": args.shaped}
    result["losses_identical"] = int(moved["losses"] == local)
    print(json.dumps(result, indent=2))
    name = "native_checkpoint" + "_shaped" * args.shaped
    name += "_standby" * (args.checkpoint_to == "standby") + "_quick" * args.quick
    (ROOT / "benchmarks" / "results" / f"{name}.json").write_text(
        json.dumps(result, indent=2) + "\n"
    )


if __name__ == "__main__":
    main()
