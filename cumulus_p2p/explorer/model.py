"""What the explorer and ``cumulus-node <view> --json`` show, built from a node's state.

Sans-IO: a node's ``state.json`` (a dict), its ledger entries and the explorer's
``History`` go in, JSON-ready dicts come out. The web API and the command line both
call these functions, so they always serve the same data.

Everything in a node's state came from untrusted gossip: GPU names, peer addresses and
peer IDs are whatever other nodes sent. Nothing here interprets them; the pages show
them as text.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from ..market.ledger import LedgerEntry
from .history import History
from .hostoffers import by_host

#: Evidence kinds a host's page counts, in the order it shows them.
EVIDENCE_KINDS = ("service", "failure", "heartbeat", "performance", "nonpayment", "badblob")


def hosts(state: dict, history: History | None = None) -> list[dict]:
    """Every host the node knows of (an offer or a score), best lower bound first."""
    offers = by_host(state.get("offers", []))
    scores = {row["host"]: row for row in state.get("scores", [])}
    counts = _evidence_counts(state.get("evidence", []))
    rows = []
    for peer in offers.keys() | scores.keys():
        offer, score = offers.get(peer, {}), scores.get(peer, {})
        mean, lower = score.get("mean"), score.get("lower_bound")
        rows.append(
            {
                "host": peer,
                "online": peer in offers,
                "devices": offer.get("devices", 0),
                "gpu": offer.get("gpu"),
                "vram_mib": offer.get("vram_mib"),
                "perf": offer.get("perf"),
                "price": offer.get("price"),
                "shares_free": offer.get("shares"),
                "score": mean,
                "lower_bound": lower,
                "uncertainty": None if mean is None else round(mean - lower, 4),
                "evidence": counts.get(peer, dict.fromkeys(EVIDENCE_KINDS, 0)),
                "uptime": None if history is None else history.uptime(peer),
            }
        )
    return sorted(rows, key=lambda r: (-(r["lower_bound"] or 0.0), r["host"]))


def host(
    state: dict, peer: str, history: History | None = None, ledger: Iterable[LedgerEntry] = ()
) -> dict | None:
    """One host's page: its row, the evidence about it, this node's leases with it and
    their receipts, and its score, price and free shares over time. None if unknown."""
    row = next((r for r in hosts(state, history) if r["host"] == peer), None)
    if row is None:
        return None
    mine = [r for r in state.get("leases", []) if peer in (r.get("host"), r.get("consumer"))]
    ids = {r["lease_id"] for r in mine}
    return {
        **row,
        "evidence_history": [e for e in state.get("evidence", []) if e["about"] == peer],
        "leases": mine,
        "receipts": [entry_json(e) for e in ledger if e.lease_id in ids],
        "history": [] if history is None else history.series(peer),
    }


def book(state: dict) -> dict:
    """The live order book: per GPU model the ask, the contending floor and what recent
    leases cleared at (``market/clearing.py``); offers cheapest first, bids dearest
    first, and the depth of the offers by GPU model and price (shares at or below each
    price)."""
    offers, bids = state.get("offers", []), state.get("bids", [])
    levels: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for row in offers:
        levels[row["gpu"]][row["price"]] += row["shares"]
    depth = []
    for gpu in sorted(levels):
        total = 0
        for price in sorted(levels[gpu]):
            total += levels[gpu][price]
            depth.append(
                {"gpu": gpu, "price": price, "shares": levels[gpu][price], "cumulative": total}
            )
    return {"prices": state.get("prices", []), "offers": offers, "bids": bids, "depth": depth}


def offers(state: dict) -> dict:
    """What ``cumulus-node offers`` shows: the book's prices per GPU model and its offers."""
    shown = book(state)
    return {"prices": shown["prices"], "offers": shown["offers"]}


def leases(state: dict, ledger: Iterable[LedgerEntry]) -> dict:
    """This node's leases and sessions, and every receipt in its ledger with the total."""
    receipts = [entry_json(e) for e in ledger]
    role = state.get("role", "")
    return {
        "role": role,
        "leases": state.get("leases", []),
        "receipts": receipts,
        "total": state.get("earned" if role == "provider" else "cost", 0),
    }


def peers(state: dict) -> list[dict]:
    """The peers this node is connected to, their addresses and how it reaches them."""
    return [
        {**row, "connection": _connection(row.get("addrs", []))} for row in state.get("peers", [])
    ]


def mesh(state: dict) -> dict:
    """This node's own addresses and topics, with its peers."""
    return {
        "peer_id": state.get("peer_id", ""),
        "addrs": state.get("addrs", []),
        "topics": state.get("topics", []),
        "peers": peers(state),
    }


def entry_json(entry: LedgerEntry) -> dict:
    """One ledger entry as the ``ledger --json`` view prints it (the signed receipt
    itself stays in the ledger file)."""
    return {
        "receipt_id": entry.receipt_id,
        "lease_id": entry.lease_id,
        "host": entry.host,
        "share_seconds": entry.share_seconds,
        "bytes_moved": entry.bytes_moved,
        "peer_bytes": entry.peer_bytes,
        "interval_start": entry.interval_start,
        "interval_end": entry.interval_end,
    }


def _connection(addrs: list[str]) -> str:
    if not addrs:
        return "unknown"
    return "relayed" if all("/p2p-circuit" in a for a in addrs) else "direct"


def _evidence_counts(rows: list[dict]) -> dict[str, dict[str, int]]:
    counts: dict[str, dict[str, int]] = {}
    for row in rows:
        per = counts.setdefault(row["about"], dict.fromkeys(EVIDENCE_KINDS, 0))
        if row["kind"] in per:
            per[row["kind"]] += 1
    return counts
