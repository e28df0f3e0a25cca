"""Specs for cumulus_p2p.market.book: the order book, checked against a brute-force model."""

import functools

from hypothesis import given, settings
from hypothesis import strategies as st

from cumulus_p2p.market.book import BookLimits, InsertStatus, OrderBook
from cumulus_p2p.market.messages import (
    Bid,
    Cancel,
    Offer,
    PriorityClass,
    Side,
    encode_message,
)

HOSTS = ["h0", "h1", "h2"]
CONSUMERS = ["c0", "c1", "c2"]


def offer(
    host="h0",
    offer_id="o",
    *,
    price=10,
    shares=4,
    created=0.0,
    expires=100.0,
    nonce=1,
    model="A100",
    vram=40,
    perf=10,
    min_lease=0,
    contend_price=0,
    contend_shares=None,
    overcommit_pct=100,
):
    if contend_shares is None:  # an offer selling contending use sells as many shares so
        contend_shares = shares if contend_price else 0
    return Offer(
        host,
        offer_id,
        model,
        vram,
        perf,
        shares,
        price,
        min_lease,
        "",
        created,
        expires,
        nonce,
        contend_price=contend_price,
        contend_shares=contend_shares,
        overcommit_pct=overcommit_pct,
    )


def bid(
    consumer="c0",
    bid_id="b",
    *,
    max_price=100,
    shares=1,
    created=0.0,
    expires=100.0,
    nonce=1,
    models=(),
    min_vram=0,
    min_perf=0,
    duration=60,
    priority=PriorityClass.ON_DEMAND,
    max_overcommit_pct=200,
    gpus=1,
):
    return Bid(
        consumer,
        bid_id,
        min_vram,
        models,
        min_perf,
        shares,
        max_price,
        priority,
        duration,
        created,
        expires,
        nonce,
        max_overcommit_pct,
        gpus,
    )


#: When a generated offer or bid was made, when it expires and its nonce: few values, so
#: that replacements, expiries and replays collide often.
LIFETIMES = dict(
    created=st.sampled_from([0.0, 1.0, 2.0]),
    expires=st.sampled_from([10.0, 20.0, 30.0]),
    nonce=st.integers(0, 4),
)
offers = st.builds(
    offer,
    st.sampled_from(HOSTS),
    st.sampled_from(["o0", "o1"]),
    price=st.integers(1, 6),
    shares=st.integers(1, 4),
    **LIFETIMES,
    model=st.sampled_from(["A100", "H100"]),
    vram=st.sampled_from([40, 80]),
    perf=st.sampled_from([5, 10]),
    min_lease=st.sampled_from([0, 100]),
    overcommit_pct=st.sampled_from([100, 150, 200]),
)
bids = st.builds(
    bid,
    st.sampled_from(CONSUMERS),
    st.sampled_from(["b0", "b1"]),
    max_price=st.integers(0, 7),
    shares=st.integers(1, 6),
    **LIFETIMES,
    models=st.sampled_from([(), ("A100",), ("H100",), ("A100", "H100")]),
    min_vram=st.sampled_from([0, 80]),
    min_perf=st.sampled_from([0, 10]),
    duration=st.sampled_from([60, 200]),
    max_overcommit_pct=st.sampled_from([100, 200]),
)
cancels = st.builds(
    Cancel,
    st.sampled_from(HOSTS + CONSUMERS),
    st.sampled_from([Side.OFFER, Side.BID]),
    st.sampled_from(["o0", "o1", "b0", "b1"]),
    st.sampled_from([10.0, 20.0, 30.0]),
    st.integers(0, 5),
)
messages = st.lists(st.one_of(offers, bids, cancels), max_size=25)


def side_key(message):
    if type(message) is Offer:
        return (Side.OFFER, message.host, message.offer_id)
    if type(message) is Bid:
        return (Side.BID, message.consumer, message.bid_id)
    return (message.side, message.author, message.order_id)


def model_live_orders(all_messages, now):
    """The live orders by brute force: per key, the highest nonce (ties: smallest bytes)."""
    winners = {}
    for message in all_messages:
        key = side_key(message)
        rank = (-message.nonce, encode_message(message))
        if key not in winners or rank < winners[key][0]:
            winners[key] = (rank, message)
    return {
        key: message
        for key, (_, message) in winners.items()
        if type(message) is not Cancel and message.expires_at > now
    }


def offer_key(o):
    return (o.price, o.created_at, o.host, o.offer_id)


def model_fill(b, wanted, remaining, live_offers):
    fills = []
    eligible = sorted(
        (
            o
            for o in live_offers
            if remaining[(o.host, o.offer_id)] > 0
            and o.price <= b.max_price
            and b.accepts(o)
            and o.host != b.consumer
        ),
        key=offer_key,
    )
    for o in eligible:
        if wanted == 0:
            break
        take = min(wanted, remaining[(o.host, o.offer_id)])
        remaining[(o.host, o.offer_id)] -= take
        wanted -= take
        fills.append((b.consumer, b.bid_id, o.host, o.offer_id, take, o.price))
    return fills


def model_match(live):
    live_offers = [m for m in live.values() if type(m) is Offer]
    live_bids = sorted(
        (m for m in live.values() if type(m) is Bid),
        key=lambda b: (-b.max_price, b.created_at, b.consumer, b.bid_id),
    )
    remaining = {(o.host, o.offer_id): o.shares_free for o in live_offers}
    fills = []
    for b in live_bids:
        fills += model_fill(b, b.shares, remaining, live_offers)
    return fills


def fill_tuples(fills):
    return [(f.consumer, f.bid_id, f.host, f.offer_id, f.shares, f.price) for f in fills]


def build(all_messages, now=0.0):
    book = OrderBook()
    for message in all_messages:
        book.insert(message, now=now)
    return book


@settings(max_examples=150, deadline=None)
@given(messages, st.randoms(use_true_random=False))
def test_any_message_order_gives_the_same_book_and_the_same_matches(all_messages, rng):
    shuffled = list(all_messages)
    rng.shuffle(shuffled)
    first, second = build(all_messages), build(shuffled)
    assert first.snapshot() == second.snapshot()
    assert first.match(now=5.0) == second.match(now=5.0)
    assert first.snapshot() == second.snapshot()


@settings(max_examples=100, deadline=None)
@given(messages)
def test_the_change_count_moves_whenever_the_live_orders_change(all_messages):
    # What a reader keeps until the count moves (a simulation's rankings) is never stale.
    book = OrderBook()
    steps = [functools.partial(book.insert, m, now=0.0) for m in all_messages]
    steps += [functools.partial(book.match, now=0.0), functools.partial(book.expire, 25.0)]
    for step in steps:
        before, count = book.snapshot(), book.changes
        step()
        assert book.snapshot() == before or book.changes > count


@settings(max_examples=150, deadline=None)
@given(messages, st.sampled_from([0.0, 10.0, 20.0, 25.0]))
def test_replacement_cancels_and_expiry_leave_exactly_the_model_live_orders(all_messages, now):
    book = build(all_messages)
    book.expire(now)
    expected = {
        (key[0], key[1], key[2], m.nonce, m.shares_free if type(m) is Offer else m.shares)
        for key, m in model_live_orders(all_messages, now).items()
    }
    assert set(book.snapshot()) == expected


@settings(max_examples=150, deadline=None)
@given(messages)
def test_match_follows_price_time_priority_like_the_model(all_messages):
    book = build(all_messages)
    assert fill_tuples(book.match(now=0.0)) == model_match(model_live_orders(all_messages, 0.0))


@settings(max_examples=150, deadline=None)
@given(messages, bids)
def test_match_bid_follows_price_time_priority_like_the_model(all_messages, incoming):
    book = build(all_messages)
    live = model_live_orders(all_messages, 0.0)
    live_offers = [m for m in live.values() if type(m) is Offer]
    remaining = {(o.host, o.offer_id): o.shares_free for o in live_offers}
    expected = model_fill(incoming, incoming.shares, remaining, live_offers)
    assert fill_tuples(book.match_bid(incoming, now=0.0)) == expected


@settings(max_examples=150, deadline=None)
@given(messages, st.sampled_from([0.0, 15.0]))
def test_matching_never_over_fills_and_honours_limits(all_messages, now):
    book = build(all_messages)
    live = model_live_orders(all_messages, now)
    fills = book.match(now=now)
    per_offer, per_bid = {}, {}
    for f in fills:
        o = live[(Side.OFFER, f.host, f.offer_id)]
        b = live[(Side.BID, f.consumer, f.bid_id)]
        assert f.price == o.price <= b.max_price
        assert b.accepts(o) and f.offer_nonce == o.nonce
        per_offer[(f.host, f.offer_id)] = per_offer.get((f.host, f.offer_id), 0) + f.shares
        per_bid[(f.consumer, f.bid_id)] = per_bid.get((f.consumer, f.bid_id), 0) + f.shares
    for (host, offer_id), filled in per_offer.items():
        o = live[(Side.OFFER, host, offer_id)]
        assert filled <= o.shares_free
        left = book.get(Side.OFFER, host, offer_id)
        assert (0 if left is None else left.remaining) == o.shares_free - filled
    for (consumer, bid_id), filled in per_bid.items():
        assert filled <= live[(Side.BID, consumer, bid_id)].shares


def test_partial_fill_leaves_the_rest_of_the_offer_resting():
    book = OrderBook()
    book.insert(offer(shares=4), now=0.0)
    [fill] = book.match_bid(bid(shares=1), now=0.0)
    assert fill.shares == 1
    assert book.get(Side.OFFER, "h0", "o").remaining == 3
    assert [f.shares for f in book.match_bid(bid(shares=5), now=0.0)] == [3]
    assert book.get(Side.OFFER, "h0", "o") is None


def test_a_bid_for_several_gpus_takes_its_shares_from_that_many_offers():
    book = OrderBook()
    for host, price in (("h0", 5), ("h1", 4), ("h2", 6)):
        book.insert(offer(host, price=price, shares=4), now=0.0)
    book.insert(offer("h3", price=1, shares=1), now=0.0)  # too few shares for one rank
    fills = book.match_bid(bid(shares=2, gpus=2), now=0.0)
    assert [(f.host, f.shares) for f in fills] == [("h1", 2), ("h0", 2)]
    assert book.get(Side.OFFER, "h3", "o").remaining == 1


def test_a_bid_for_more_gpus_than_the_book_can_seat_fills_nothing_and_takes_nothing():
    book = OrderBook()
    book.insert(offer("h0", shares=4), now=0.0)
    book.insert(offer("h1", shares=4), now=0.0)
    assert book.match_bid(bid(shares=1, gpus=3), now=0.0) == []
    assert [book.get(Side.OFFER, h, "o").remaining for h in ("h0", "h1")] == [4, 4]


def test_a_resting_bid_for_several_gpus_clears_whole_once_enough_offers_rest():
    book = OrderBook()
    book.insert(bid(shares=2, gpus=2), now=0.0)
    book.insert(offer("h0", shares=4), now=0.0)
    assert book.match(now=0.0) == []
    book.insert(offer("h1", shares=4), now=0.0)
    assert sorted(f.host for f in book.match(now=0.0)) == ["h0", "h1"]
    assert book.get(Side.BID, "c0", "b") is None


def test_cheaper_offer_fills_first_then_older_at_equal_price():
    book = OrderBook()
    book.insert(offer("h0", price=5, created=2.0), now=0.0)
    book.insert(offer("h1", price=5, created=1.0), now=0.0)
    book.insert(offer("h2", price=4, created=3.0), now=0.0)
    fills = book.match_bid(bid(shares=12), now=0.0)
    assert [f.host for f in fills] == ["h2", "h1", "h0"]


def test_a_bid_that_keeps_its_memory_on_the_device_skips_overcommitted_offers():
    book = OrderBook()
    book.insert(offer("h0", price=4, overcommit_pct=200), now=0.0)
    book.insert(offer("h1", price=5), now=0.0)
    resident = [f.host for f in book.match_bid(bid(shares=8, max_overcommit_pct=100), now=0.0)]
    assert resident == ["h1"]
    assert [f.host for f in book.match_bid(bid("c1", shares=8), now=0.0)] == ["h0"]


def test_newer_nonce_replaces_and_older_nonce_is_ignored():
    book = OrderBook()
    assert book.insert(offer(price=10, nonce=2), now=0.0) is InsertStatus.ADDED
    assert book.insert(offer(price=9, nonce=3), now=0.0) is InsertStatus.REPLACED
    assert book.insert(offer(price=1, nonce=1), now=0.0) is InsertStatus.SUPERSEDED
    assert book.insert(offer(price=9, nonce=3), now=0.0) is InsertStatus.DUPLICATE
    assert book.get(Side.OFFER, "h0", "o").order.price == 9


def test_cancel_arriving_before_its_order_still_wins():
    book = OrderBook()
    assert book.insert(Cancel("h0", Side.OFFER, "o", 100.0, 5), now=0.0) is InsertStatus.CANCELLED
    assert book.insert(offer(nonce=4), now=0.0) is InsertStatus.SUPERSEDED
    assert book.get(Side.OFFER, "h0", "o") is None


def test_expired_orders_leave_the_book_and_are_not_accepted():
    book = OrderBook()
    book.insert(offer(expires=10.0), now=0.0)
    assert book.insert(offer("h1", expires=10.0), now=10.0) is InsertStatus.EXPIRED
    assert book.match_bid(bid(), now=10.0) == []
    assert book.statistics().offers == 0
    assert book.statistics().versions == 0


def test_equivocation_resolves_the_same_way_in_any_order():
    a, b = offer(price=3, nonce=7), offer(price=4, nonce=7)
    first, second = build([a, b]), build([b, a])
    assert first.snapshot() == second.snapshot()
    assert first.get(Side.OFFER, "h0", "o").order == second.get(Side.OFFER, "h0", "o").order


def test_a_bid_never_fills_against_its_own_authors_offer():
    book = OrderBook()
    book.insert(offer("c0"), now=0.0)
    assert book.match_bid(bid("c0"), now=0.0) == []


# -- bounds ------------------------------------------------------------------------------


def test_an_author_over_its_cap_gets_no_new_orders_but_may_amend_and_cancel():
    book = OrderBook(BookLimits(max_orders_per_author=3, max_versions_per_author=8))
    for i in range(3):
        assert book.insert(offer(offer_id=f"o{i}", nonce=i + 1), now=0.0) is InsertStatus.ADDED
    assert book.insert(offer(offer_id="o3", nonce=9), now=0.0) is InsertStatus.OVER_AUTHOR_CAP
    assert book.insert(offer(offer_id="o0", price=1, nonce=10), now=0.0) is InsertStatus.REPLACED
    assert book.insert(Cancel("h0", Side.OFFER, "o1", 100.0, 11), now=0.0).changed_book
    assert book.insert(offer(offer_id="o3", nonce=12), now=0.0) is InsertStatus.ADDED
    assert book.live_orders_of("h0") == 3
    # Other authors and the other side have their own caps.
    assert book.insert(offer("h1", offer_id="o9"), now=0.0) is InsertStatus.ADDED
    assert book.insert(bid("h0", "b9"), now=0.0) is InsertStatus.ADDED
    assert book.statistics().most_per_author == 3


def test_a_flood_of_cancels_for_unseen_orders_is_bounded_too():
    book = OrderBook(BookLimits(max_orders_per_author=2, max_versions_per_author=4))
    results = [
        book.insert(Cancel("h0", Side.OFFER, f"x{i}", 100.0, i + 1), now=0.0) for i in range(10)
    ]
    assert results.count(InsertStatus.CANCELLED) == 4
    assert book.statistics().versions == 4
    # Versions are forgotten when they expire, and the author may write again.
    book.expire(100.0)
    assert book.insert(offer(expires=200.0, nonce=50), now=100.0) is InsertStatus.ADDED


def test_a_full_book_evicts_the_biggest_newcomer_and_never_a_vouched_author():
    book = OrderBook(BookLimits(max_orders_per_author=4, max_versions_per_author=8, max_orders=6))
    book.vouch("honest")
    book.insert(offer("honest", "g0", price=50), now=0.0)
    for i in range(4):
        book.insert(offer("spam", f"s{i}", price=1, nonce=i + 1), now=0.0)
    book.insert(offer("new", "n0", price=40), now=0.0)
    assert book.statistics().offers == 6
    # A second newcomer order pushes out the spammer's, which holds the most.
    assert book.insert(offer("new2", "n0", price=45), now=0.0) is InsertStatus.ADDED
    assert book.live_orders_of("spam") == 3
    # A vouched author's new order pushes out a newcomer's, the biggest first.
    assert book.insert(offer("honest", "g1", price=50, nonce=2), now=0.0) is InsertStatus.ADDED
    assert book.live_orders_of("spam") == 2
    # The spammer cannot push out anyone holding fewer than it would.
    assert book.insert(offer("spam", "s9", price=1, nonce=9), now=0.0) is InsertStatus.BOOK_FULL
    assert book.live_orders_of("honest") == 2
    assert book.statistics().evicted == 2


def test_a_newcomer_never_evicts_vouched_authors():
    book = OrderBook(BookLimits(max_orders_per_author=4, max_versions_per_author=8, max_orders=4))
    book.vouch("a")
    for i in range(4):
        book.insert(offer("a", f"o{i}", nonce=i + 1), now=0.0)
    assert book.insert(offer("spam", "s0"), now=0.0) is InsertStatus.BOOK_FULL
    assert book.live_orders_of("a") == 4


CONTEND = PriorityClass.CONTEND


def test_a_contending_bid_pays_the_contend_price_whatever_its_limit_above_it():
    book = OrderBook()
    book.insert(offer("h0", price=50, contend_price=20, shares=8), now=0.0)
    (low,) = book.match_bid(bid(max_price=30, priority=CONTEND), now=1.0)
    (high,) = book.match_bid(bid("c1", max_price=90, priority=CONTEND), now=1.0)
    assert (low.host, low.price, low.priority) == ("h0", 20, CONTEND)
    assert high.price == 20


def test_a_contending_bid_takes_only_offers_that_sell_contending_leases_cheapest_first():
    book = OrderBook()
    book.insert(offer("h0", price=50, contend_price=30), now=0.0)
    book.insert(offer("h1", price=25), now=0.0)  # sells no contending leases
    book.insert(offer("h2", price=90, contend_price=20), now=0.0)
    fills = book.match_bid(bid(max_price=60, shares=12, priority=CONTEND), now=1.0)
    assert [(f.host, f.price) for f in fills] == [("h2", 20), ("h0", 30)]


def test_contending_fills_draw_on_the_contending_pool_and_leave_the_on_demand_shares():
    book = OrderBook()
    book.insert(offer("h0", price=50, contend_price=20, shares=2, contend_shares=3), now=0.0)
    contending = book.match_bid(bid(max_price=30, shares=5, priority=CONTEND), now=1.0)
    assert [f.shares for f in contending] == [3]
    on_demand = book.match_bid(bid("c1", max_price=50, shares=5), now=1.0)
    assert [f.shares for f in on_demand] == [2]
    assert list(book.offers()) == []  # both pools are empty: the offer left


def test_an_offer_with_only_contending_shares_left_serves_no_on_demand_bid():
    book = OrderBook()
    book.insert(offer("h0", price=50, contend_price=20, shares=0, contend_shares=2), now=0.0)
    assert book.match_bid(bid(max_price=50), now=1.0) == []
    assert [f.shares for f in book.match_bid(bid(max_price=20, priority=CONTEND), now=1.0)] == [1]


def test_a_bid_under_every_floor_or_not_contending_fills_nothing_below_the_ask():
    book = OrderBook()
    book.insert(offer("h0", price=50, contend_price=20), now=0.0)
    book.insert(offer("h1", price=60), now=0.0)  # sells no contending leases
    assert book.match_bid(bid(max_price=19, priority=CONTEND), now=1.0) == []
    assert book.match_bid(bid(max_price=30), now=1.0) == []  # on demand: the ask or nothing
    assert [f.host for f in book.match_bid(bid(max_price=59, priority=CONTEND), now=1.0)] == ["h0"]


def test_an_offer_leaving_the_book_leaves_its_contend_floor_too():
    book = OrderBook()
    book.insert(offer("h0", price=50, contend_price=20, expires=10.0), now=0.0)
    assert book.match_bid(bid(max_price=30, priority=CONTEND), now=11.0) == []
