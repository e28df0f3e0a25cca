"""Specs for cumulus_p2p.market.liveness: the cost of entry for a host with no record.

Sans-IO: the prober's ``Liveness`` and the host's ``answer_probe`` talk through bytes
passed by hand, with the time passed in.
"""

import msgpack
import pytest

from cumulus_p2p._errors import LivenessProofError, LocalProtocolError, MalformedMessageError
from cumulus_p2p.envelope import seal
from cumulus_p2p.identity import NodeIdentity
from cumulus_p2p.market.liveness import (
    CHALLENGE_SIZE,
    LIVENESS_KIND,
    TRANSITIONS,
    Liveness,
    LivenessEvent,
    LivenessPolicy,
    LivenessState,
    ProofRefusal,
    answer_probe,
)

NOW = 1_700_000_000.0
PROBER = NodeIdentity.from_seed(b"p" * 32).peer_id_text
HOST_KEY = NodeIdentity.from_seed(b"h" * 32)
HOST = HOST_KEY.peer_id_text
POLICY = LivenessPolicy()


def nonce(i=0):
    return bytes([i]) * CHALLENGE_SIZE


def answer(probe, *, key=HOST_KEY, prober=PROBER, now=NOW + 0.01):
    """The host's honest answer to ``probe``."""
    return answer_probe(key, probe.request, prober=prober, now=now, free_shares=4, nonce=1)


def probed(liveness=None, host=HOST, i=0):
    liveness = liveness or Liveness(PROBER)
    return liveness, liveness.challenge(host, nonce=nonce(i), now=NOW)


def refusal(liveness, raw, host=HOST, now=NOW + 0.02):
    with pytest.raises(LivenessProofError) as caught:
        liveness.answered(host, raw, now=now)
    return caught.value.reason


# --- an honest probe -----------------------------------------------------------------


def test_a_host_that_signs_the_challenge_with_its_key_is_alive():
    liveness, probe = probed()
    evidence = liveness.answered(HOST, answer(probe), now=NOW + 0.02)
    assert liveness.alive(HOST, now=NOW + 0.02)
    assert (evidence.prober, evidence.challenge, evidence.free_shares) == (PROBER, nonce(), 4)
    assert evidence.received_at == NOW + 0.02 and evidence.proof.kind == LIVENESS_KIND


def test_a_host_never_probed_is_unproven():
    assert Liveness(PROBER).state(HOST, now=NOW) is LivenessState.UNPROVEN
    assert not Liveness(PROBER).alive(HOST, now=NOW)


def test_an_answer_lapses_after_alive_for_s_and_the_host_is_probed_again():
    liveness, probe = probed()
    liveness.answered(HOST, answer(probe), now=NOW)
    later = NOW + POLICY.alive_for_s
    assert not liveness.alive(HOST, now=later)
    assert liveness.due([HOST], now=later) == [HOST]


# --- refused answers -----------------------------------------------------------------


def test_an_answer_signed_by_another_key_is_refused_as_forged():
    liveness, probe = probed()
    mallory = NodeIdentity.from_seed(b"m" * 32)
    assert refusal(liveness, answer(probe, key=mallory)) is ProofRefusal.FORGED


def test_an_answer_whose_signature_does_not_verify_is_refused_as_forged():
    liveness, probe = probed()
    raw = bytearray(answer(probe))
    raw[-1] ^= 1  # the signature's last byte
    assert refusal(liveness, bytes(raw)) is ProofRefusal.FORGED


def test_an_answer_delivered_twice_is_refused_as_a_replay():
    liveness, probe = probed()
    raw = answer(probe)
    liveness.answered(HOST, raw, now=NOW + 0.02)
    assert refusal(liveness, raw, now=NOW + 0.03) is ProofRefusal.UNKNOWN_CHALLENGE
    assert liveness.alive(HOST, now=NOW + 0.03)  # a replay by a third party blames no one


def test_an_answer_to_an_earlier_challenge_is_refused_as_a_replay():
    liveness, first = probed(Liveness(PROBER, LivenessPolicy(backoff_s=10.0)))
    old = answer(first)
    liveness.missed(HOST, now=NOW + POLICY.timeout_s)
    later = NOW + 10.0 + POLICY.timeout_s  # the old answer has not expired yet
    liveness.challenge(HOST, nonce=nonce(1), now=later)
    assert refusal(liveness, old, now=later + 0.01) is ProofRefusal.UNKNOWN_CHALLENGE


def test_an_answer_to_another_probers_challenge_is_refused():
    liveness, probe = probed()
    other = NodeIdentity.from_seed(b"o" * 32).peer_id_text
    assert refusal(liveness, answer(probe, prober=other)) is ProofRefusal.WRONG_PROBER


def test_an_expired_answer_is_refused():
    liveness = Liveness(PROBER, LivenessPolicy(timeout_s=120.0))
    _, probe = probed(liveness)
    raw = answer(probe, now=NOW - 100)  # the host's clock is far behind
    assert refusal(liveness, raw, now=NOW + 1) is ProofRefusal.EXPIRED


@pytest.mark.parametrize(
    "raw",
    [
        b"not msgpack \xc1",
        msgpack.packb([1, 2, 3]),
        seal(HOST_KEY, "market/offer", b"\x90", now=NOW, ttl=60, nonce=1).to_bytes(),
        seal(HOST_KEY, LIVENESS_KIND, msgpack.packb(["x"]), now=NOW, ttl=60, nonce=1).to_bytes(),
    ],
    ids=["garbage", "not-an-envelope", "another-kind", "wrong-body"],
)
def test_a_malformed_answer_is_refused(raw):
    liveness, _ = probed()
    assert refusal(liveness, raw) is ProofRefusal.MALFORMED


def test_a_refused_answer_counts_as_a_missed_probe():
    liveness, _ = probed()
    refusal(liveness, b"junk")
    assert liveness.set_aside(HOST, now=NOW + 1)


def test_the_refusal_says_what_was_wrong():
    liveness, probe = probed()
    mallory = NodeIdentity.from_seed(b"m" * 32)
    with pytest.raises(LivenessProofError, match="not by the host"):
        liveness.answered(HOST, answer(probe, key=mallory), now=NOW + 0.02)


def test_a_host_refuses_a_request_that_is_no_challenge():
    with pytest.raises(MalformedMessageError):
        answer_probe(HOST_KEY, b"\x92\x01\x02", prober=PROBER, now=NOW, free_shares=1, nonce=1)


# --- hosts that never answer ---------------------------------------------------------


def test_a_host_that_misses_a_probe_is_set_aside_for_the_backoff():
    liveness, _ = probed()
    assert liveness.missed(HOST, now=NOW + 2) == POLICY.backoff_s
    assert liveness.set_aside(HOST, now=NOW + 2 + POLICY.backoff_s - 1)
    assert liveness.due([HOST], now=NOW + 2 + POLICY.backoff_s - 1) == []
    assert liveness.due([HOST], now=NOW + 2 + POLICY.backoff_s) == [HOST]


def test_a_host_that_never_answers_costs_a_bounded_number_of_probes():
    liveness, now, probes = Liveness(PROBER), NOW, 0
    day = NOW + 24 * 3600
    while now < day:
        if liveness.due([HOST], now=now):
            liveness.challenge(HOST, nonce=nonce(probes % 256), now=now)
            liveness.missed(HOST, now=now + POLICY.timeout_s)
            probes += 1
        now += 10
    # 10 s, doubling to an hour: 10 probes in the first hour or two, then one an hour.
    assert probes <= 10 + 24


def test_a_probe_with_no_verdict_past_twice_its_timeout_counts_as_missed():
    liveness, _ = probed()
    assert liveness.state(HOST, now=NOW + POLICY.timeout_s) is LivenessState.PROBING
    assert liveness.state(HOST, now=NOW + 2 * POLICY.timeout_s) is LivenessState.SILENT


def test_a_late_verdict_on_a_probe_already_timed_out_changes_nothing():
    liveness, _ = probed()
    liveness.due([], now=NOW + 10)  # the probe timed out here
    assert liveness.missed(HOST, now=NOW + 11) == 0.0
    assert liveness.statistics(now=NOW + 11).misses == 1


# --- the budget ----------------------------------------------------------------------


def test_due_hands_out_hosts_in_the_order_first_seen_within_the_budget():
    liveness = Liveness(PROBER, LivenessPolicy(at_once=2))
    liveness.see("early", now=NOW)
    flood = [f"sybil{i}" for i in range(5)]
    assert liveness.due([*flood, "early"], now=NOW + 1) == ["early", "sybil0"]


def test_due_hands_out_a_lower_tier_first_whenever_it_was_seen():
    liveness = Liveness(PROBER, LivenessPolicy(at_once=1))
    liveness.see("cheap junk", now=NOW)
    tier = {"cheap junk": 1, "fair": 0}
    assert liveness.due(["cheap junk", "fair"], now=NOW + 1, tier=tier) == ["fair"]


def test_a_silent_host_back_from_its_backoff_queues_behind_hosts_waiting_meanwhile():
    liveness = Liveness(PROBER, LivenessPolicy(at_once=1))
    liveness.challenge("sybil", nonce=nonce(), now=NOW)
    liveness.missed("sybil", now=NOW + 1)
    liveness.see("newcomer", now=NOW + 2)
    back = NOW + 1 + POLICY.backoff_s
    assert liveness.due(["sybil", "newcomer"], now=back) == ["newcomer"]


def test_due_counts_probes_in_flight_against_the_budget():
    liveness = Liveness(PROBER, LivenessPolicy(at_once=2))
    liveness.challenge("a", nonce=nonce(), now=NOW)
    assert liveness.due(["a", "b", "c"], now=NOW) == ["b"]


def test_memory_is_bounded_by_forgetting_the_host_seen_least_recently():
    liveness = Liveness(PROBER, LivenessPolicy(at_once=1, max_hosts=3))
    for i, host in enumerate(["a", "b", "c", "d"]):
        liveness.see(host, now=NOW + i)
    assert liveness.statistics(now=NOW + 4).hosts == 3
    assert liveness.due(["a"], now=NOW + 5) == ["a"]  # seen afresh, "b" forgotten


# --- the transition table ------------------------------------------------------------


def test_challenging_a_host_being_probed_is_a_local_error():
    liveness, _ = probed()
    with pytest.raises(LocalProtocolError, match="challenged while probing"):
        liveness.challenge(HOST, nonce=nonce(1), now=NOW)


def test_a_challenge_must_be_fresh_random_bytes_of_the_right_size():
    with pytest.raises(LocalProtocolError):
        Liveness(PROBER).challenge(HOST, nonce=b"short", now=NOW)


def test_every_state_can_get_back_to_unproven():
    for state in TRANSITIONS:
        reached, frontier = {state}, [state]
        while frontier:
            for nxt in TRANSITIONS[frontier.pop()].values():
                if nxt not in reached:
                    reached.add(nxt)
                    frontier.append(nxt)
        assert LivenessState.UNPROVEN in reached, state
    assert TRANSITIONS[LivenessState.PROBING] == {
        LivenessEvent.ANSWERED: LivenessState.ALIVE,
        LivenessEvent.MISSED: LivenessState.SILENT,
    }
