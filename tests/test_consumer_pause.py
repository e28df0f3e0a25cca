"""A late payer loses time, not work: a consumer whose host paused its lease for an
overdue receipt resumes there (the dial waits for the receipt to be paid:
``test_dial_paused.py``), without failing over or blaming the host.

In-process, over real py-libp2p hosts on loopback: a consumer node's ``Runtime`` and
``Consumer``, and a bare host that grants it a lease.
"""

import itertools

from cumulus_p2p.dht.node import MeshConfig
from cumulus_p2p.identity import NodeIdentity
from cumulus_p2p.market import LeaseBook, LeaseServer, Offer, serve_leases
from cumulus_p2p.market.probing import serve_liveness
from cumulus_p2p.market.settlement import HANGUP_PAUSED, ReceiptDesk
from cumulus_p2p.node.consumer import Consumer, ConsumerOptions, LeaseState
from cumulus_p2p.node.datadir import DataDir
from cumulus_p2p.node.runtime import open_runtime
from cumulus_p2p.testing.hosts import connect, noise_hosts

OPTIONS = ConsumerOptions(command=("job.py",), max_price=1_000_000, match_timeout=20)
PAUSED = f"lost the executor (provider closed the session: {HANGUP_PAUSED}: 1 receipt(s))"


async def test_a_lease_paused_for_an_overdue_receipt_is_resumed_on_its_host_without_blame(tmp_path):
    data, identity = DataDir(tmp_path / "consumer"), NodeIdentity.generate()
    config = MeshConfig(listen_addrs=("/ip4/127.0.0.1/tcp/0",))
    async with open_runtime(data.identity(), data, config) as runtime:
        consumer = Consumer(runtime, OPTIONS, ReceiptDesk(data.identity(), data.ledger()))
        now = runtime.clock()
        consumer.bid_body(runtime.mesh.next_nonce(), now + 60)
        async with noise_hosts([identity]) as (host,):
            offer = Offer(identity.peer_id_text, "gpu0", "RTX 4090", 24_576, 100, 4, 400_000,
                          0, "", now, now + 600, 1)  # fmt: skip
            book = LeaseBook(identity)
            book.publish(offer)
            serve_leases(host, LeaseServer(book, endpoints=lambda: ["127.0.0.1:9"]))
            serve_liveness(
                host, identity, free_shares=lambda: 4, next_nonce=itertools.count(1).__next__
            )
            runtime.book.insert(offer, now=now)
            await connect(runtime.mesh.host, host)
            held = await consumer.lease()
            ticket = await consumer.failover(PAUSED)
    assert ticket.lease_id == held.proposal.lease_id
    assert held.state is LeaseState.HELD
    assert consumer.choice.usable(identity.peer_id_text, now=runtime.clock())
