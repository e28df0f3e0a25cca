"""The tables people read: a node's status, peers, offers and ledger (``rich``).

Each function takes plain data (the ``state.json`` a running node writes, or ledger
entries) and returns a ``rich`` renderable, so the CLI, the live display and the tests
share them.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from rich.console import Group
from rich.filesize import decimal as _bytes
from rich.table import Table

from ..market.ledger import Dispute, LedgerEntry
from ..wire.links import PLAIN, TLS

#: How a job's hosts link to each other, as its status says it.
_LINKS = {
    TLS: "between its hosts, over TLS 1.3 keyed by the job's secret",
    PLAIN: "between its hosts, [yellow]over plain TCP: not encrypted[/yellow]",
}


def credits(micro: int) -> str:
    """Micro-credits as credits, e.g. ``0.001250``."""
    return f"{micro / 1e6:.6f}"


def short(peer_id: str) -> str:
    """A peer ID shortened for a table cell."""
    return peer_id if len(peer_id) <= 16 else f"{peer_id[:6]}…{peer_id[-6:]}"


def _device_text(device: dict) -> str:
    """One offered device: model, speed, shares free, load and health."""
    text = (
        f"{device['model']} ({device['perf_units']} perf units): "
        f"{device['shares_free']} shares free, {device['sessions']} session(s)"
    )
    if device.get("gpu_utilization") is not None:
        text += f", {device['gpu_utilization']}% busy"
    if device.get("health", "ok") != "ok":
        text += f", [red]unhealthy: {device['health']}[/red]"
    return text


def status_table(state: dict) -> Group:
    """The node's summary and its leases."""
    summary = Table(title=f"cumulus node ({state.get('role', '?')})", show_header=False)
    summary.add_column("field", style="bold")
    summary.add_column("value")
    summary.add_row("peer id", state.get("peer_id", ""))
    for addr in state.get("addrs", [])[:2]:
        summary.add_row("listening", addr)
    if state.get("role") == "provider":
        for device in state.get("devices", []):
            summary.add_row(f"device {device['device']}", _device_text(device))
        summary.add_row("session channel", state.get("session_endpoint", ""))
        summary.add_row("price", f"{credits(state['price'])} per share-hour")
        shares = f"{state['shares_free']} of {state['shares_total']}"
        if state.get("overcommit", 1.0) > 1.0:
            shares += f" ({state['overcommit']:g}x the memory: idle tenants paged out)"
        summary.add_row("shares free", shares)
        if state.get("storage_gib_total"):
            summary.add_row(
                "standby storage",
                f"{state['storage_gib_free']} GiB free of {state['storage_gib_total']}, "
                f"{credits(state['storage_price'])} per GiB-hour",
            )
        summary.add_row("sessions", f"{state['sessions']} ({state.get('isolation', '?')})")
        for worker in state.get("session_workers", []):
            carried = f"{worker['bytes'] / 1e6:.1f} MB carried"
            summary.add_row("session worker", f"pid {worker['pid']}: {carried}")
        health = state.get("device_health", "ok")
        summary.add_row("device health", health if health == "ok" else f"[red]{health}[/red]")
        summary.add_row("earned", credits(state["earned"]))
    else:
        summary.add_row("status", state.get("status", ""))
        if state.get("standing"):
            summary.add_row("bid", _standing(state["standing"]))
        summary.add_row("command", " ".join(state.get("command", [])))
        live = [row for row in state.get("leases", []) if row.get("state") == "held"]
        if live and live[-1].get("path"):
            summary.add_row("session path", live[-1]["path"])
        if state.get("collectives_through_consumer"):
            why = "a host takes no connections from other hosts"
            summary.add_row("collectives", f"[yellow]through this machine[/yellow] ({why})")
        elif state.get("peer_links"):
            links = state["peer_links"]
            summary.add_row("collectives", _LINKS.get(links, links))
        summary.add_row("ops sent", f"{state.get('ops', 0):,}")
        if state.get("transfer"):
            summary.add_row("transfer", _transfer(state["transfer"]))
        summary.add_row("failovers", str(state.get("failovers", 0)))
        summary.add_row("cost", credits(state.get("cost", 0)))
    summary.add_row("peers", str(len(state.get("peers", []))))
    summary.add_row("offers known", str(len(state.get("offers", []))))
    age = time.time() - state.get("updated", 0)
    summary.add_row("updated", f"{age:.0f}s ago")
    return Group(summary, leases_table(state.get("leases", []), state.get("role", "")))


def leases_table(rows: Iterable[dict], role: str) -> Table:
    """One row per lease: who, price, receipts, share-seconds, bytes, money, and its
    session at work (a provider's: op rate and memory; a consumer's: the path)."""
    table = Table(title="leases")
    other = "consumer" if role == "provider" else "host"
    money = "earned" if role == "provider" else "cost"
    rows = list(rows)
    # A job of several GPUs: which rank each lease serves.
    ranked = any("rank" in row for row in rows)
    columns = ("lease", other, "price/share-h", "receipts", "share-s", "bytes", money, "state")
    for column in (*(["rank"] if ranked else []), *columns, "session"):
        table.add_column(column)
    for row in rows:
        table.add_row(
            *([str(row.get("rank", ""))] if ranked else []),
            row["lease_id"][:12],
            short(row.get(other, "")),
            credits(row["price"]),
            str(row["receipts"]),
            str(row["share_seconds"]),
            _bytes(row.get("bytes", 0)),
            credits(row.get(money, 0)),
            row["state"],
            _session(row),
        )
    return table


def _standing(where: dict) -> str:
    """Where a waiting job's bid stands, and what would lease it now."""
    ahead = f"{where['bids_ahead']} bid(s) ahead of it"
    price = where["run_now_price"]
    if price is None:
        return f"{ahead}; no offer meets its other needs (VRAM, model, performance, shares)"
    return (
        f"{ahead}; a lease now costs {credits(price)} per share-hour (its limit: "
        f"{credits(where['max_price'])}, --max-price)"
    )


def _transfer(transfer: dict) -> str:
    """A long transfer's progress, as the shim's console line says it."""
    done, total, seconds = transfer["done"], transfer["total"], transfer["s"]
    percent = 100 * done / total if total else 100
    rate = f", {done / seconds / 1e6:.1f} MB/s" if seconds > 0 else ""
    return (
        f"{transfer['what']}: {done / 2**20:.0f} of {total / 2**20:.0f} MiB "
        f"({percent:.0f}%){rate}, {seconds:.0f} s"
    )


def _session(row: dict) -> str:
    # A provider's lease names the offer (its device) the session runs on.
    on = f"{row['offer_id']}: " if "offer_id" in row else ""
    if "ops" in row:
        memory = f"{_bytes(row['memory'])} of {_bytes(row['quota'])}"
        tier = row.get("tier", "device")
        if tier != "device":  # paged out to make room (``host/eviction.py``)
            where = "host RAM" if tier == "ram" else "disk"
            off = row["memory"] - row.get("on_device", 0)
            memory += f" in {where}" if off >= row["memory"] else f", {_bytes(off)} in {where}"
        moving = row.get("bytes_per_s", 0)
        rate = f", moving {moving / 1e6:.1f} MB/s" if moving >= 1e6 else ""
        waits = ""
        if "wait_p99_ms" in row:
            waits = f", waits {row['wait_p50_ms']:.1f}/{row['wait_p99_ms']:.1f} ms (p50/p99)"
        return f"{on}{row['ops_per_s']:.0f} ops/s, {row['ops']} ops{rate}{waits}, {memory}"
    return on + row.get("path", "")


def peers_table(rows: Iterable[dict]) -> Table:
    """Connected peers, their addresses and whether they are reached directly."""
    table = Table(title="peers")
    table.add_column("peer id")
    table.add_column("connection")
    table.add_column("addresses")
    for row in rows:
        table.add_row(row["peer"], row.get("connection", ""), "\n".join(row["addrs"]))
    return table


def market_tables(shown: dict) -> Group:
    """``cumulus-node offers``: prices per GPU model above the live offers."""
    return Group(prices_table(shown["prices"]), offers_table(shown["offers"]))


def prices_table(rows: Iterable[dict]) -> Table:
    """Per GPU model: the cheapest ask and contending floor with shares free, and the
    share-weighted median price of the last hour's leases (how many in brackets)."""
    table = Table(title="prices per share-hour (cleared: the last hour's leases)")
    for column in ("gpu", "on-demand ask", "contending floor", "on-demand cleared",
                   "contending cleared"):  # fmt: skip
        table.add_column(column)
    for row in rows:
        table.add_row(
            row["gpu_model"],
            _price(row["ask"]),
            _price(row["contend_floor"]),
            _cleared(row["on_demand_cleared"], row["on_demand_leases"]),
            _cleared(row["contend_cleared"], row["contend_leases"]),
        )
    return table


def _price(micro: int | None) -> str:
    return "-" if micro is None else credits(micro)


def _cleared(micro: int | None, leases: int) -> str:
    return "-" if micro is None else f"{credits(micro)} ({leases})"


def offers_table(rows: Iterable[dict]) -> Table:
    """Live offers, cheapest first, with the host's reliability score."""
    table = Table(title="offers")
    for column in (
        "host",
        "gpu",
        "VRAM MiB",
        "perf",
        "shares",
        "price/share-h",
        "contending at",
        "standby GiB",
        "price/GiB-h",
        "score",
        "expires in",
    ):
        table.add_column(column)
    for row in rows:
        table.add_row(
            short(row["host"]),
            row["gpu"],
            str(row["vram_mib"]),
            str(row["perf"]),
            str(row["shares"]),
            credits(row["price"]),
            credits(row["contend_price"]) if row.get("contend_price") else "-",
            str(row.get("storage_gib", 0)),
            credits(row.get("storage_price", 0)) if row.get("storage_gib") else "-",
            f"{row['score']:.2f}",
            f"{row['expires_in']:.0f}s",
        )
    return table


def scores_table(rows: Iterable[dict]) -> Table:
    """The reputation explorer: each host's posterior reliability and its evidence."""
    table = Table(title="host reliability (Beta posterior; rank by the lower bound)")
    for column in ("host", "mean", "lower bound", "evidence", "successes", "failures"):
        table.add_column(column)
    for row in rows:
        table.add_row(
            row["host"],
            f"{row['mean']:.3f}",
            f"{row['lower_bound']:.3f}",
            f"{row['evidence']:.2f}",
            f"{row['successes']:.2f}",
            f"{row['failures']:.2f}",
        )
    return table


def ledger_table(entries: Iterable[LedgerEntry]) -> Table:
    """Every countersigned receipt in the ledger, oldest first."""
    table = Table(title="ledger (countersigned receipts)")
    columns = ("receipt", "lease", "host", "from", "to", "share-s", "bytes", "host to host")
    for column in columns:
        table.add_column(column)
    for e in entries:
        table.add_row(
            e.receipt_id[:12],
            e.lease_id[:12],
            short(e.host),
            _clock(e.interval_start),
            _clock(e.interval_end),
            str(e.share_seconds),
            _bytes(e.bytes_moved),
            _bytes(e.peer_bytes),
        )
    return table


def disputes_table(disputes: Iterable[Dispute]) -> Table:
    """Receipts one side refused, and why (``disputes.jsonl`` holds the signed claims)."""
    table = Table(title="disputes (refused receipts)")
    for column in ("receipt", "lease", "host", "at", "why"):
        table.add_column(column)
    for d in disputes:
        table.add_row(d.receipt_id[:12], d.lease_id[:12], short(d.host), _clock(d.at), d.reason)
    return table


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))
