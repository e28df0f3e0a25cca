"""Providers that lie: for tests.

``python -m cumulus_p2p.testing.liar --bootstrap ADDR --data DIR --price 0.1 --lie WHAT``
runs the real provider node (``run_provider``) on this machine's CPU, lying about one
thing:

- ``device`` (the default): its offer claims an ``NVIDIA H100 80GB HBM3`` with 80 GiB
  and 60000 performance units;
- ``bytes``: its offer is true, but every receipt claims 64 MiB more than the session
  moved;
- ``share-seconds``: its offer is true, but every receipt charges twice the share-seconds
  its interval holds.

It prints ``listening on ADDR`` and ``providing`` lines like ``cumulus-node --provide``.
"""

from __future__ import annotations

import argparse
import dataclasses

import trio

from ..cli import parse_price
from ..dht import MeshConfig
from ..market.messages import open_message, seal_message
from ..market.metering import Meter
from ..node.datadir import DataDir
from ..node.hardware import DeviceFacts, cpu_facts
from ..node.provider import OfferedDevice, ProviderOptions, run_provider
from .nodes import SHARED_MACHINE_PERF

CLAIM = DeviceFacts("cpu", 0, "NVIDIA H100 80GB HBM3", 80 * 1024, None, "")
CLAIMED_PERF = 60_000
EXTRA_BYTES = 64 * 2**20


def overcharge_bytes() -> None:
    """Make every ``Meter`` on this process add ``EXTRA_BYTES`` to each receipt."""
    issue = Meter.issue

    def inflated(self, now, *, nonce):
        self.record_bytes(EXTRA_BYTES)
        return issue(self, now, nonce=nonce)

    Meter.issue = inflated


def overcharge_share_seconds() -> None:
    """Make every ``Meter`` on this process charge twice the share-seconds (re-signed)."""
    issue = Meter.issue

    def inflated(self, now, *, nonce):
        fair = open_message(issue(self, now, nonce=nonce))
        doubled = dataclasses.replace(fair, share_seconds=2 * fair.share_seconds + 1)
        return seal_message(self._host, doubled, now=now)

    Meter.issue = inflated


def ready(provider) -> None:
    for addr in provider.runtime.mesh.addrs:
        print(f"listening on {addr}", flush=True)
    models = ", ".join(d.facts.model for d in provider.options.devices)
    print(f"providing {models} on {provider.endpoints}", flush=True)


async def main(bootstrap: str, data: DataDir, price: int, lie: str) -> None:
    config = MeshConfig(
        listen_addrs=("/ip4/127.0.0.1/tcp/0",), bootstrap=(bootstrap,), announce_interval=1.0
    )
    if lie == "device":
        device, perf = CLAIM, CLAIMED_PERF
    else:
        overcharge_bytes() if lie == "bytes" else overcharge_share_seconds()
        device, perf = cpu_facts(), int(SHARED_MACHINE_PERF)  # a true claim, see there
    options = ProviderOptions(
        devices=(OfferedDevice(device, perf),), shares=4, price=price, receipt_interval=1.0
    )
    await run_provider(data, config, options, on_ready=ready, handle_signals=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--price", type=parse_price, default=parse_price("0.1"))
    parser.add_argument("--lie", choices=["device", "bytes", "share-seconds"], default="device")
    args = parser.parse_args()
    trio.run(main, args.bootstrap, DataDir(args.data), args.price, args.lie)
