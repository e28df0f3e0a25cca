"""What the explorer serves, built from a node's state (sans-IO)."""

from __future__ import annotations

import json

from cumulus_p2p.cli import main
from cumulus_p2p.explorer import model
from cumulus_p2p.explorer.history import History
from cumulus_p2p.node.datadir import DataDir


def offer(
    host: str, price: int, *, gpu: str = "RTX 4090", shares: int = 8, offer_id: str = "device0"
) -> dict:
    return {
        "host": host,
        "offer_id": offer_id,
        "gpu": gpu,
        "vram_mib": 24576,
        "perf": 100,
        "shares": shares,
        "price": price,
        "score": 0.5,
        "expires_in": 60.0,
    }


def score(host: str, mean: float, lower: float) -> dict:
    return {
        "host": host,
        "mean": mean,
        "lower_bound": lower,
        "evidence": 1.0,
        "successes": 1.0,
        "failures": 0.0,
    }


def evidence(about: str, kind: str) -> dict:
    return {
        "kind": kind,
        "about": about,
        "reporter": "C",
        "weight": 0.5,
        "at": 1.0,
        "served_share_s": 10,
        "shares": 1,
        "ratio": 1.0,
    }


STATE = {
    "offers": [offer("A", 100), offer("B", 300, gpu="A100")],
    "scores": [score("A", 0.6, 0.3), score("B", 0.8, 0.5), score("gone", 0.2, 0.1)],
    "evidence": [evidence("A", "service"), evidence("A", "failure"), evidence("B", "service")],
    "peers": [
        {"peer": "P1", "addrs": ["/ip4/10.0.0.1/tcp/4001"]},
        {"peer": "P2", "addrs": ["/ip4/10.0.0.2/tcp/4001/p2p/R/p2p-circuit"]},
    ],
}


def test_hosts_join_offers_scores_and_evidence_best_lower_bound_first():
    rows = model.hosts(STATE)
    assert [r["host"] for r in rows] == ["B", "A", "gone"]
    a = rows[1]
    assert (a["online"], a["price"], a["score"], a["uncertainty"]) == (True, 100, 0.6, 0.3)
    assert a["evidence"]["service"] == 1 and a["evidence"]["failure"] == 1
    assert rows[2]["online"] is False and rows[2]["price"] is None


def test_a_rig_offering_each_gpu_is_one_host_with_all_its_gpus_and_shares():
    rig = [
        offer("R", 200, shares=4),
        offer("R", 150, shares=2, offer_id="device1"),
        offer("R", 300, gpu="A100", shares=1, offer_id="device2"),
    ]
    (row,) = model.hosts({"offers": rig})
    assert (row["devices"], row["gpu"]) == (3, "2× RTX 4090, A100")
    assert (row["price"], row["shares_free"]) == (150, 7)


def test_history_samples_a_rig_once_with_the_shares_free_on_all_its_gpus():
    history = History()
    rig = [offer("R", 200, shares=4), offer("R", 150, shares=2, offer_id="device1")]
    history.record({"offers": rig}, 1.0)
    assert history.series("R") == [{"t": 1.0, "score": None, "price": 150, "shares_free": 6}]


def test_a_hosts_page_holds_only_the_evidence_about_it():
    page = model.host(STATE, "A")
    assert {e["kind"] for e in page["evidence_history"]} == {"service", "failure"}
    assert model.host(STATE, "nobody") is None


def test_book_depth_adds_up_shares_per_gpu_model_by_price():
    state = {
        "offers": [
            offer("A", 100, shares=2),
            offer("B", 200, shares=3),
            offer("C", 100, shares=1, gpu="A100"),
        ]
    }
    assert model.book(state)["depth"] == [
        {"gpu": "A100", "price": 100, "shares": 1, "cumulative": 1},
        {"gpu": "RTX 4090", "price": 100, "shares": 2, "cumulative": 2},
        {"gpu": "RTX 4090", "price": 200, "shares": 3, "cumulative": 5},
    ]


def test_a_peer_reached_only_through_a_relay_shows_as_relayed():
    assert [p["connection"] for p in model.peers(STATE)] == ["direct", "relayed"]


def test_history_tracks_score_price_and_availability_and_uptime():
    history = History()
    history.record(STATE, 10.0)
    history.record({"scores": [score("A", 0.7, 0.4)]}, 20.0)  # A's offer is gone
    assert history.series("A") == [
        {"t": 10.0, "score": 0.6, "price": 100, "shares_free": 8},
        {"t": 20.0, "score": 0.7, "price": None, "shares_free": None},
    ]
    assert history.uptime("A") == 0.5 and history.uptime("never") is None


def test_history_forgets_the_hosts_seen_least_recently_first():
    history = History(max_hosts=2)
    for i, host in enumerate(["A", "B", "C"]):
        history.record({"offers": [offer(host, 100)]}, float(i))
    assert history.series("A") == [] and history.series("C") != []


def test_the_cli_json_views_serve_what_the_explorer_serves(tmp_path, capsys):
    DataDir(tmp_path).write_state({**STATE, "updated": 1.0})
    for view, expected in (("peers", model.peers(STATE)), ("offers", model.offers(STATE))):
        assert main([view, "--data-dir", str(tmp_path), "--json"]) == 0
        assert json.loads(capsys.readouterr().out) == expected
