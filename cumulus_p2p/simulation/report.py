"""A scenario's results as files: ``<name>.json``, ``<name>.md`` and PNG plots."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402


def write(result: dict, out_dir: Path) -> list[Path]:
    """Write the JSON, the plots and the markdown report; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    name = result["scenario"] + ("_quick" if result["quick"] else "")
    paths = [out_dir / f"{name}.json"]
    paths[0].write_text(json.dumps(result, indent=2) + "\n")
    figure, markdown = _RENDERERS[result["scenario"]](result)
    png = out_dir / f"{name}.png"
    figure.savefig(png, dpi=110, bbox_inches="tight")
    plt.close(figure)
    report = out_dir / f"{name}.md"
    report.write_text(markdown + f"\n![{result['scenario']}]({png.name})\n")
    return [*paths, png, report]


def _table(header: Iterable[str], rows: Iterable[Iterable]) -> str:
    header = list(header)
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join("–" if v is None else str(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _columns(rows: Iterable[dict], columns: Iterable[tuple[str, str]]) -> str:
    """A table of ``rows`` with a column per ``(header, key)`` pair, ``row[key]`` in it."""
    columns = list(columns)
    return _table([h for h, _ in columns], [[r[k] for _, k in columns] for r in rows])


def _heading(result: dict, title: str) -> str:
    size = "quick" if result["quick"] else "full"
    source = f"{result['scenario']}{'_quick' if result['quick'] else ''}.json"
    return f"# {title}\n\nSeed {result['seed']}, {size} run; figures from `{source}`.\n"


def _pooling(result: dict):
    rows = result["rows"]
    claimed = result["claimed_whole_gpu_utilization"]
    sat = {(r["mix"], r["policy"]): r for r in rows if r["load"] == "saturated"}
    mod = [r for r in rows if r["load"] == "moderate"]
    mixes = list(dict.fromkeys(r["mix"] for r in rows))
    util = _table(
        ["mix", "claimed whole-GPU", "whole-GPU", "pooled", "pooled slowdown"],
        [
            (
                m,
                claimed.get(m),
                sat[(m, "whole-GPU")]["utilization"],
                sat[(m, "pooled")]["utilization"],
                sat[(m, "pooled")]["slowdown_mean"],
            )
            for m in mixes
        ],
    )
    money = _columns(
        mod,
        (
            ("mix", "mix"),
            ("policy", "policy"),
            ("queue wait mean s", "queue_wait_mean_s"),
            ("p95 s", "queue_wait_p95_s"),
            ("slowdown", "slowdown_mean"),
            ("cost / compute-h", "cost_per_compute_hour"),
            ("host earnings / GPU-h", "host_earnings_per_gpu_hour"),
        ),
    )
    paged = {r["mix"] for r in rows if r["overcommit"] > 1}
    overcommit = _columns(
        [r for r in rows if r["mix"] in paged and r["policy"] != "whole-GPU"],
        (
            ("mix", "mix"),
            ("load", "load"),
            ("overcommit", "overcommit"),
            ("utilization", "utilization"),
            ("slowdown", "slowdown_mean"),
            ("paging share", "paging_share"),
            ("page-ins", "page_ins"),
            ("jobs done", "jobs_done"),
        ),
    )
    text = (
        _heading(result, "Fractional pooling against whole-GPU allocation")
        + f"\n{result['hosts']} hosts, {result['horizon_h']} h.\n\n"
        + "## GPU utilization, saturated load\n\n"
        + util
        + "\n\n## Queueing, cost and earnings, moderate load\n\n"
        + money
        + "\n\n## Overcommitted memory (pooled at 1.0, 1.5 and 2x)\n\n"
        + overcommit
        + "\n"
    )
    fig, ax = plt.subplots(figsize=(7, 3.5))
    xs = range(len(mixes))
    for offset, policy in ((-0.2, "whole-GPU"), (0.2, "pooled")):
        ax.bar(
            [x + offset for x in xs],
            [sat[(m, policy)]["utilization"] for m in mixes],
            width=0.4,
            label=policy,
        )
    claimed_x = [x for x, m in zip(xs, mixes, strict=True) if m in claimed]
    ax.scatter(
        claimed_x,
        [claimed[m] for m in mixes if m in claimed],
        marker="_",
        s=600,
        color="black",
        label="hosted.ai whole-GPU figure",
        zorder=3,
    )
    ax.set_xticks(list(xs), mixes)
    ax.set_ylabel("GPU utilization")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8)
    ax.set_title("Utilization under saturated demand")
    return fig, text


def _priority(result: dict):
    rows = result["rows"]
    text = (
        _heading(result, "Price against priority")
        + f"\n{result['hosts']} hosts, {result['horizon_h']} h. Interruptible saving (1 - "
        f"interruptible price / on-demand price): {result['interruptible_saving']}; claimed: "
        f"{result['claimed_interruptible_saving']}.\n\n"
        f"Contending leases (hosts sell them beyond their on-demand shares at "
        f"{result['contend_floor']} of their ask): saving {result['contending_saving']} "
        f"(target at least 0.5; paying their bids instead: "
        f"{result['contending_saving_pay_as_bid']}); on-demand slowdown beside them over "
        f"alone {result['on_demand_slowdown_ratio']} (at most 1.1); bids at 0.8x the median "
        f"leased within 1 h {result['leased_within_1h_at_0_8']} (at least 0.9); utilization "
        f"{result['mix_utilization']} (at least 0.85); host earnings over whole-GPU rental "
        f"{result['host_earnings_over_whole_gpu']} (at least 1; whole GPUs leased "
        f"{result['whole_gpu_leased_share']} of the jobs).\n\n"
        + _columns(
            rows,
            (
                ("strategy", "strategy"),
                ("class", "class"),
                ("bid / median", "bid_multiple"),
                ("jobs", "jobs"),
                ("leased", "leased_share"),
                ("wait mean s", "wait_mean_s"),
                ("slowdown", "slowdown_mean"),
                ("paid / median", "paid_vs_median"),
            ),
        )
        + "\n"
    )
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for (strategy, cls), style in _series(rows, ("strategy", "class")):
        mine = [r for r in rows if (r["strategy"], r["class"]) == (strategy, cls)]
        xs = [r["bid_multiple"] for r in mine]
        label = f"{strategy}, {cls}"
        axes[0].plot(xs, [r["slowdown_mean"] for r in mine], style, label=label)
        axes[1].plot(xs, [r["leased_share"] for r in mine], style, label=label)
    axes[0].set_ylabel("slowdown (x alone)")
    axes[1].set_ylabel("share of jobs that got a lease")
    for ax in axes:
        ax.set_xlabel("bid / median share price")
    axes[0].legend(fontsize=7)
    return fig, text


def _series(rows: list[dict], keys: tuple[str, ...]):
    seen = list(dict.fromkeys(tuple(r[k] for k in keys) for r in rows))
    styles = ["o-", "s--", "^-", "d--", "v-", "x--"]
    return [(key, styles[i % len(styles)]) for i, key in enumerate(seen)]


def _churn(result: dict):
    rows, sweep = result["rows"], result["interval_sweep_at_10_percent"]
    text = (
        _heading(result, "Churn with and without failover")
        + f"\n{result['hosts']} hosts, {result['horizon_h']} h, checkpoints of "
        f"{result['state_mb']:g} MB every {result['checkpoint_interval_s']:g} s with failover.\n\n"
        + _columns(
            rows,
            (
                ("churn / h", "churn_per_hour"),
                ("failover", "failover"),
                ("jobs", "jobs"),
                ("completed", "completion_rate"),
                ("lost GPU-h", "lost_gpu_hours"),
                ("checkpoint h", "checkpoint_hours"),
                ("failovers", "failovers"),
                ("restarts", "restarts"),
                ("cost", "cost"),
            ),
        )
        + "\n\n## Checkpoint interval at 10% churn per hour\n\n"
        + _table(
            ["interval s", "completed", "lost GPU-h", "checkpoint h", "lost + checkpoint"],
            [
                (
                    r["interval_s"],
                    r["completion_rate"],
                    r["lost_gpu_hours"],
                    r["checkpoint_hours"],
                    round(r["lost_gpu_hours"] + r["checkpoint_hours"], 3),
                )
                for r in sweep
            ],
        )
        + "\n\n## Small pools: set aside with a backoff, or excluded for the job\n\n"
        + _columns(
            result.get("small_pools", []),
            (
                ("hosts", "hosts"),
                ("churn / h", "churn_per_hour"),
                ("policy", "policy"),
                ("jobs", "jobs"),
                ("completed", "completion_rate"),
                ("gave up", "gave_up"),
                ("failovers", "failovers"),
                ("held h", "held_hours"),
                ("held h per job failed over", "held_hours_per_job_failed_over"),
            ),
        )
        + "\n\n## Jobs of N GPUs, data parallel, under churn\n\n"
        + _columns(
            result.get("gangs", []),
            (
                ("GPUs", "gpus"),
                ("churn / h", "churn_per_hour"),
                ("jobs", "jobs"),
                ("completed", "completion_rate"),
                ("failovers per job", "failovers_per_job"),
                ("lost GPU-h", "lost_gpu_hours"),
                ("lost share", "lost_share"),
                ("useful GPU-h", "useful_gpu_hours"),
            ),
        )
        + "\n"
    )
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for failover, style in ((True, "o-"), (False, "s--")):
        mine = [r for r in rows if r["failover"] == failover]
        axes[0].plot(
            [r["churn_per_hour"] * 100 for r in mine],
            [r["completion_rate"] for r in mine],
            style,
            label="failover" if failover else "restart",
        )
    axes[0].set_xlabel("hosts leaving per hour (%)")
    axes[0].set_ylabel("jobs completed")
    axes[0].legend()
    xs = [r["interval_s"] for r in sweep]
    axes[1].plot(xs, [r["lost_gpu_hours"] for r in sweep], "o-", label="lost work")
    axes[1].plot(xs, [r["checkpoint_hours"] for r in sweep], "s--", label="writing checkpoints")
    axes[1].set_xscale("log")
    axes[1].set_xlabel("checkpoint interval (s)")
    axes[1].set_ylabel("GPU-hours")
    axes[1].legend()
    return fig, text


def _scale(result: dict):
    rows = result["rows"]
    text = (
        _heading(result, "Market load per node against network size")
        + f"\nAssumed rates: {result['assumed']}.\n\n"
        + _columns(
            rows,
            (
                ("nodes", "nodes"),
                ("orders held", "orders_in_book"),
                ("intake µs / msg", "intake_us_per_message"),
                ("rank ms (p50)", "rank_ms_p50"),
                ("book MB", "book_memory_mb"),
                ("msgs / s", "messages_per_s"),
                ("CPU share of a core", "cpu_share_of_one_core"),
                ("gossip kB / s", "gossip_kb_per_s"),
            ),
        )
        + "\n"
    )
    fig, ax = plt.subplots(figsize=(7, 3.5))
    xs = [r["nodes"] for r in rows]
    for key, label in (
        ("book_memory_mb", "book MB"),
        ("gossip_kb_per_s", "gossip kB/s"),
        ("rank_ms_p50", "rank ms per bid"),
    ):
        ax.plot(xs, [r[key] for r in rows], "o-", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("nodes in the network")
    ax.legend()
    return fig, text


def _attacks(result: dict):
    rows = result["rows"]
    text = (
        _heading(result, "Attacks on reputation")
        + f"\nPopulation: {result['size']}. Ranks among all hosts, 1 best; earnings from an "
        "hour of demand for as many shares as the honest hosts have, matched by the node's "
        "scores, against the same history without attack.\n\n"
        + _columns(
            rows,
            (
                ("attack", "attack"),
                ("reports accepted", "reports_accepted"),
                ("worst honest rank", "worst_honest_rank"),
                ("best attacker rank", "best_bad_host_rank"),
                ("victim rank", "victim_rank"),
                ("honest earnings lost", "honest_earnings_lost"),
                ("attackers' share of earnings", "bad_host_earnings_share"),
            ),
        )
        + "\n"
    )
    payers = next((r for r in rows if "non_payer_score_mean" in r), None)
    if payers is not None:
        text += (
            f"\nNon-payers: payment score {payers['non_payer_score_mean']} against "
            f"{payers['honest_consumer_score_mean']} for honest consumers; a host with "
            f"`--min-consumer-score 0.3` refuses {payers['non_payers_refused']:.0%} of the "
            f"non-payers and {payers['honest_consumers_refused']:.0%} of the honest.\n"
        )
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [r["attack"] for r in rows]
    ax.bar(names, [r["worst_honest_rank"] for r in rows], label="worst honest rank")
    ax.scatter(
        names,
        [r["best_bad_host_rank"] or float("nan") for r in rows],
        color="red",
        zorder=3,
        label="best attacker rank",
    )
    ax.set_ylabel("rank (1 = best)")
    ax.legend(fontsize=8)
    return fig, text


_RENDERERS: dict[str, Callable] = {
    "attacks": _attacks,
    "pooling": _pooling,
    "priority": _priority,
    "churn": _churn,
    "scale": _scale,
}
