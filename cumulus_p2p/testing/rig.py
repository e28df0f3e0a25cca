"""A provider with several devices, for tests on a machine with no GPU.

``python -m cumulus_p2p.testing.rig --bootstrap ADDR --data DIR --devices 2 --shares 1``
runs the real provider node (``run_provider``) offering ``--devices`` devices, an offer
each, as ``cumulus-node --provide`` offers every GPU of a rig. Each device is this
machine's CPU under its own index (offers ``device0``, ``device1``...), served by a
supervisor of its own: a rig of GPUs is the one thing a test here cannot have. Sessions
run in worker processes, as they do on GPUs by default; two in-process CPU executors
would share one process's CPU generator, where each GPU has its own.

It prints ``listening on ADDR`` and ``providing`` lines like ``cumulus-node --provide``.
"""

from __future__ import annotations

import argparse
import dataclasses

import trio

from ..cli import parse_price
from ..dht import MeshConfig
from ..node.datadir import DataDir
from ..node.hardware import cpu_facts
from ..node.provider import OfferedDevice, ProviderOptions, run_provider
from .nodes import SHARED_MACHINE_PERF


def ready(provider) -> None:
    for addr in provider.runtime.mesh.addrs:
        print(f"listening on {addr}", flush=True)
    offers = ", ".join(f"{d.offer_id} ({d.facts.model})" for d in provider.options.devices)
    print(f"providing {offers} on {provider.endpoints}", flush=True)


async def main(args: argparse.Namespace) -> None:
    config = MeshConfig(
        listen_addrs=("/ip4/127.0.0.1/tcp/0",), bootstrap=(args.bootstrap,), announce_interval=1.0
    )
    cpu, perf = cpu_facts(), int(SHARED_MACHINE_PERF)  # see there
    devices = tuple(
        OfferedDevice(dataclasses.replace(cpu, index=i), perf) for i in range(args.devices)
    )
    options = ProviderOptions(
        devices=devices,
        shares=args.shares,
        price=args.price,
        receipt_interval=1.0,
        workers=True,
    )
    await run_provider(DataDir(args.data), config, options, on_ready=ready, handle_signals=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--shares", type=int, default=1)
    parser.add_argument("--price", type=parse_price, default=parse_price("0.5"))
    trio.run(main, parser.parse_args())
