"""A consumer that leases and computes but never countersigns a receipt: for tests.

``python -m cumulus_p2p.testing.freeloader --bootstrap ADDR --data DIR`` joins the mesh
through ``ADDR``, leases from the first offer it can (through the real ``Consumer``),
and runs tensor ops on the leased device through the real session channel, but answers
no receipt request: it does not serve ``/cumulus/receipt/1.0.0``. It prints one line per
event, for the test to follow:

- ``leased <lease id>``, then ``computing`` once ops run;
- ``session ended: <why>`` when the host hangs up on it;
- ``resume refused: <why>`` when it tries the same lease again, or ``resumed``;
- ``lease again refused: <why>`` or ``leased again`` for a second proposal, once
  ``--again-after`` seconds have passed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import trio

from .. import remote
from .._errors import CumulusError, NoMatchError, SessionClosedError
from ..dht import MeshConfig
from ..market.hostchoice import HostChoice
from ..market.settlement import ReceiptDesk
from ..node.consumer import Consumer, ConsumerOptions
from ..node.control import SessionTicket
from ..node.datadir import DataDir
from ..node.dial import open_channel
from ..node.runtime import open_runtime


def command(bootstrap: str, data_dir: Path, *, again_after: float) -> list[str]:
    """The command line that runs a freeloader: what tests start."""
    module = "cumulus_p2p.testing.freeloader"
    data = ["--data", str(data_dir), "--again-after", str(again_after)]
    return [sys.executable, "-m", module, "--bootstrap", bootstrap, *data]


def compute_until_hung_up(ticket: SessionTicket, data: DataDir) -> str:
    """Run ops on the leased device until the host ends the session; return why."""
    channel = open_channel(ticket, data.identity(), resume_timeout=2.0).channel
    print("computing", flush=True)
    try:
        with remote.attach(channel=channel):
            x = torch.ones(64, 64, device="cumulus")
            while True:
                x = (x @ x).clamp(max=1.0)
                x.sum().item()
    except SessionClosedError as exc:
        return str(exc)


def try_to_resume(ticket: SessionTicket, data: DataDir) -> str:
    try:
        open_channel(ticket, data.identity(), resume_timeout=2.0).channel.close()
    except CumulusError as exc:
        return f"resume refused: {exc}"
    return "resumed"


async def main(bootstrap: str, data: DataDir, again_after: float) -> None:
    config = MeshConfig(
        listen_addrs=("/ip4/127.0.0.1/tcp/0",), bootstrap=(bootstrap,), announce_interval=1.0
    )
    options = ConsumerOptions(command=("none.py",), duration_s=600, match_timeout=60)
    async with open_runtime(data.identity(), data, config) as runtime:
        consumer = Consumer(runtime, options, ReceiptDesk(data.identity(), data.ledger()))
        consumer.bid_body(runtime.mesh.next_nonce(), runtime.clock() + 60)
        held = await consumer.lease(options.match_timeout)
        print(f"leased {held.proposal.lease_id}", flush=True)
        ticket = await consumer.current_ticket()
        why = await trio.to_thread.run_sync(compute_until_hung_up, ticket, data)
        print(f"session ended: {why}", flush=True)
        print(await trio.to_thread.run_sync(try_to_resume, ticket, data), flush=True)
        await trio.sleep(again_after)
        consumer.choice = HostChoice()  # forget any host it set aside
        try:
            await consumer.lease(10)
            print("leased again", flush=True)
        except NoMatchError:
            print(f"lease again refused: {consumer.last_refusal}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--again-after", type=float, default=0.0)
    args = parser.parse_args()
    trio.run(main, args.bootstrap, DataDir(args.data), args.again_after)
    sys.exit(0)
