"""A host's live offers as one row: a rig offers each of its GPUs separately.

The explorer lists hosts, not offers, so a host with several offers (``device0``,
``device1``... from ``cumulus-node --provide`` on a multi-GPU rig) is shown once: its
GPU models with their counts, its cheapest price and the shares free on all of them,
and the disk it lends to standbys (one disk behind all its offers: the most any offer
shows, at the cheapest storage price).
"""

from __future__ import annotations

from collections import Counter, defaultdict


def by_host(offers: list[dict]) -> dict[str, dict]:
    """Each host's offer rows (``state["offers"]``) merged into one, by host."""
    grouped: dict[str, list[dict]] = defaultdict(list)
    for row in offers:
        grouped[row["host"]].append(row)
    return {host: _merged(rows) for host, rows in grouped.items()}


def _merged(rows: list[dict]) -> dict:
    models = Counter(row["gpu"] for row in rows)
    return {
        "host": rows[0]["host"],
        "devices": len(rows),
        "gpu": ", ".join(f"{n}× {gpu}" if n > 1 else gpu for gpu, n in models.items()),
        "vram_mib": max(row["vram_mib"] for row in rows),
        "perf": max(row["perf"] for row in rows),
        "price": min(row["price"] for row in rows),
        "shares": sum(row["shares"] for row in rows),
        "storage_gib": max(row.get("storage_gib", 0) for row in rows),
        "storage_price": min(row.get("storage_price", 0) for row in rows),
    }
