"""A hostile process that floods the market with valid, signed junk offers (issue 36).

``python -m cumulus_p2p.testing.spammer --bootstrap ADDR --keys 50``: one libp2p host
joins through ``ADDR`` and publishes, as fast as its peers take them, offers signed by
``--keys`` fresh identities, each claiming an H100 with 80 GiB at ``--price`` (a
millionth of a credit by default) with a new offer id every time. The host itself is the
first identity: its offers can be dialed, and it takes every lease proposal and never
answers (the costliest junk for a consumer); the other identities cannot be dialed.

It prints ``listening on ADDR`` once connected, and a JSON line of counts every second.
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import AsyncExitStack

import multiaddr
import trio
from libp2p.abc import INetStream
from libp2p.tools.anyio_service import background_trio_service

from ..dht.gossip import MARKET_TOPIC, TOPICS, GossipConfig, new_gossip
from ..dht.host import connect, listen_addrs_with_id, new_mesh_host, parse_peer_addr
from ..identity import NodeIdentity
from ..market.messages import Offer, seal_message
from ..market.negotiation import LEASE_PROTOCOL


async def _never_answer(stream: INetStream) -> None:
    """Take a lease proposal and sit on it until the proposer gives up."""
    try:
        await trio.sleep_forever()
    finally:
        with trio.CancelScope(shield=True):
            try:
                await stream.reset()
            except Exception:  # noqa: BLE001 - the stream may be gone in any way
                pass


async def flood(args: argparse.Namespace) -> None:
    keys = [NodeIdentity.generate() for _ in range(args.keys)]
    host = new_mesh_host(keys[0].key_pair)
    pubsub, router = new_gossip(host, GossipConfig(heartbeat_interval=0.5))
    host.set_stream_handler(LEASE_PROTOCOL, _never_answer)
    async with AsyncExitStack() as stack:
        listen = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]
        await stack.enter_async_context(host.run(listen_addrs=listen))
        await stack.enter_async_context(background_trio_service(pubsub))
        await stack.enter_async_context(background_trio_service(router))
        await pubsub.wait_until_ready()
        for topic in TOPICS:
            await pubsub.subscribe(topic)
        await connect(host, parse_peer_addr(args.bootstrap))
        print(f"listening on {listen_addrs_with_id(host)[0]}", flush=True)
        sent, nonces, started = 0, dict.fromkeys(range(len(keys)), 0), time.monotonic()
        next_report = started + 1.0
        while True:
            for i, key in enumerate(keys):
                while any(len(q) >= 16 for q in getattr(pubsub, "peer_queues", {}).values()):
                    await trio.sleep(0.002)
                nonces[i] += 1
                now = time.time()
                offer = Offer(
                    key.peer_id.to_base58(),
                    f"junk{sent}",
                    "NVIDIA H100 80GB HBM3",
                    81_920,
                    1_000_000,
                    8,
                    args.price,
                    0,
                    "",
                    now,
                    now + 30.0,
                    nonces[i],
                )
                await pubsub.publish(MARKET_TOPIC, seal_message(key, offer, now=now).to_bytes())
                sent += 1
            if time.monotonic() >= next_report:
                next_report += 1.0
                elapsed = time.monotonic() - started
                print(json.dumps({"sent": sent, "per_s": round(sent / elapsed)}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--keys", type=int, default=50)
    parser.add_argument("--price", type=int, default=1, help="micro-credits per share-hour")
    trio.run(flood, parser.parse_args())


if __name__ == "__main__":
    main()
