"""Specs for cumulus_p2p.reputation.store: dedupe, bounds, expiry."""

from cumulus_p2p.reputation import AddStatus, EvidenceKind, EvidenceStore, Finding


def finding(i, *, at=100.0, credited="c", host="h", served=10, kind=EvidenceKind.SERVICE):
    return Finding(bytes([i]) * 32, kind, host, credited, at, served=served)


def test_the_same_evidence_is_held_once():
    store = EvidenceStore()
    assert store.add(finding(1), now=100.0) is AddStatus.ADDED
    assert store.add(finding(1), now=100.0) is AddStatus.DUPLICATE
    assert len(store) == 1


def test_a_service_record_with_more_receipts_supersedes_the_older_one():
    store = EvidenceStore()
    store.add(finding(1, served=10), now=100.0)
    assert store.add(finding(1, served=20, at=110.0), now=110.0) is AddStatus.SUPERSEDED
    assert [f.served for f in store.findings()] == [20]


def test_one_peer_cannot_fill_the_store():
    store = EvidenceStore(max_per_reporter=3)
    statuses = [store.add(finding(i, credited="sybil"), now=100.0) for i in range(5)]
    assert statuses.count(AddStatus.QUOTA) == 2
    assert store.add(finding(9, credited="other"), now=100.0) is AddStatus.ADDED


def test_a_full_store_evicts_the_oldest_evidence():
    store = EvidenceStore(max_records=3)
    for i in range(4):
        store.add(finding(i, at=100.0 + i, credited=f"c{i}"), now=200.0)
    assert sorted(f.at for f in store.findings()) == [101.0, 102.0, 103.0]


def test_old_evidence_expires_and_is_refused():
    store = EvidenceStore(max_age_s=50.0)
    store.add(finding(1, at=100.0), now=100.0)
    store.add(finding(2, at=140.0), now=140.0)
    assert store.expire(now=160.0) == 1
    assert store.add(finding(3, at=100.0), now=160.0) is AddStatus.TOO_OLD
    assert store.statistics().findings == 1
