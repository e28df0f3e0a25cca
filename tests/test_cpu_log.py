"""The suite's CPU log (``cumulus_p2p.testing.cpu_log``): a line per test with the CPU
of the test and of the children it waited for, and the costliest listed first."""

from __future__ import annotations

import json
import subprocess
import sys

SPEC = """
import pathlib, subprocess, sys
from cumulus_p2p.testing import forkstart

def test_that_burns_cpu_in_a_child():
    subprocess.run([sys.executable, "-c", "sum(range(30_000_000))"], check=True)

def test_that_burns_cpu_in_a_fork(tmp_path):
    (tmp_path / "burn.py").write_text("sum(range(30_000_000))")
    forkstart.run([sys.executable, str(tmp_path / "burn.py")], check=True, timeout=60)

def test_that_does_nothing():
    pass
"""


def test_each_test_logs_its_own_and_its_childrens_cpu_and_the_costliest_come_first(tmp_path):
    (tmp_path / "test_spec.py").write_text(SPEC)
    log = tmp_path / "cpu.jsonl"
    env = {"CUMULUS_CPU_LOG": str(log), "PATH": "/usr/bin:/bin", "CUMULUS_FORK_START": "1"}
    command = [sys.executable, "-m", "pytest", "-p", "cumulus_p2p.testing.cpu_log"]
    subprocess.run(
        [*command, "-p", "no:cacheprovider", "-q", str(tmp_path / "test_spec.py")],
        cwd=tmp_path, env=env, check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    burner, forker, idle = [json.loads(line) for line in log.read_text().splitlines()]
    assert burner["test"].endswith("test_that_burns_cpu_in_a_child")
    assert burner["children_cpu_s"] > 0.1 and idle["children_cpu_s"] == 0
    assert forker["forked_cpu_s"] > 0.1 and idle["forked_cpu_s"] == 0
    listed = subprocess.run(
        [sys.executable, "-m", "cumulus_p2p.testing.cpu_log", str(log)],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout.splitlines()  # fmt: skip
    assert listed[0].startswith("3 tests")
    assert {line.split()[-1] for line in listed[1:3]} == {
        f"test_spec.py::{name}"
        for name in ("test_that_burns_cpu_in_a_child", "test_that_burns_cpu_in_a_fork")
    }
