"""The network simulations: quick runs of every scenario, on the real market cores."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cumulus_p2p.market import matcher
from cumulus_p2p.market.lease import RefusalReason
from cumulus_p2p.simulation import attacks, churn, gangs, pooling, priority
from cumulus_p2p.simulation.cli import SCENARIOS, main
from cumulus_p2p.simulation.world import WORKLOADS
from cumulus_p2p.testing.nodes import REFERENCE_RUNS
from cumulus_p2p.testing.once import once

# Runs whole simulated scenarios: scripts/test --fast skips it.
pytestmark = pytest.mark.slow

MIX = WORKLOADS


def quick_run(scenario: str) -> Path:
    """The directory where ``scenario``'s quick run (seed 1), through the command line the
    scripts use, wrote its files: run once per test session, for every spec that reads it
    (the priority scenario alone simulates six markets)."""
    out = Path(os.environ[REFERENCE_RUNS]) / f"simulation-{scenario}"

    def write() -> Path:
        main(scenario, ["--quick", "--seed", "1", "--out", str(out)])
        return out

    return once(f"{scenario}-quick-seed-1", write)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_each_quick_scenario_writes_its_json_plot_and_report(scenario):
    out = quick_run(scenario)
    result = json.loads((out / f"{scenario}_quick.json").read_text())
    assert result["scenario"] == scenario and result["seed"] == 1 and result["rows"]
    assert (out / f"{scenario}_quick.png").stat().st_size > 10_000
    report = (out / f"{scenario}_quick.md").read_text()
    assert report.startswith("# ") and f"({scenario}_quick.png)" in report


def test_a_quick_scenario_repeats_exactly_from_its_seed():
    # Against the run the scripts' command line wrote, maybe in another process.
    written = json.loads((quick_run("churn") / "churn_quick.json").read_text())
    del written["runtime_s"]
    assert json.loads(json.dumps(churn.run(1, quick=True))) == written


def _gang_run(gpus: int, churn_per_hour: float) -> dict:
    return churn.simulate(1, churn_per_hour, 300.0, hosts=32, horizon_h=36.0, quick=True, gpus=gpus)


def test_jobs_of_four_gpus_all_finish_and_lose_nothing_without_churn():
    row = _gang_run(4, 0.0)
    assert row["jobs"] > 0 and row["completion_rate"] == 1.0
    assert row["failovers"] == 0 and row["lost_gpu_hours"] == 0.0


def test_a_job_of_eight_gpus_fails_over_far_more_often_than_one_of_one_under_churn():
    one, eight = _gang_run(1, 0.1), _gang_run(8, 0.1)
    # Any of its eight hosts lost sends every rank back to the checkpoint.
    assert eight["failovers"] / eight["jobs"] > 3 * one["failovers"] / one["jobs"]
    assert eight["lost_gpu_hours"] / eight["useful_gpu_hours"] > (
        one["lost_gpu_hours"] / one["useful_gpu_hours"]
    )


def test_an_all_reduce_costs_nothing_alone_and_more_with_each_rank_and_each_ms():
    assert gangs.allreduce_s(1, 100.0) == 0.0
    assert 0 < gangs.allreduce_s(2, 1.0) < gangs.allreduce_s(8, 1.0) < gangs.allreduce_s(8, 80.0)


def _pooled_mix(seed: int = 1) -> dict:
    return pooling.simulate(seed, MIX, "pooled", pooling.LOADS["moderate"], hosts=8, horizon_h=4)


def test_changing_the_matchers_ranking_changes_what_consumers_pay(monkeypatch):
    cheapest_first = _pooled_mix()
    monkeypatch.setattr(matcher, "effective_price", lambda price, **_: -price)
    dearest_first = _pooled_mix()
    assert dearest_first["cost_per_compute_hour"] > cheapest_first["cost_per_compute_hour"]


def test_hosts_refuse_stale_offers_through_their_lease_books():
    saturated = pooling.simulate(
        1, MIX, "whole-GPU", pooling.LOADS["saturated"], hosts=8, horizon_h=3
    )
    assert saturated["refusals"].get(RefusalReason.NO_CAPACITY.value, 0) > 0


def test_pooling_lifts_utilization_over_whole_gpu_allocation():
    saturated = pooling.LOADS["saturated"]
    whole = pooling.simulate(1, MIX, "whole-GPU", saturated, hosts=8, horizon_h=4)
    pooled = pooling.simulate(1, MIX, "pooled", saturated, hosts=8, horizon_h=4)
    assert pooled["utilization"] > whole["utilization"] + 0.2


def test_overcommitted_hosts_page_memory_and_their_tenants_pay_it_in_slowdown():
    saturated = pooling.LOADS["saturated"]
    plain = pooling.simulate(1, MIX, "pooled", saturated, hosts=8, horizon_h=3)
    doubled = pooling.simulate(1, MIX, "pooled-2x", saturated, hosts=8, horizon_h=3)
    assert (plain["page_ins"], doubled["overcommit"]) == (0, 2.0)
    assert doubled["page_ins"] > 0 and doubled["paging_share"] > 0
    assert doubled["slowdown_mean"] > plain["slowdown_mean"]


def test_failover_finishes_more_jobs_and_loses_less_work_than_restarting():
    with_failover = churn.simulate(1, 0.2, 300.0, hosts=16, horizon_h=24, quick=True)
    restarting = churn.simulate(1, 0.2, None, hosts=16, horizon_h=24, quick=True)
    assert with_failover["completion_rate"] > restarting["completion_rate"]
    assert with_failover["lost_gpu_hours"] < restarting["lost_gpu_hours"] / 10
    assert with_failover["failovers"] > 0 and restarting["restarts"] > 0


@pytest.fixture(scope="module")
def quick_priority():
    """The priority scenario's quick run, as its script wrote it."""
    return json.loads((quick_run("priority") / "priority_quick.json").read_text())


def test_interruptible_tenants_wait_behind_on_demand_ones_on_the_device(quick_priority):
    result = quick_priority
    slowdowns = {
        cls: [
            r["slowdown_mean"]
            for r in result["rows"]
            if r["class"] == cls and r["slowdown_mean"] is not None
        ]
        for cls in priority.CLASSES
    }
    assert min(slowdowns["interruptible"]) > 1.0
    assert sum(slowdowns["interruptible"]) / len(slowdowns["interruptible"]) > sum(
        slowdowns["on-demand"]
    ) / len(slowdowns["on-demand"])


def test_no_attack_lifts_an_attacker_above_an_honest_host_or_costs_them_earnings():
    rows = {r["attack"]: r for r in attacks.run(2, quick=True)["rows"]}
    for attack in ("sybil ring", "hardware liars"):
        assert rows[attack]["best_bad_host_rank"] > rows[attack]["worst_honest_rank"]
        assert rows[attack]["bad_host_earnings_share"] == 0.0
    assert rows["smear crowd"]["victim_rank"] == rows["none"]["victim_rank"]
    assert all(r["honest_earnings_lost"] == 0.0 for r in rows.values())


def test_non_payers_fall_below_a_hosts_bar_and_honest_consumers_do_not():
    row = attacks.simulate(2, "non-payers", honest=8, flaky=3, consumers=16, leases=200, sybils=10)
    assert row["non_payers_refused"] == 1.0 and row["honest_consumers_refused"] == 0.0


def test_contending_bids_below_the_ask_lease_where_interruptible_ones_cannot(quick_priority):
    result = quick_priority
    leased = {
        (r["strategy"], r["class"]): r["leased_share"]
        for r in result["rows"]
        if r["bid_multiple"] == 0.6
    }
    assert leased[("contend", "contend")] > leased[("ask", "interruptible")]
    assert result["leased_within_1h_at_0_8"] is not None and 0 < result["mix_utilization"] <= 1
