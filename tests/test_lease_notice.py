"""Specs for the lease notice protocol: a host tells its consumer it ends a lease early
(it is leaving, or an on-demand lease preempted this one).

Real py-libp2p hosts on loopback (``/cumulus/lease-notice/1.0.0``), and the consumer
node's rule for which notices stand.
"""

import msgpack
import pytest

from cumulus_p2p._errors import ReceiptRejectedError
from cumulus_p2p.identity import NodeIdentity
from cumulus_p2p.market.messages import PriorityClass
from cumulus_p2p.market.rpc import call_rpc
from cumulus_p2p.market.settlement import (
    NOTICE_LEAVING,
    NOTICE_PREEMPTED,
    NOTICE_PROTOCOL,
    call_lease_notice,
    serve_lease_notices,
)
from cumulus_p2p.node.consumer import notice_refusal
from cumulus_p2p.testing.hosts import connect, noise_hosts
from cumulus_p2p.testing.market import lease_proposal


class Notices:
    """The consumer's side: knows one lease, held from one host."""

    def __init__(self, lease_id: str, host: str) -> None:
        self.lease_id, self.host, self.taken = lease_id, host, []

    async def take(self, lease_id, kind, detail, sender):
        if lease_id != self.lease_id or sender != self.host:
            return "no such lease with this host"
        self.taken.append((kind, detail))
        return None


async def test_the_leases_host_is_heard_and_anyone_else_is_refused():
    host_id, consumer_id, other_id = (NodeIdentity.generate() for _ in range(3))
    async with noise_hosts([host_id, consumer_id, other_id]) as (host, consumer, other):
        notices = Notices("L1", host.get_id().to_base58())
        serve_lease_notices(consumer, notices.take)
        await connect(host, consumer)
        await connect(other, consumer)
        await call_lease_notice(host, consumer.get_id(), "L1", NOTICE_LEAVING, "shutting down")
        with pytest.raises(ReceiptRejectedError, match="no such lease"):
            await call_lease_notice(other, consumer.get_id(), "L1", NOTICE_LEAVING, "lies")
    assert notices.taken == [(NOTICE_LEAVING, "shutting down")]


@pytest.mark.parametrize(
    "request_body",
    [
        b"\xc1",
        msgpack.packb(["L1", "evicted", ""]),
        msgpack.packb(["L1", NOTICE_LEAVING]),
        msgpack.packb(["", NOTICE_LEAVING, ""]),
        msgpack.packb(["L1", NOTICE_LEAVING, "x" * 600]),
    ],
    ids=["not-msgpack", "unknown-kind", "short", "empty-lease", "oversized-detail"],
)
async def test_a_malformed_notice_is_refused_and_taken_for_nothing(request_body):
    host_id, consumer_id = NodeIdentity.generate(), NodeIdentity.generate()
    async with noise_hosts([host_id, consumer_id]) as (host, consumer):
        notices = Notices("L1", host.get_id().to_base58())
        serve_lease_notices(consumer, notices.take)
        await connect(host, consumer)
        answer = await call_rpc(host, consumer.get_id(), NOTICE_PROTOCOL, request_body)
    assert msgpack.unpackb(answer) == [False, "malformed notice"]
    assert notices.taken == []


# --- the consumer node's rule: whose notice stands ------------------------------------------


def a_lease(priority):
    host, consumer = NodeIdentity.generate(), NodeIdentity.generate()
    proposal = lease_proposal(consumer, host, start_at=1e9, duration_s=3600, priority=priority)
    return proposal, host.peer_id.to_base58()


def test_a_preemption_notice_stands_for_a_contending_or_interruptible_lease_from_its_host():
    for priority in (PriorityClass.CONTEND, PriorityClass.INTERRUPTIBLE):
        proposal, host = a_lease(priority)
        assert notice_refusal(proposal, NOTICE_PREEMPTED, host) is None


def test_a_preemption_notice_for_an_on_demand_lease_is_refused():
    proposal, host = a_lease(PriorityClass.ON_DEMAND)
    assert notice_refusal(proposal, NOTICE_PREEMPTED, host) == (
        "an on-demand lease is never preempted"
    )
    assert notice_refusal(proposal, NOTICE_LEAVING, host) is None  # a host may still leave


def test_a_notice_from_anyone_but_the_leases_host_or_about_no_lease_is_refused():
    proposal, _ = a_lease(PriorityClass.CONTEND)
    stranger = NodeIdentity.generate().peer_id.to_base58()
    assert notice_refusal(proposal, NOTICE_PREEMPTED, stranger) == "no such lease with this host"
    assert notice_refusal(None, NOTICE_PREEMPTED, stranger) == "no such lease with this host"
