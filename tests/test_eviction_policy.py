"""Whose memory leaves the device when room is needed (``host/eviction.py``, sans-IO)."""

from __future__ import annotations

from cumulus_p2p.host.eviction import Candidate, Move, Tier, choose, destination, enough, plan
from cumulus_p2p.host.scheduler import lease_rank, on_demand

NOW = 1000.0
ON_DEMAND, DEAR_ON_DEMAND = lease_rank(True, 100), lease_rank(True, 900)
INTERRUPTIBLE, CHEAP_INTERRUPTIBLE = lease_rank(False, 100), lease_rank(False, 50)


def tenant(key, rank=ON_DEMAND, *, nbytes=100, ago=1.0, **standing) -> Candidate:
    return Candidate(key, rank, on_demand(rank), nbytes, NOW - ago, **standing)


def test_the_unpaid_go_first_then_the_preempted_then_the_idle():
    tenants = [
        tenant("idle", ago=600),
        tenant("preempted", INTERRUPTIBLE, preempted=True),
        tenant("busy"),
        tenant("unpaid", unpaid=True),
    ]
    assert choose(tenants, 300, now=NOW) == ["unpaid", "preempted", "idle"]


def test_among_the_idle_the_longest_idle_goes_first():
    tenants = [tenant("a", ago=100), tenant("b", ago=900), tenant("c", ago=300)]
    assert choose(tenants, 200, now=NOW) == ["b", "c"]


def test_then_the_least_recently_used_of_the_worst_ranked_payers():
    tenants = [
        tenant("dear", DEAR_ON_DEMAND, ago=30),
        tenant("on-demand", ON_DEMAND, ago=5),
        tenant("interruptible, recent", INTERRUPTIBLE, ago=1),
        tenant("interruptible, older", INTERRUPTIBLE, ago=20),
        tenant("cheapest", CHEAP_INTERRUPTIBLE, ago=2),
    ]
    assert choose(tenants, 500, now=NOW) == [
        "cheapest",
        "interruptible, older",
        "interruptible, recent",
        "on-demand",
        "dear",
    ]


def test_an_on_demand_session_in_its_turn_is_never_evicted_even_unpaid():
    tenants = [tenant("running", unpaid=True, in_turn=True), tenant("other", ago=600)]
    assert choose(tenants, 100, now=NOW) == ["other"]
    assert choose(tenants, 200, now=NOW) == []  # the room cannot be made without it


def test_an_interruptible_session_in_its_turn_may_be_evicted():
    tenants = [tenant("running", INTERRUPTIBLE, in_turn=True)]
    assert choose(tenants, 100, now=NOW) == ["running"]


def test_only_as_many_as_the_room_needs_and_none_when_none_is_needed():
    tenants = [tenant("a", ago=900, nbytes=400), tenant("b", ago=800)]
    assert choose(tenants, 300, now=NOW) == ["a"]
    assert choose(tenants, 0, now=NOW) == []


def test_sessions_already_off_the_device_free_nothing_and_are_skipped():
    tenants = [tenant("evicted", unpaid=True, nbytes=0), tenant("idle", ago=600)]
    assert choose(tenants, 100, now=NOW) == ["idle"]


def test_when_every_candidate_together_falls_short_none_is_evicted():
    assert choose([tenant("a", unpaid=True), tenant("b", ago=600)], 1_000, now=NOW) == []


# --- where they go ---------------------------------------------------------------------


def test_off_a_gpu_a_session_goes_to_host_memory_while_the_ram_tier_has_room():
    assert destination(100, device_is_host=False, ram_free=100, disk=True) is Tier.RAM
    assert destination(100, device_is_host=False, ram_free=None, disk=False) is Tier.RAM


def test_past_the_ram_tiers_room_it_goes_to_disk_or_stays_without_one():
    assert destination(101, device_is_host=False, ram_free=100, disk=True) is Tier.DISK
    assert destination(101, device_is_host=False, ram_free=100, disk=False) is None


def test_where_the_device_is_host_memory_a_session_goes_to_disk_or_stays():
    assert destination(1, device_is_host=True, ram_free=None, disk=True) is Tier.DISK
    assert destination(1, device_is_host=True, ram_free=None, disk=False) is None


def test_a_plan_asks_each_session_for_what_is_still_needed_filling_host_memory_first():
    tenants = [tenant("idle", nbytes=400, ago=600), tenant("older", ago=20, nbytes=600)]
    moves = plan(tenants, 700, now=NOW, device_is_host=False, ram_free=500, disk=True)
    # The idle one's 400 fit in host memory; the 300 still needed do not fit the 100 left.
    assert moves == [Move("idle", Tier.RAM, 700), Move("older", Tier.DISK, 300)]


def test_a_plan_stops_at_the_first_session_with_nowhere_to_go():
    tenants = [tenant("idle", nbytes=400, ago=600), tenant("older", ago=20, nbytes=600)]
    moves = plan(tenants, 700, now=NOW, device_is_host=False, ram_free=500, disk=False)
    assert moves == [Move("idle", Tier.RAM, 700)]


def test_within_a_session_storages_go_in_order_until_the_bytes_asked_for_are_off():
    sizes = [("cold", 4), ("warm", 4), ("hot", 4)]
    assert enough(sizes, 5) == ["cold", "warm"]
    assert enough(sizes, 4) == ["cold"]


def test_within_a_session_all_storages_go_when_none_is_asked_or_together_they_fall_short():
    sizes = [("cold", 4), ("warm", 4)]
    assert enough(sizes, None) == ["cold", "warm"]
    assert enough(sizes, 100) == ["cold", "warm"]
