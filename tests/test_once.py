"""``testing.once``: a result the test workers share, computed by the first that asks."""

from __future__ import annotations

import threading
import time

import pytest

from cumulus_p2p.testing.nodes import REFERENCE_RUNS
from cumulus_p2p.testing.once import once


def test_two_askers_at_once_get_one_computation(tmp_path, monkeypatch):
    monkeypatch.setenv(REFERENCE_RUNS, str(tmp_path))
    calls = []

    def compute():
        calls.append(1)
        time.sleep(0.2)  # long enough for the second asker to arrive while it runs
        return {"rows": [1, 2, 3]}

    results = []
    askers = [threading.Thread(target=lambda: results.append(once("k", compute))) for _ in "ab"]
    for asker in askers:
        asker.start()
    for asker in askers:
        asker.join()
    assert results == [{"rows": [1, 2, 3]}] * 2
    assert len(calls) == 1


def test_a_failed_computation_is_not_kept(tmp_path, monkeypatch):
    monkeypatch.setenv(REFERENCE_RUNS, str(tmp_path))

    def fail():
        raise ValueError("no")

    with pytest.raises(ValueError):
        once("k", fail)
    assert once("k", lambda: 7) == 7


def test_without_a_session_directory_each_ask_computes(monkeypatch):
    monkeypatch.delenv(REFERENCE_RUNS, raising=False)
    calls = []
    once("k", lambda: calls.append(1))
    once("k", lambda: calls.append(1))
    assert len(calls) == 2
