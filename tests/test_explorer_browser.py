"""The explorer in a real headless browser (Debian's chromium), against real nodes.

Screenshots land in ``test-artifacts/explorer/``.
"""

from __future__ import annotations

import json
import re
import shutil
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect, sync_playwright

from cumulus_p2p.node.datadir import DataDir
from cumulus_p2p.testing.explorer import explorer_process
from cumulus_p2p.testing.nodes import (
    LOOPBACK_LISTEN,
    start_consumer,
    start_node,
    start_provider,
)

# Starts real cumulus-node processes and a browser: scripts/test --fast skips it.
pytestmark = pytest.mark.slow

ARTEFACTS = Path(__file__).resolve().parent.parent / "test-artifacts" / "explorer"
SCRIPT = Path(__file__).parent / "scripts" / "cuda_train.py"


@pytest.fixture(scope="module")
def browser():
    chromium = shutil.which("chromium")
    assert chromium, "the browser tests need Debian's chromium: apt-get install chromium"
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        yield launched
        launched.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    opened = context.new_page()
    opened.dialogs = []
    opened.on("dialog", lambda dialog: (opened.dialogs.append(dialog.message), dialog.dismiss()))
    yield opened
    context.close()


def shoot(page: Page, name: str) -> None:
    ARTEFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTEFACTS / f"{name}.png"), full_page=True)


def row_of(page: Page, table: str, peer: str):
    return page.locator(f'#{table} tr:has(a[title="{peer}"])')


# --- a real mesh ------------------------------------------------------------------------


def test_a_live_mesh_seen_through_the_explorer(tmp_path, page):
    boot = start_node(tmp_path / "boot", "--listen", LOOPBACK_LISTEN)
    nodes = [boot]
    explorers = ExitStack()
    try:
        providers = [
            start_provider(tmp_path / f"p{i}", boot.addr, "--price", price)
            for i, price in enumerate(("0.3", "0.7"))
        ]
        nodes += providers
        for provider in providers:
            provider.wait_for("providing")
        # "providing" is printed before the node first writes its state.json
        hosts = [p.wait_for_state(lambda s: "peer_id" in s)["peer_id"] for p in providers]
        mesh_view = explorers.enter_context(explorer_process(tmp_path / "boot"))

        # The order book, open in the browser while the job runs.
        page.goto(mesh_view.url + "book")
        expect(page.locator("#offers a[title]")).to_have_count(2, timeout=30_000)

        consumer = start_consumer(tmp_path / "consumer", boot.addr, command=[str(SCRIPT), "1"])
        assert consumer.proc.wait(timeout=240) == 0, consumer.output()
        leased = json.loads((tmp_path / "consumer" / "state.json").read_text())["leases"][0]

        # The consumer has stopped: its explorer shows the last state it wrote.
        job_view = explorers.enter_context(explorer_process(tmp_path / "consumer"))
        hosts_page = job_view.url
        page.goto(hosts_page)
        for host in hosts:
            row_of(page, "hosts", host).wait_for(timeout=15_000)
            assert re.search(r"\b0\.\d{3}\b", row_of(page, "hosts", host).inner_text())
        assert "not running" in page.inner_text("#node-status")
        shoot(page, "hosts")

        page.goto(f"{hosts_page}hosts/{leased['host']}")
        page.wait_for_selector("#receipts")
        assert leased["lease_id"][:8] in page.inner_text("#leases")
        receipts = page.locator("#receipts tbody tr")
        assert receipts.count() >= 1 and "nothing yet" not in receipts.first.inner_text()
        shoot(page, "host")

        # The consumer's service report reaches the bootstrap node's reputation view.
        deadline = time.monotonic() + 30
        while mesh_view.api(f"api/hosts/{leased['host']}")["evidence"]["service"] < 1:
            assert time.monotonic() < deadline, "no service report reached the bootstrap node"
            time.sleep(0.5)
        page.goto(f"{mesh_view.url}hosts/{leased['host']}")
        page.wait_for_selector("#evidence")
        assert "service" in page.inner_text("#evidence")

        # A new offer appears on the open book page without a reload.
        page.goto(mesh_view.url + "book")
        expect(page.locator("#offers a[title]")).to_have_count(2, timeout=30_000)
        page.evaluate("window.__still_this_page = true")
        nodes.append(start_provider(tmp_path / "p-late", boot.addr, "--price", "0.5"))
        nodes[-1].wait_for("listening on")
        expect(page.locator("#offers a[title]")).to_have_count(3, timeout=30_000)
        assert page.evaluate("window.__still_this_page") is True
        shoot(page, "book")
    finally:
        explorers.close()
        for node in reversed(nodes):
            node.stop()


# --- hostile gossip ---------------------------------------------------------------------

SCRIPT_GPU = "<script>window.__pwned = 1</script>"
IMG_GPU = '"><img src=x onerror="window.__pwned = 2">'
MARKUP_ADDR = '<img src=x onerror="window.__pwned = 3">/ip4/10.9.9.9/tcp/1'


def _hostile_state() -> dict:
    def offer(host: str, gpu: str) -> dict:
        return {
            "host": host,
            "offer_id": "gpu0",
            "gpu": gpu,
            "vram_mib": 24576,
            "perf": 100,
            "shares": 8,
            "price": 100_000,
            "score": 0.5,
            "expires_in": 60.0,
        }

    return {
        "peer_id": "12D3KooWself",
        "role": "bootstrap",
        "updated": time.time(),
        "offers": [offer("12D3KooWscript", SCRIPT_GPU), offer("12D3KooWimg", IMG_GPU)],
        "scores": [],
        "bids": [],
        "evidence": [],
        "topics": [],
        "addrs": [],
        "peers": [{"peer": "12D3KooWpeer", "addrs": [MARKUP_ADDR]}],
    }


@pytest.fixture
def hostile(tmp_path):
    DataDir(tmp_path).write_state(_hostile_state())
    with explorer_process(tmp_path) as explorer:
        yield explorer


def assert_inert(page: Page) -> None:
    assert page.evaluate("window.__pwned") is None
    assert page.locator("main img").count() == 0
    assert page.dialogs == []


@pytest.mark.parametrize(
    ("path", "ready", "shown"),
    [
        ("", "#hosts a[title]", SCRIPT_GPU),
        ("", "#hosts a[title]", IMG_GPU),
        ("book", "#offers a[title]", IMG_GPU),
        ("hosts/12D3KooWimg", "#evidence", IMG_GPU),
        ("mesh", "#peers tbody tr", MARKUP_ADDR),
    ],
    ids=["script-gpu-model", "img-gpu-model", "book", "host-page", "peer-address"],
)
def test_markup_in_gossip_is_shown_as_text_and_runs_nothing(hostile, page, path, ready, shown):
    page.goto(hostile.url + path)
    page.wait_for_selector(ready)
    assert shown in page.inner_text("main")
    assert_inert(page)


def test_markup_in_a_host_url_is_shown_as_text(hostile, page):
    page.goto(hostile.url + "hosts/" + '"><img src=x onerror="window.__pwned=4">')
    page.wait_for_selector("main h1")
    assert "no such host" in page.inner_text("main")
    assert_inert(page)


def test_pages_forbid_inline_scripts_and_other_origins(hostile):
    with urllib.request.urlopen(hostile.url, timeout=10) as response:
        policy = response.headers["Content-Security-Policy"]
    assert "script-src 'self'" in policy and "default-src 'none'" in policy


def test_the_explorer_takes_no_action(hostile):
    request = urllib.request.Request(hostile.url + "api/hosts", data=b"{}", method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 405
