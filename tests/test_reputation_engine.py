"""Specs for cumulus_p2p.reputation.engine: intake, ranking and Sybil resistance."""

import pytest

from cumulus_p2p.envelope import Envelope, Rejection, seal
from cumulus_p2p.identity import NodeIdentity
from cumulus_p2p.market.book import OrderBook
from cumulus_p2p.market.matcher import rank_offers
from cumulus_p2p.market.messages import Bid, Offer, PriorityClass
from cumulus_p2p.reputation import (
    REPORT_KIND,
    HeartbeatObservation,
    ReportRefusal,
    Reputation,
    ServiceRecord,
)
from cumulus_p2p.reputation.testing import Minter, peer

DAY = 86_400.0
NOW = 1_700_000_000.0
ME = NodeIdentity.generate()
CONSUMERS = [NodeIdentity.generate() for _ in range(3)]
HONEST, RELIABLE, DROPPER, FRESH = (NodeIdentity.generate() for _ in range(4))
MINT = Minter()


def serve(rep, host, n, *, days=30, consumers=CONSUMERS, fraction=1.0):
    """Record ``n`` one-hour leases on ``host`` spread over the last ``days`` days."""
    for i in range(n):
        consumer = consumers[i % len(consumers)]
        start = NOW - days * DAY + i * (days * DAY / n)
        lease = MINT.lease(consumer, host, start=start)
        evidence = MINT.service(consumer, host, lease, fraction=fraction)
        accepted(rep, MINT.report(consumer, peer(host), evidence, now=NOW))


def drop(rep, host, n, *, consumers=CONSUMERS):
    """Record ``n`` leases on ``host`` that it vanished from at once."""
    for i in range(n):
        consumer = consumers[i % len(consumers)]
        lease = MINT.lease(consumer, host, start=NOW - DAY + i * 60)
        accepted(rep, MINT.report(consumer, peer(host), MINT.failure(host, lease), now=NOW))


def accepted(rep, envelope):
    result = rep.receive(envelope.to_bytes(), now=NOW)
    assert result.__class__.__name__ == "Accepted", result
    return result


def fresh_reputation():
    return Reputation(peer(ME), pre_trusted=[peer(c) for c in CONSUMERS])


def ranking(rep, hosts):
    scores = rep.scores(now=NOW, hosts=[peer(h) for h in hosts])
    return sorted((peer(h) for h in hosts), key=lambda h: -scores[h].lower_bound)


def test_a_new_host_starts_at_the_prior():
    rep = fresh_reputation()
    score = rep.score(peer(FRESH), now=NOW)
    assert _fields(score)[1:] == _fields(rep.prior())[1:]
    assert score.mean == pytest.approx(0.45)
    assert score.evidence_weight == 0.0
    assert score.lower_bound < score.mean


def _fields(score):
    return (
        score.host,
        score.mean,
        score.lower_bound,
        score.std,
        score.evidence_weight,
        score.successes,
        score.failures,
    )


def test_an_honest_host_keeps_its_rank_when_20_fresh_identities_report_against_it():
    rep = fresh_reputation()
    serve(rep, HONEST, 30)
    serve(rep, RELIABLE, 12)
    before = rep.score(peer(HONEST), now=NOW)
    assert ranking(rep, [RELIABLE, HONEST]) == [peer(HONEST), peer(RELIABLE)]
    for _ in range(20):
        smearer = NodeIdentity.generate()
        # A real lease the honest host accepted, then a false claim that it vanished.
        lease = MINT.lease(smearer, HONEST, start=NOW - 3600)
        accepted(rep, MINT.report(smearer, peer(HONEST), MINT.failure(HONEST, lease), now=NOW))
        silent = HeartbeatObservation(peer(HONEST), NOW - 3600, NOW - 60, 60, 0)
        accepted(rep, MINT.report(smearer, peer(HONEST), silent, now=NOW))
    after = rep.score(peer(HONEST), now=NOW)
    assert after.lower_bound == pytest.approx(before.lower_bound, abs=1e-12)
    assert ranking(rep, [RELIABLE, HONEST]) == [peer(HONEST), peer(RELIABLE)]


def test_a_host_that_drops_leases_falls_below_reliable_hosts():
    rep = fresh_reputation()
    serve(rep, RELIABLE, 10)
    serve(rep, DROPPER, 12)
    assert ranking(rep, [RELIABLE, DROPPER]) == [peer(DROPPER), peer(RELIABLE)]
    drop(rep, DROPPER, 4)
    assert ranking(rep, [RELIABLE, DROPPER]) == [peer(RELIABLE), peer(DROPPER)]
    assert rep.score(peer(DROPPER), now=NOW).mean < rep.score(peer(RELIABLE), now=NOW).mean


def test_a_sybil_crowd_cannot_inflate_a_fresh_host_above_an_established_one():
    rep = fresh_reputation()
    serve(rep, HONEST, 10)
    crowd = [NodeIdentity.generate() for _ in range(20)]
    # The fresh host and its crowd trade among themselves: every signature is real.
    for sybil in crowd:
        lease = MINT.lease(sybil, FRESH, start=NOW - 2 * DAY, duration_s=86_400, shares=8)
        record = MINT.service(sybil, FRESH, lease)
        accepted(rep, MINT.report(sybil, peer(FRESH), record, now=NOW))
        beat = HeartbeatObservation(peer(FRESH), NOW - DAY, NOW - 60, 1000, 1000)
        accepted(rep, MINT.report(sybil, peer(FRESH), beat, now=NOW))
    fresh = rep.score(peer(FRESH), now=NOW)
    assert fresh.lower_bound == pytest.approx(rep.prior().lower_bound)
    assert ranking(rep, [FRESH, HONEST]) == [peer(HONEST), peer(FRESH)]


def test_scores_for_matcher_rank_the_reliable_host_first_at_equal_price():
    rep = fresh_reputation()
    serve(rep, RELIABLE, 10)
    book = OrderBook()
    for host in (FRESH, RELIABLE):
        book.insert(Offer(peer(host), "o", "A100", 40, 10, 4, 100, 0, "", 0.0, 100.0, 1), now=0.0)
    bid = Bid("me", "b", 0, (), 0, 1, 1000, PriorityClass.ON_DEMAND, 60, 0.0, 100.0, 1)
    reliability = rep.scores_for_matcher([peer(FRESH), peer(RELIABLE)], now=NOW)
    ranked = rank_offers(book, bid, reliability=reliability)
    assert [r.offer.host for r in ranked] == [peer(RELIABLE), peer(FRESH)]
    assert reliability[peer(FRESH)] == pytest.approx(rep.prior().lower_bound)


# --- refusals: each is refused with a clear reason and changes nothing ----------------


def _good_report(reporter=CONSUMERS[0]):
    lease = MINT.lease(reporter, RELIABLE, start=NOW - DAY)
    return MINT.report(reporter, peer(RELIABLE), MINT.service(reporter, RELIABLE, lease), now=NOW)


def _flip_signature(env):
    sig = bytes([env.signature[0] ^ 1]) + env.signature[1:]
    return Envelope(env.kind, env.author, env.body, env.expires_at, env.nonce, sig).to_bytes()


def _unsigned(env):
    return Envelope(env.kind, env.author, env.body, env.expires_at, env.nonce, bytes(64)).to_bytes()


def _garbage_body(env):
    return seal(
        CONSUMERS[0], REPORT_KIND, b"\x93\x01\x02", now=NOW, ttl=60, nonce=MINT.nonce()
    ).to_bytes()


def _forged_lease(env):
    # Mallory signs the host's side of a lease with her own key: the host never leased.
    mallory = NodeIdentity.generate()
    lease = MINT.lease(CONSUMERS[0], mallory, start=NOW - DAY)
    good = MINT.service(CONSUMERS[0], mallory, lease)
    forged = ServiceRecord(good.lease, RELIABLE.public_key, good.receipts)
    return MINT.report(CONSUMERS[0], peer(RELIABLE), forged, now=NOW).to_bytes()


def _not_the_consumer(env):
    lease = MINT.lease(CONSUMERS[0], RELIABLE, start=NOW - DAY)
    claim = MINT.failure(RELIABLE, lease)
    return MINT.report(CONSUMERS[1], peer(RELIABLE), claim, now=NOW).to_bytes()


def _wrong_host(env):
    lease = MINT.lease(CONSUMERS[0], RELIABLE, start=NOW - DAY)
    record = MINT.service(CONSUMERS[0], RELIABLE, lease)
    return MINT.report(CONSUMERS[0], peer(HONEST), record, now=NOW).to_bytes()


def _expired(env):
    return MINT.report(
        CONSUMERS[0],
        peer(RELIABLE),
        MINT.failure(RELIABLE, MINT.lease(CONSUMERS[0], RELIABLE, start=NOW - DAY)),
        now=NOW - 700,
    ).to_bytes()


BAD = {
    "forged signature": (_flip_signature, ReportRefusal.ENVELOPE, Rejection.BAD_SIGNATURE),
    "unsigned": (_unsigned, ReportRefusal.ENVELOPE, Rejection.BAD_SIGNATURE),
    "truncated": (lambda env: env.to_bytes()[:-9], ReportRefusal.ENVELOPE, Rejection.MALFORMED),
    "not msgpack": (lambda env: b"\xc1junk", ReportRefusal.ENVELOPE, Rejection.MALFORMED),
    "expired": (_expired, ReportRefusal.ENVELOPE, Rejection.EXPIRED),
    "garbage body": (_garbage_body, ReportRefusal.MALFORMED, None),
    "forged lease": (_forged_lease, ReportRefusal.INVALID_EVIDENCE, None),
    "reporter is not the consumer": (_not_the_consumer, ReportRefusal.INVALID_EVIDENCE, None),
    "evidence about another host": (_wrong_host, ReportRefusal.INVALID_EVIDENCE, None),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_reports_are_refused_with_a_reason_and_change_nothing(name):
    make, reason, envelope_reason = BAD[name]
    rep = fresh_reputation()
    serve(rep, RELIABLE, 2)
    before = (rep.scores(now=NOW), rep.store.statistics(), rep._validator.statistics())
    result = rep.receive(make(_good_report()), now=NOW)
    assert (result.reason, result.envelope_reason) == (reason, envelope_reason)
    assert result.detail
    assert (rep.scores(now=NOW), rep.store.statistics(), rep._validator.statistics()) == before


def test_a_replayed_report_is_refused_and_counted_once():
    rep = fresh_reputation()
    raw = _good_report().to_bytes()
    accepted(rep, Envelope.from_bytes(raw))
    once = rep.scores(now=NOW)
    again = rep.receive(raw, now=NOW)
    assert (again.reason, again.envelope_reason) == (ReportRefusal.ENVELOPE, Rejection.REPLAYED)
    assert rep.scores(now=NOW) == once


def test_the_same_evidence_relayed_by_the_host_is_a_duplicate():
    rep = fresh_reputation()
    lease = MINT.lease(CONSUMERS[0], RELIABLE, start=NOW - DAY)
    record = MINT.service(CONSUMERS[0], RELIABLE, lease)
    accepted(rep, MINT.report(CONSUMERS[0], peer(RELIABLE), record, now=NOW))
    relayed = MINT.report(RELIABLE, peer(RELIABLE), record, now=NOW).to_bytes()
    assert rep.receive(relayed, now=NOW).reason is ReportRefusal.DUPLICATE
