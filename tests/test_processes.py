"""``testing.processes``: whether a process the tests started is still running."""

from __future__ import annotations

import subprocess
import sys

from cumulus_p2p.testing.processes import alive, gone_within

SLEEPER = [sys.executable, "-I", "-S", "-c", "import time; time.sleep(60)"]


def test_a_running_process_is_alive_and_not_gone_within_a_short_wait():
    proc = subprocess.Popen(SLEEPER)
    try:
        assert alive(proc.pid)
        assert not gone_within(proc.pid, 0.2)
    finally:
        proc.kill()
        proc.wait()


def test_an_exited_process_not_yet_waited_for_counts_as_gone():
    proc = subprocess.Popen(SLEEPER)
    proc.kill()  # a zombie until the wait below
    try:
        assert gone_within(proc.pid, 10)
    finally:
        proc.wait()


def test_a_reaped_process_is_not_alive():
    proc = subprocess.Popen(SLEEPER)
    proc.kill()
    proc.wait()
    assert not alive(proc.pid)
