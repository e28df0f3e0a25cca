"""What ``cumulus-node status`` shows a provider's operator, from its ``state.json``."""

from __future__ import annotations

import pytest
from rich.console import Console

from cumulus_p2p.node.views import offers_table, status_table


def device(index: int, **overrides) -> dict:
    row = {
        "offer_id": f"device{index}",
        "device": f"cuda:{index}",
        "model": "RTX 4090",
        "perf_units": 900,
        "shares_free": 4,
        "sessions": 0,
        "health": "ok",
        "gpu_utilization": 0,
    }
    return row | overrides


def lease(offer_id: str) -> dict:
    return {
        "lease_id": "ab" * 8,
        "offer_id": offer_id,
        "consumer": "12D3KooWconsumer",
        "shares": 1,
        "price": 500_000,
        "receipts": 2,
        "share_seconds": 2,
        "earned": 1,
        "bytes": 2048,
        "state": "running",
        "ops": 120,
        "ops_per_s": 60.0,
        "memory": 1024,
        "quota": 4096,
    }


def shown(state: dict) -> str:
    console = Console(width=200, record=True)
    console.print(status_table(state))
    return console.export_text()


def row(text: str, field: str) -> str:
    """The status line whose first cell is ``field``."""
    return next(line for line in text.splitlines() if line.startswith(f"│ {field} "))


def provider_state(devices: list[dict], leases: list[dict]) -> dict:
    return {
        "role": "provider",
        "peer_id": "12D3KooWhost",
        "session_endpoint": "10.0.0.2:4100",
        "price": 500_000,
        "shares_free": 7,
        "shares_total": 8,
        "sessions": 1,
        "isolation": "worker per session",
        "device_health": "ok",
        "earned": 1,
        "devices": devices,
        "leases": leases,
    }


def test_a_rig_shows_a_row_per_device_and_the_device_each_lease_runs_on():
    text = shown(
        provider_state(
            [device(0), device(1, shares_free=3, sessions=1, gpu_utilization=87)],
            [lease("device1")],
        )
    )
    first, second = row(text, "device cuda:0"), row(text, "device cuda:1")
    assert "RTX 4090 (900 perf units): 4 shares free, 0 session(s), 0% busy" in first
    assert "RTX 4090 (900 perf units): 3 shares free, 1 session(s), 87% busy" in second
    assert "device1: 60 ops/s, 120 ops" in text


def test_a_provider_shows_the_byte_rate_of_a_session_moving_data():
    moving = lease("device0") | {"bytes_per_s": 11_700_000}
    assert "moving 11.7 MB/s" in shown(provider_state([device(0)], [moving]))
    assert "moving" not in shown(provider_state([device(0)], [lease("device0")]))


def test_a_consumer_shows_its_transfer_under_way():
    state = {
        "role": "consumer",
        "status": "running",
        "transfer": {"what": "upload", "done": 288 * 2**20, "total": 393 * 2**20, "s": 25.0},
    }
    assert "upload: 288 of 393 MiB (73%), 12.1 MB/s, 25 s" in row(shown(state), "transfer")


def test_a_consumer_whose_collectives_go_through_it_says_so_and_why():
    state = {"role": "consumer", "status": "running", "collectives_through_consumer": True}
    assert "through this machine" in row(shown(state), "collectives")
    assert "collectives" not in shown({"role": "consumer", "status": "running"})


@pytest.mark.parametrize(
    ("links", "said"), [("tls", "TLS 1.3"), ("plain", "plain TCP: not encrypted")]
)
def test_a_consumer_says_how_its_jobs_hosts_link(links, said):
    state = {"role": "consumer", "status": "running", "peer_links": links}
    assert said in row(shown(state), "collectives")


def test_an_unhealthy_device_says_why_on_its_own_row():
    sick = device(1, health="the device check failed: CUDA error")
    text = shown(provider_state([device(0), sick], []))
    assert "unhealthy: the device check failed: CUDA error" in row(text, "device cuda:1")
    assert "unhealthy" not in row(text, "device cuda:0")


def test_a_provider_lending_storage_shows_what_is_free_and_its_price():
    lending = provider_state([device(0)], []) | {
        "storage_gib_total": 200,
        "storage_gib_free": 140,
        "storage_price": 10_000,
    }
    assert "140 GiB free of 200, 0.010000 per GiB-hour" in row(shown(lending), "standby storage")
    assert "standby storage" not in shown(provider_state([device(0)], []))


OFFER = {
    "host": "12D3KooWhost",
    "gpu": "RTX 4090",
    "vram_mib": 24_576,
    "perf": 900,
    "shares": 4,
    "price": 500_000,
    "score": 0.5,
    "expires_in": 30.0,
}


def test_the_offers_table_shows_each_offers_storage_terms():
    offer = OFFER
    console = Console(width=200, record=True)
    console.print(offers_table([offer | {"storage_gib": 64, "storage_price": 20_000}, offer]))
    text = console.export_text()
    assert "standby GiB" in text and "price/GiB-h" in text
    lending, not_lending = (line for line in text.splitlines() if "RTX 4090" in line)
    assert "│ 64 " in lending and "0.020000" in lending
    assert "│ 0 " in not_lending and "│ - " in not_lending


def test_a_provider_shows_how_long_a_session_waited_for_the_device():
    waiting = lease("device0") | {"wait_p50_ms": 0.4, "wait_p99_ms": 12.25}
    text = shown(provider_state([device(0)], [waiting]))
    assert "waits 0.4/12.2 ms (p50/p99)" in text
    assert "waits" not in shown(provider_state([device(0)], [lease("device0")]))


def test_a_provider_shows_where_each_sessions_memory_is_and_its_overcommit():
    paged = lease("device0") | {"tier": "disk"}
    text = shown(provider_state([device(0)], [paged]) | {"overcommit": 1.5})
    assert "1.0 kB of 4.1 kB in disk" in text
    assert "8 (1.5x the memory: idle tenants paged out)" in row(text, "shares free")
    plain = shown(provider_state([device(0)], [lease("device0") | {"tier": "device"}]))
    assert " in disk" not in plain and "x the memory" not in plain


def test_a_provider_shows_how_much_of_a_partly_evicted_sessions_memory_left_the_device():
    partly = lease("device0") | {"tier": "ram", "on_device": 600}
    assert "1.0 kB of 4.1 kB, 424 bytes in host RAM" in shown(provider_state([device(0)], [partly]))


def test_the_offers_table_shows_each_offers_contend_floor():
    offer = OFFER
    console = Console(width=220, record=True)
    console.print(offers_table([offer | {"contend_price": 200_000}]))
    text = console.export_text()
    assert "contending at" in text
    cells = [c.strip() for c in next(ln for ln in text.splitlines() if "RTX" in ln).split("│")]
    assert cells[cells.index("0.500000") + 1] == "0.200000"


def test_a_waiting_consumer_shows_where_its_bid_stands_and_what_would_run_it():
    state = {"role": "consumer", "status": "waiting for a host: no offer meets the bid"}
    waiting = state | {
        "standing": {"bids_ahead": 3, "run_now_price": 500_000, "max_price": 300_000}
    }
    assert "3 bid(s) ahead of it; a lease now costs 0.500000 per share-hour (its limit: " in (
        " ".join(row(shown(waiting), "bid").split())
    )
    nothing = state | {"standing": {"bids_ahead": 0, "run_now_price": None, "max_price": 1}}
    assert "no offer meets its other needs" in row(shown(nothing), "bid")
    assert "│ bid " not in shown(state)
