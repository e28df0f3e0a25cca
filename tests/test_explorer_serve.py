"""The explorer served beside a running node's own role, and its live event stream."""

from __future__ import annotations

import json
import re
import time
import urllib.request

from cumulus_p2p.testing.nodes import LOOPBACK_LISTEN, start_node


def get(url: str):
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.headers, response.read()


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
