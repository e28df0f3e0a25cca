"""Specs for cumulus_p2p.market.probing: liveness probes over real libp2p streams."""

import time

import pytest
import trio
from libp2p.exceptions import BaseLibp2pError

from cumulus_p2p._errors import LivenessProofError
from cumulus_p2p.identity import NodeIdentity
from cumulus_p2p.market.liveness import (
    CHALLENGE_SIZE,
    Liveness,
    LivenessPolicy,
    LivenessState,
    ProofRefusal,
    answer_probe,
)
from cumulus_p2p.market.probing import LIVENESS_PROTOCOL, call_probe, serve_liveness
from cumulus_p2p.market.rpc import serve_rpc
from cumulus_p2p.testing.hosts import connect, noise_hosts

FAST = LivenessPolicy(timeout_s=0.5)


def fresh(i=0):
    return bytes([i]) * CHALLENGE_SIZE


async def probe(prober, host, liveness, i=0):
    return await call_probe(prober, host.get_id(), liveness, nonce=fresh(i))


async def test_a_host_serving_liveness_answers_a_probe_with_its_key_and_capacity():
    host_id, prober_id = NodeIdentity.generate(), NodeIdentity.generate()
    async with noise_hosts([host_id, prober_id]) as (host, prober):
        serve_liveness(host, host_id, free_shares=lambda: 3, next_nonce=lambda: 1)
        await connect(prober, host)
        liveness = Liveness(prober_id.peer_id_text)
        evidence = await probe(prober, host, liveness)
    assert evidence.host == host_id.peer_id_text and evidence.free_shares == 3
    assert evidence.proof.author == host_id.public_key
    assert liveness.state(host_id.peer_id_text, now=evidence.received_at) is LivenessState.ALIVE


async def test_a_host_that_does_not_speak_the_protocol_misses_its_probe():
    host_id, prober_id = NodeIdentity.generate(), NodeIdentity.generate()
    async with noise_hosts([host_id, prober_id]) as (host, prober):
        await connect(prober, host)
        liveness = Liveness(prober_id.peer_id_text, FAST)
        with pytest.raises(BaseLibp2pError):
            await probe(prober, host, liveness)
    assert liveness.statistics(now=time.time()).misses == 1


async def test_a_host_that_never_answers_misses_its_probe_at_the_timeout():
    host_id, prober_id = NodeIdentity.generate(), NodeIdentity.generate()
    async with noise_hosts([host_id, prober_id]) as (host, prober):

        async def never(request: bytes, requester: str) -> bytes:
            await trio.sleep_forever()

        serve_rpc(host, LIVENESS_PROTOCOL, never)
        await connect(prober, host)
        liveness = Liveness(prober_id.peer_id_text, FAST)
        started = trio.current_time()
        with pytest.raises(trio.TooSlowError):
            await probe(prober, host, liveness)
        assert trio.current_time() - started < 2 * FAST.timeout_s
    assert liveness.statistics(now=time.time()).misses == 1


async def test_an_answer_signed_with_another_key_is_refused_as_forged():
    host_id, prober_id = NodeIdentity.generate(), NodeIdentity.generate()
    async with noise_hosts([host_id, prober_id]) as (host, prober):
        # The host answers with the key of an identity it does not hold on this connection.
        serve_liveness(host, NodeIdentity.generate(), free_shares=lambda: 1, next_nonce=lambda: 1)
        await connect(prober, host)
        liveness = Liveness(prober_id.peer_id_text, FAST)
        with pytest.raises(LivenessProofError, match="not by the host") as caught:
            await probe(prober, host, liveness)
    assert caught.value.reason is ProofRefusal.FORGED
    assert liveness.set_aside(host_id.peer_id_text, now=time.time())


async def test_a_host_replaying_an_earlier_answer_is_refused():
    host_id, prober_id = NodeIdentity.generate(), NodeIdentity.generate()
    async with noise_hosts([host_id, prober_id]) as (host, prober):
        first: list[bytes] = []

        async def replay(request: bytes, requester: str) -> bytes:
            if not first:
                first.append(
                    answer_probe(
                        host_id,
                        request,
                        prober=requester,
                        now=time.time(),
                        free_shares=1,
                        nonce=1,
                    )  # fmt: skip
                )
            return first[0]

        serve_rpc(host, LIVENESS_PROTOCOL, replay)
        await connect(prober, host)
        liveness = Liveness(prober_id.peer_id_text, LivenessPolicy(alive_for_s=0.01))
        await probe(prober, host, liveness)
        await trio.sleep(0.02)  # the evidence lapses: the host is probed afresh
        with pytest.raises(LivenessProofError) as caught:
            await probe(prober, host, liveness, i=1)
    assert caught.value.reason is ProofRefusal.UNKNOWN_CHALLENGE


async def test_a_malformed_answer_is_refused():
    host_id, prober_id = NodeIdentity.generate(), NodeIdentity.generate()
    async with noise_hosts([host_id, prober_id]) as (host, prober):

        async def garbage(request: bytes, requester: str) -> bytes:
            return b"\xc1 not an answer"

        serve_rpc(host, LIVENESS_PROTOCOL, garbage)
        await connect(prober, host)
        liveness = Liveness(prober_id.peer_id_text, FAST)
        with pytest.raises(LivenessProofError, match="not an envelope") as caught:
            await probe(prober, host, liveness)
    assert caught.value.reason is ProofRefusal.MALFORMED
