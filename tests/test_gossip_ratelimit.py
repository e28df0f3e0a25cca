"""Specs for the gossip gate's rate limits: the token buckets (sans-IO) and a flood on a
real loopback mesh, whose excess is dropped at the first hop and never forwarded."""

from __future__ import annotations

import logging
import time

import pytest

from cumulus_p2p.dht.gossip import MARKET_TOPIC, GossipConfig
from cumulus_p2p.dht.ratelimit import RateLimit, RateLimiter
from cumulus_p2p.envelope import seal
from cumulus_p2p.identity import NodeIdentity
from cumulus_p2p.testing.mesh import (
    fast_config,
    open_mesh,
    open_rogue_peer,
    wait_for,
    wait_for_gossip_mesh,
)

logging.getLogger("libp2p").setLevel(logging.ERROR)


def test_a_key_gets_its_burst_then_its_rate():
    limiter = RateLimiter(RateLimit(rate=2.0, burst=3.0, penalty_s=0.0))
    assert [limiter.allow("a", now=0.0) for _ in range(4)] == [True, True, True, False]
    assert limiter.allow("a", now=0.5)  # one token back after half a second
    assert not limiter.allow("a", now=0.5)
    assert limiter.allow("b", now=0.5), "every key has its own bucket"


def test_a_key_past_its_rate_serves_a_penalty_without_refilling():
    limiter = RateLimiter(RateLimit(rate=10.0, burst=1.0, penalty_s=5.0))
    assert limiter.allow("a", now=0.0)
    assert not limiter.allow("a", now=0.0)
    assert limiter.blocked("a", now=4.9)
    assert not limiter.allow("a", now=4.9)
    assert limiter.allow("a", now=5.2), "it refills from empty once the penalty is over"
    assert (limiter.refused, limiter.penalties) == (2, 1)


def test_the_table_of_buckets_is_bounded():
    limiter = RateLimiter(RateLimit(rate=1.0, burst=1.0), max_keys=3)
    for key in range(10):
        limiter.allow(key, now=0.0)
    assert len(limiter) == 3


@pytest.mark.slow
async def test_a_flooding_peer_is_rate_limited_and_its_excess_is_not_forwarded() -> None:
    gossip = GossipConfig(
        heartbeat_interval=0.5,
        peer_limit=RateLimit(rate=1.0, burst=20.0, penalty_s=30.0),
        author_limit=RateLimit(rate=1.0, burst=5.0, penalty_s=30.0),
    )
    async with open_mesh(1, config=fast_config(gossip=gossip)) as mesh:
        # The node behind keeps the default limits: the entry node's 21st message (a
        # refill) would otherwise meet its own bucket for the flooder empty, and this
        # spec is about the first hop.
        (entry,) = mesh.nodes
        behind = await mesh.add_node(fast_config())
        await behind.connect(entry.addrs[0])
        await wait_for_gossip_mesh([entry, behind])
        authors = [NodeIdentity.generate() for _ in range(8)]
        now = time.time()
        # Round robin over the authors: none breaks its own limit, the peer breaks its.
        flood = [
            seal(a, "market/offer", f"junk {i}".encode(), now=now, ttl=30.0, nonce=i + 1)
            for i in range(10)
            for a in authors
        ]
        async with open_rogue_peer([entry]) as rogue:
            await rogue.flood([e.to_bytes() for e in flood])
            # Each excess message costs the flooder score; a few put it under the
            # publish threshold, and the entry node drops the rest unread.
            await wait_for(
                lambda: (
                    entry.router.scorer.score(rogue.peer_id, [MARKET_TOPIC])
                    < gossip.publish_threshold
                ),
                timeout=10.0,
                what="the flooder under the publish threshold",
            )
            rejected = entry.statistics().rejected
            accepted = {m.envelope.digest for m in mesh.received(0)}
            assert rejected["RATE_LIMITED_PEER"] >= 4
            assert "RATE_LIMITED_AUTHOR" not in rejected
            assert 20 <= len(accepted) <= 21, "the burst and at most one refill get in"
            # The node behind is never told about the excess: what the entry accepted
            # arrives (forwarded after its validation, in no order with what the entry
            # publishes itself), then a sentinel sent after it, and the excess never does.
            await wait_for(
                lambda: accepted <= {m.envelope.digest for m in mesh.received(1)},
                timeout=5.0,
                what="every accepted message forwarded",
            )
            sentinel = entry.seal("market/bid", b"sentinel")
            await entry.publish(sentinel)
            await wait_for(
                lambda: sentinel.digest in mesh.books[1], timeout=5.0, what="the sentinel"
            )
            forwarded = {m.envelope.digest for m in mesh.received(1)} - {sentinel.digest}
            assert forwarded == accepted
            # The entry node only relayed what it accepted: the node behind it does
            # not hold that against it.
            assert behind.router.scorer.score(entry.peer_id, [MARKET_TOPIC]) >= 0
