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


#: Saves its ``out`` argument and prints a different number on every run, as a rank would.
RANK = """
import json, os, sys, time
if os.environ["RANK"] == "0":
    open(sys.argv[1], "w").write(str(time.time_ns()))
print(json.dumps({"rank": int(os.environ["RANK"]), "at": time.time_ns()}))
"""


@pytest.mark.slow  # torchrun starts three interpreters
def test_a_second_local_ddp_run_of_the_same_arguments_reads_the_first_ones_files(
    kept, tmp_path_factory
):
    script = tmp_path_factory.mktemp("script") / "rank.py"
    script.write_text(RANK)
    saved, ranks = nodes.local_ddp_run(script, "x", scratch=tmp_path_factory.mktemp("a"))
    assert sorted(rank["rank"] for rank in ranks) == [0, 1]
    again_saved, again = nodes.local_ddp_run(script, "x", scratch=tmp_path_factory.mktemp("b"))
    assert (again_saved, again) == (saved, ranks)
    assert saved.read_text() == again_saved.read_text()
    _, other = nodes.local_ddp_run(script, "y", scratch=tmp_path_factory.mktemp("c"))
    assert other != ranks
