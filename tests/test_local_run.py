"""``nodes.LocalRun``: a session's local reference runs, each computed once."""

from __future__ import annotations

import subprocess

import pytest

from cumulus_p2p.testing import nodes

# Prints a different number on every run, so a kept output shows itself.
FRESH = ["-c", "import json, time; print(json.dumps({'final_loss': time.time_ns()}))"]


@pytest.fixture
def kept(tmp_path, monkeypatch):
    monkeypatch.setenv(nodes.REFERENCE_RUNS, str(tmp_path))
    return tmp_path


def test_a_second_run_of_the_same_script_reads_the_first_ones_output_and_starts_nothing(kept):
    first = nodes.LocalRun(FRESH).final_loss()
    again = nodes.LocalRun(FRESH)
    assert again.proc is None
    assert again.final_loss() == first


def test_a_script_with_other_arguments_runs_afresh(kept):
    first = nodes.LocalRun(FRESH).final_loss()
    other = nodes.LocalRun([*FRESH, "--other"])
    assert other.proc is not None
    assert other.final_loss() != first


def test_a_failed_run_is_not_kept_and_fails_again(kept):
    failing = ["-c", "raise SystemExit(3)"]
    with pytest.raises(subprocess.CalledProcessError):
        nodes.LocalRun(failing).result()
    with pytest.raises(subprocess.CalledProcessError):
        nodes.LocalRun(failing).result()
    assert list(kept.iterdir()) == []


def test_a_run_killed_before_it_finished_is_not_kept(kept):
    with nodes.LocalRun(["-c", "import time; time.sleep(60)"]):
        pass
    assert list(kept.iterdir()) == []


def test_without_the_directory_every_run_runs(monkeypatch):
    monkeypatch.delenv(nodes.REFERENCE_RUNS, raising=False)
    first = nodes.LocalRun(FRESH).final_loss()
    again = nodes.LocalRun(FRESH)
    assert again.proc is not None
    assert again.final_loss() != first
