"""Explorer benchmark: how fast the hosts page loads with many hosts (issue 15).

Writes a node state with ``--hosts`` hosts (an offer, a score and two evidence records
each) to a scratch data directory, serves it with ``cumulus-node explore`` in its own
process, and loads the hosts page in Debian's headless chromium until every row is on
screen. Prints JSON and writes ``benchmarks/results/explorer.json``::

    python benchmarks/explorer_bench.py [--hosts 1000] [--loads 5]

- ``api_hosts_ms``: median time to fetch ``/api/hosts`` (server side plus transfer);
- ``page_load_ms``: median time from navigation to the last row rendered (fresh tab);
- ``page_load_max_ms``: the slowest load.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from playwright.sync_api import sync_playwright

from cumulus_p2p.node.datadir import DataDir
from cumulus_p2p.testing.explorer import explorer_process

RESULTS = Path(__file__).parent / "results" / "explorer.json"


def state(hosts: int) -> dict:
    peers = [f"12D3KooWbench{i:06d}" for i in range(hosts)]
    return {
        "peer_id": "12D3KooWself",
        "role": "bootstrap",
        "updated": time.time(),
        "offers": [
            {
                "host": p,
                "offer_id": "gpu0",
                "gpu": ["RTX 4090", "A100"][i % 2],
                "vram_mib": 24576,
                "perf": 100 + i % 50,
                "shares": 1 + i % 8,
                "price": 50_000 + 97 * i,
                "score": 0.5,
                "expires_in": 600.0,
            }
            for i, p in enumerate(peers)
        ],
        "scores": [
            {
                "host": p,
                "mean": 0.3 + (i % 60) / 100,
                "lower_bound": 0.1 + (i % 60) / 100,
                "evidence": 2.0,
                "successes": 2.0,
                "failures": 0.0,
            }
            for i, p in enumerate(peers)
        ],
        "evidence": [
            {
                "kind": kind,
                "about": p,
                "reporter": "12D3KooWreporter",
                "weight": 0.5,
                "at": time.time(),
                "served_share_s": 3600,
                "shares": 1,
                "ratio": 1.0,
            }
            for p in peers
            for kind in ("service", "heartbeat")
        ],
        "bids": [],
        "peers": [],
        "topics": [],
        "addrs": [],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=1000)
    parser.add_argument("--loads", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        DataDir(Path(scratch)).write_state(state(args.hosts))
        with explorer_process(Path(scratch)) as explorer:
            result = measure(explorer.url, args.hosts, args.loads)
    result = {"hosts": args.hosts, **result}
    print(json.dumps(result, indent=2))
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")


def measure(url: str, hosts: int, loads: int) -> dict:
    api_ms = []
    for _ in range(loads):
        started = time.perf_counter()
        with urllib.request.urlopen(url + "api/hosts", timeout=30) as response:
            assert len(json.loads(response.read())) == hosts
        api_ms.append((time.perf_counter() - started) * 1e3)
    page_ms = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=shutil.which("chromium"), args=["--no-sandbox"]
        )
        for _ in range(loads):
            page = browser.new_page()
            started = time.perf_counter()
            page.goto(url)
            page.wait_for_selector(f"text={hosts} of {hosts} hosts")
            page_ms.append((time.perf_counter() - started) * 1e3)
            assert page.locator("#hosts tbody tr").count() == hosts
            page.close()
        browser.close()
    return {
        "api_hosts_ms": round(statistics.median(api_ms), 1),
        "page_load_ms": round(statistics.median(page_ms), 1),
        "page_load_max_ms": round(max(page_ms), 1),
    }


if __name__ == "__main__":
    main()
