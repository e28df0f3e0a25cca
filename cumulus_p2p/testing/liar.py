"""A provider that claims a GPU it does not have: for tests.

``python -m cumulus_p2p.testing.liar --bootstrap ADDR --data DIR --price 0.1`` runs the
real provider node (``run_provider``) on this machine's CPU, but its offer claims an
``NVIDIA H100 80GB HBM3`` with 80 GiB and 60000 performance units. It prints
``listening on ADDR`` and ``providing`` lines like ``cumulus-node --provide``.
"""

from __future__ import annotations

import argparse

import trio

from ..cli import parse_price
from ..dht import MeshConfig
from ..node.datadir import DataDir
from ..node.hardware import DeviceFacts
from ..node.provider import ProviderOptions, run_provider

CLAIM = DeviceFacts("cpu", 0, "NVIDIA H100 80GB HBM3", 80 * 1024, None, "")
CLAIMED_PERF = 60_000


def ready(provider) -> None:
    for addr in provider.runtime.mesh.addrs:
        print(f"listening on {addr}", flush=True)
    print(f"providing {CLAIM.model} (a lie) on {provider.endpoint}", flush=True)


async def main(bootstrap: str, data: DataDir, price: int) -> None:
    config = MeshConfig(
        listen_addrs=("/ip4/127.0.0.1/tcp/0",), bootstrap=(bootstrap,), announce_interval=1.0
    )
    options = ProviderOptions(
        device=CLAIM, perf_units=CLAIMED_PERF, shares=4, price=price, receipt_interval=1.0
    )
    await run_provider(data, config, options, on_ready=ready, handle_signals=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--price", type=parse_price, default=parse_price("0.1"))
    args = parser.parse_args()
    trio.run(main, args.bootstrap, DataDir(args.data), args.price)
