"""A native session's checkpoints at real sizes (issue 30): what they cost, and a move.

A model of frozen tensors (1.1 GiB in four of 288 MiB; ``--quick``: 96 MiB in four of
24 MiB) and a small trained layer, on the native ``cumulus`` device, against a
``cumulus-executor`` on loopback with failover to a second one. In order:

1. upload the model; take the first checkpoint (every piece is read back);
2. a training step; a second checkpoint (only the trained layer's pieces changed);
3. two more steps; SIGKILL of the first executor; the next step's loss reads the state
   back onto the second executor (the checkpoint's restore, then the batches since) and
   goes on.

Loopback, not a shaped link: the figures are this machine's copy and hashing costs, the
floor under a real link's time for the same bytes.

Prints JSON (``benchmarks/results/native_checkpoint[_quick].json``)::

    python benchmarks/native_checkpoint.py [--quick]

Keys: ``state_bytes`` (the session's storages), ``upload_s``, ``first_checkpoint_s`` and
``first_checkpoint_bytes`` (read back), ``incremental_checkpoint_s`` and
``incremental_checkpoint_bytes``, ``failover_step_s`` (the step that moved, restore
included) against ``step_s`` (an ordinary one), ``client_checkpoint_bytes`` (the pieces
the client holds), and ``losses_identical`` (1 when the steps after the move have the
losses of the same steps in a session that did not move).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MIB = 1 << 20


def run(frozen_mib: int, *, kill: bool) -> dict:
    """One session of the scenario; with ``kill``, the first executor dies before step 4."""
    import torch

    from cumulus_p2p.channel.transport import SocketFrameChannel
    from cumulus_p2p.native.session import NativeSession
    from cumulus_p2p.testing.executor import executor_process

    def channel(address: str) -> SocketFrameChannel:
        host, port = address.split(":")
        return SocketFrameChannel.connect(host, int(port))

    figures: dict = {}
    with executor_process(quota="16GiB") as (first, killed):
        with executor_process(quota="16GiB") as (second, _):
            with NativeSession(channel(first), reconnect=lambda _: channel(second)) as session:
                torch.manual_seed(0)
                started = time.perf_counter()
                frozen = [torch.randn(frozen_mib * MIB // 4).to("cumulus") for _ in range(4)]
                layer = torch.nn.Linear(256, 256).to("cumulus")
                opt = torch.optim.SGD(layer.parameters(), lr=0.1)
                x = torch.randn(64, 256).to("cumulus")
                session.synchronize()
                figures["upload_s"] = time.perf_counter() - started

                def step() -> float:
                    opt.zero_grad()
                    loss = (layer(x) + frozen[0][:256]).square().mean()
                    loss.backward()
                    opt.step()
                    return loss.item()

                started = time.perf_counter()
                session.checkpoint()
                figures["first_checkpoint_s"] = time.perf_counter() - started
                figures["first_checkpoint_bytes"] = session.checkpoint_bytes
                losses = [step()]
                before = session.checkpoint_bytes
                started = time.perf_counter()
                checkpoint = session.checkpoint()
                figures["incremental_checkpoint_s"] = time.perf_counter() - started
                figures["incremental_checkpoint_bytes"] = session.checkpoint_bytes - before
                figures["state_bytes"] = checkpoint.nbytes
                figures["client_checkpoint_bytes"] = session._pieces.nbytes
                started = time.perf_counter()
                losses.append(step())
                figures["step_s"] = time.perf_counter() - started
                losses.append(step())
                if kill:
                    killed.kill()
                    killed.wait()
                started = time.perf_counter()
                losses.append(step())
                figures["failover_step_s"] = time.perf_counter() - started
                figures["failovers"] = session.failovers
    figures["losses"] = losses
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="96 MiB instead of 1.1 GiB")
    args = parser.parse_args()
    from cumulus_p2p import native

    native.load()
    frozen_mib = 24 if args.quick else 288
    moved = run(frozen_mib, kill=True)
    stayed = run(frozen_mib, kill=False)
    result = {k: round(v, 3) if isinstance(v, float) else v for k, v in moved.items()}
    result["losses_identical"] = int(moved["losses"] == stayed["losses"])
    result["step_s_without_move"] = round(stayed["failover_step_s"], 3)
    print(json.dumps(result, indent=2))
    name = "native_checkpoint_quick.json" if args.quick else "native_checkpoint.json"
    (ROOT / "benchmarks" / "results" / name).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
