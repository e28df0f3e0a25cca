"""Specs for the provider's offer (``Provider.offer_body``): its storage terms for standbys.

The provider here has no mesh: its runtime and executor are stand-ins holding just what
the offer and status read.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cumulus_p2p.identity import NodeIdentity
from cumulus_p2p.market import Lease, Offer, decode_message, seal_message
from cumulus_p2p.node.hardware import DeviceFacts
from cumulus_p2p.node.provider import OfferedDevice, Provider, ProviderOptions
from cumulus_p2p.testing.market import lease_proposal

NOW = 1_700_000_000.0
HOST, CONSUMER = NodeIdentity.generate(), NodeIdentity.generate()
DEVICES = tuple(
    OfferedDevice(DeviceFacts("cpu", i, "cpu", 4096, None, ""), perf_units=100) for i in (0, 1)
)


def provider(**options) -> Provider:
    runtime = SimpleNamespace(
        identity=HOST,
        peer_id=HOST.peer_id.to_base58(),
        data=SimpleNamespace(ledger=lambda: None),
        clock=lambda: NOW,
        snapshot=lambda: {"peer_id": HOST.peer_id.to_base58()},
    )
    executor = SimpleNamespace(sessions={}, health=SimpleNamespace(healthy=True, reason=""))
    terms = ProviderOptions(devices=DEVICES, shares=4, price=1000, **options)
    return Provider(runtime, terms, [executor, executor])


def offers(p: Provider, nonce: int) -> list[Offer]:
    return [
        decode_message(Offer.KIND, p.offer_body(served, nonce, NOW + 60))
        for served in p.served.values()
    ]


def test_every_offer_announces_the_storage_terms_and_the_gib_left():
    p = provider(storage_price=20_000, storage_gib=100)
    assert [(o.storage_price, o.storage_gib) for o in offers(p, 1)] == [(20_000, 100)] * 2
    standby = lease_proposal(
        CONSUMER, HOST, start_at=NOW, duration_s=600, storage_gib=60, price=20_000,
        offer_id="device1",
    )  # fmt: skip
    granted = p.book.propose(seal_message(CONSUMER, standby, now=NOW).to_bytes(), now=NOW)
    assert isinstance(granted, Lease)
    assert p.free_storage() == 40 and p.free_shares() == 8  # a standby takes no shares
    assert [o.storage_gib for o in offers(p, 2)] == [40, 40]
    state = p.snapshot()
    assert (state["storage_gib_free"], state["storage_gib_total"]) == (40, 100)
    assert state["storage_price"] == 20_000


def test_a_provider_that_lends_no_storage_offers_none():
    p = provider()
    assert [(o.storage_price, o.storage_gib) for o in offers(p, 1)] == [(0, 0)] * 2


@pytest.mark.parametrize(
    "terms", [{"storage_gib": -1}, {"storage_gib": 2**20 + 1}, {"storage_price": -5}]
)
def test_storage_terms_out_of_range_are_refused(terms):
    with pytest.raises(ValueError, match="storage_"):
        provider(**terms)


def test_an_overcommitted_device_sells_more_shares_of_the_same_memory_and_says_so():
    p = provider(overcommit=1.5)
    assert [(o.shares_free, o.overcommit_pct) for o in offers(p, 1)] == [(6, 150)] * 2
    assert p.served["device0"].share_bytes == 4096 * 2**20 // 4  # a share's memory as before
    assert (p.snapshot()["shares_total"], p.snapshot()["overcommit"]) == (12, 1.5)


@pytest.mark.parametrize("factor", [0.9, 2.1])
def test_an_overcommit_out_of_range_is_refused(factor):
    with pytest.raises(ValueError, match="overcommit must be 1.0..2"):
        provider(overcommit=factor)


def test_an_offer_sealed_while_its_device_is_fully_leased_frees_no_share():
    p = provider()
    offers(p, 1)
    taken = lease_proposal(
        CONSUMER, HOST, start_at=NOW, duration_s=600, shares=4, offer_id="device0"
    )
    assert isinstance(
        p.book.propose(seal_message(CONSUMER, taken, now=NOW).to_bytes(), now=NOW), Lease
    )
    # The announce loop seals again before the device's offer is withdrawn (within 0.5 s).
    offers(p, 2)
    assert p.book.free_shares("device0") == 0
    again = lease_proposal(
        CONSUMER, HOST, start_at=NOW, duration_s=600, lease_id="L2", offer_id="device0", nonce=2
    )
    refused = p.book.propose(seal_message(CONSUMER, again, now=NOW).to_bytes(), now=NOW)
    assert not isinstance(refused, Lease)
