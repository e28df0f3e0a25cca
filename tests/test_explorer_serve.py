"""The explorer served beside a running node's own role, its live event stream, and the
hosts it answers to."""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from cumulus_p2p.explorer.serve import served_hosts
from cumulus_p2p.testing.nodes import LOOPBACK_LISTEN, start_node


def get(url: str):
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.headers, response.read()


@pytest.mark.slow  # starts a node
def test_a_node_started_with_explore_serves_its_own_live_state(tmp_path):
    node = start_node(tmp_path, "--listen", LOOPBACK_LISTEN, "--explore", "--explore-port", "0")
    try:
        url = re.search(r"explorer on (http://\S+/)", node.wait_for("explorer on"))[1]
        deadline = time.monotonic() + 10
        while not (status := json.loads(get(url + "api/status")[1]))["peer_id"]:
            assert time.monotonic() < deadline, "the explorer never saw the node's state"
            time.sleep(0.2)  # the node writes its first state.json after it listens
        assert status["running"] is True
        assert status["peer_id"] == node.state()["peer_id"]
        headers, _ = get(url)
        assert "script-src 'self'" in headers["Content-Security-Policy"]
    finally:
        node.stop()


@pytest.mark.slow  # starts a node
def test_the_event_stream_announces_each_new_state(tmp_path):
    node = start_node(tmp_path, "--listen", LOOPBACK_LISTEN, "--explore", "--explore-port", "0")
    try:
        url = re.search(r"explorer on (http://\S+/)", node.wait_for("explorer on"))[1]
        with urllib.request.urlopen(url + "api/events", timeout=10) as stream:
            versions = []
            while len(versions) < 2:  # the version now, then the next state's
                line = stream.readline().strip()
                if line.startswith(b"data:"):
                    versions.append(int(line.split(b":")[1]))
        assert versions[1] > versions[0]
    finally:
        node.stop()


@pytest.fixture(scope="module")
def explorer_url(tmp_path_factory):
    """The explorer of a running boot node, which also answers to ``gpu.example``."""
    node = start_node(
        tmp_path_factory.mktemp("node"),
        "--listen",
        LOOPBACK_LISTEN,
        "--explore",
        "--explore-port",
        "0",
        "--explore-allow-host",
        "gpu.example",
    )
    try:
        yield re.search(r"explorer on (http://\S+/)", node.wait_for("explorer on"))[1]
    finally:
        node.stop()


def fetch(url: str, *, host: str | None = None) -> tuple[int, bytes]:
    """``GET url`` with its ``Host`` header naming ``host`` (and the URL's port)."""
    parts = urllib.parse.urlsplit(url)
    headers = {"Host": f"{host}:{parts.port}"} if host else {}
    try:
        request = urllib.request.Request(url, headers=headers)
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as refused:
        return refused.code, refused.read()


@pytest.mark.slow  # starts a node
@pytest.mark.parametrize("path", ["", "api/status", "api/leases", "api/peers", "api/hosts"])
def test_a_page_from_another_site_rebound_to_this_machine_is_refused(explorer_url, path):
    # DNS rebinding: evil.example now resolves to 127.0.0.1, so a script on a page
    # from evil.example reaches the explorer, but its requests name evil.example.
    status, body = fetch(explorer_url + path, host="evil.example")
    assert (status, body) == (400, b"Invalid host header")


@pytest.mark.slow  # starts a node
def test_the_loopback_names_and_the_allowed_host_are_served(explorer_url):
    for host in ("127.0.0.1", "localhost", "gpu.example", "GPU.example"):
        assert fetch(explorer_url + "api/status", host=host)[0] == 200, host
    for path in ("", "book", "api/hosts", "api/book", "api/leases", "api/peers", "api/mesh"):
        assert fetch(explorer_url + path)[0] == 200, path


@pytest.mark.slow  # starts a node
def test_an_unknown_host_is_not_found(explorer_url):
    status, body = fetch(explorer_url + "api/hosts/12D3KooWnobody")
    assert status == 404
    assert json.loads(body) == {"error": "no such host"}


def test_a_wildcard_bind_also_serves_this_machines_name_and_addresses():
    hosts = served_hosts("0.0.0.0")
    assert {"127.0.0.1", "localhost", "[::1]", socket.gethostname().lower()} <= set(hosts)
    assert "evil.example" not in hosts
    assert served_hosts("::1", ["Gpu.Example"]) == [
        "127.0.0.1",
        "localhost",
        "[::1]",
        "gpu.example",
    ]
