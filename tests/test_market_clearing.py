"""Specs for cumulus_p2p.market.clearing: per GPU model, the ask, the contending floor and
what recent leases cleared at."""

from cumulus_p2p.identity import NodeIdentity
from cumulus_p2p.market.book import RestingOrder
from cumulus_p2p.market.clearing import Clearing, ClearingPrices, price_rows, weighted_median
from cumulus_p2p.market.messages import Offer, PriorityClass
from cumulus_p2p.testing.market import lease_proposal

NOW = 10_000.0
CONSUMER, HOST = NodeIdentity.generate(), NodeIdentity.generate()


def lease(lease_id="L1", *, price=1000, shares=1, start=NOW - 60, **terms):
    return lease_proposal(
        CONSUMER, HOST, start_at=start, duration_s=3600, lease_id=lease_id, price=price,
        shares=shares, **terms,
    )  # fmt: skip


def resting(model="A100", *, price=1000, shares=2, contend_price=0, contend_shares=0):
    offer = Offer(
        "host", f"{model}-{price}", model, 40_960, 100, shares or 1, price, 0, "",
        NOW, NOW + 60, 1, contend_price=contend_price, contend_shares=contend_shares,
    )  # fmt: skip
    return RestingOrder(offer, shares, contend_shares)


def clearing(price, shares=1, priority=PriorityClass.CONTEND, model="A100"):
    return Clearing(model, priority, price, shares, NOW)


def test_a_lease_counts_once_however_often_it_is_reported():
    prices = ClearingPrices()
    assert prices.record(lease(), "A100", now=NOW)
    assert not prices.record(lease(), "A100", now=NOW)
    assert len(prices.recent(NOW)) == 1


def test_a_standby_lease_buys_disk_and_is_not_a_gpu_price():
    prices = ClearingPrices()
    assert not prices.record(lease(storage_gib=4, shares=0), "A100", now=NOW)
    assert prices.recent(NOW) == []


def test_a_lease_that_ended_before_the_window_or_starts_later_is_not_counted():
    prices = ClearingPrices(window_s=3600)
    assert not prices.record(lease("old", start=NOW - 7201), "A100", now=NOW)
    assert not prices.record(lease("future", start=NOW + 3600), "A100", now=NOW)
    assert prices.recent(NOW) == []


def test_a_long_lease_reported_at_its_end_still_counts():
    # Started 83 minutes ago, ended 23 minutes ago: within the hour, it counts.
    assert ClearingPrices(window_s=3600).record(lease(start=NOW - 5000), "A100", now=NOW)


def test_a_lease_leaves_the_window_an_hour_after_it_was_seen():
    prices = ClearingPrices(window_s=3600)
    prices.record(lease(start=NOW - 60), "A100", now=NOW)
    assert len(prices.recent(NOW + 3599)) == 1
    prices.expire(NOW + 3600)
    assert len(prices) == 0


def test_the_oldest_lease_goes_first_when_the_store_is_full():
    prices = ClearingPrices(max_leases=2)
    for i in range(3):
        prices.record(lease(f"L{i}", price=100 * (i + 1)), "A100", now=NOW)
    assert [c.price for c in prices.recent(NOW)] == [200, 300]


def test_the_cleared_price_is_the_share_weighted_median():
    # One share at 900 does not outvote six at 300.
    assert weighted_median([clearing(300, 6), clearing(900, 1)]) == 300
    assert weighted_median([clearing(300, 1), clearing(500, 1), clearing(900, 1)]) == 500
    assert weighted_median([]) is None


def test_each_gpu_model_shows_its_cheapest_ask_and_contending_floor_with_shares_free():
    offers = [
        resting("A100", price=1000, contend_price=400, contend_shares=2),
        resting("A100", price=800, contend_price=300, contend_shares=0),  # floor full
        resting("A100", price=700, shares=0),  # on-demand full
        resting("H100", price=2500),
    ]
    rows = {r.gpu_model: r for r in price_rows(offers, [])}
    assert (rows["A100"].ask, rows["A100"].contend_floor) == (800, 400)
    assert (rows["H100"].ask, rows["H100"].contend_floor) == (2500, None)
    assert rows["H100"].contend_cleared is None and rows["H100"].contend_leases == 0


def test_contending_and_on_demand_leases_clear_separately_per_model():
    clearings = [
        clearing(400, priority=PriorityClass.CONTEND),
        clearing(1000, priority=PriorityClass.ON_DEMAND),
        clearing(600, priority=PriorityClass.INTERRUPTIBLE),
        clearing(2000, priority=PriorityClass.ON_DEMAND, model="H100"),
    ]
    rows = {r.gpu_model: r for r in price_rows([], clearings)}
    a100 = rows["A100"]
    assert (a100.contend_cleared, a100.contend_leases) == (400, 1)
    assert (a100.on_demand_cleared, a100.on_demand_leases) == (600, 2)
    assert a100.ask is None  # no live offer: only what cleared
    assert rows["H100"].on_demand_cleared == 2000
