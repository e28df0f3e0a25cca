"""An executor's workers are forks of one zygote that imported torch once
(``cumulus_p2p.host.zygote``), with the exec'd worker's isolation and failure rules."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

import cumulus_p2p.remote as remote
from cumulus_p2p._errors import SessionClosedError
from cumulus_p2p.host.zygote import Zygote
from cumulus_p2p.testing.executor import executor_process
from cumulus_p2p.testing.models import train
from cumulus_p2p.testing.processes import gone_within

# Starts executors, their zygotes and workers: scripts/test --fast skips it.
pytestmark = pytest.mark.slow

WORKERS = ["--worker-per-session", "--pool", "2"]


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


def command_of(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def worker_of_a_session(address: str) -> tuple[int, int, str]:
    """The pid of the worker a new session ran in, its parent's and its command line
    (read while it ran: a worker exits with its session)."""
    with remote.attach(address) as session:
        train("mlp", "cumulus", steps=1)
        worker = session.info["worker_pid"]
        return worker, parent_of(worker), command_of(worker)


def test_an_executors_workers_are_forks_of_one_zygote_it_started():
    with executor_process(extra=WORKERS) as (address, proc):
        (first, zygote, _), (second, its_parent, _) = (worker_of_a_session(address) for _ in "ab")
        assert first != second and its_parent == zygote
        assert parent_of(zygote) == proc.pid
        assert "cumulus_p2p.host.zygote" in command_of(zygote)


def test_once_its_zygote_is_killed_an_executor_execs_its_workers_and_serves_on():
    with executor_process(extra=WORKERS) as (address, proc):
        _, zygote, _ = worker_of_a_session(address)
        os.kill(zygote, signal.SIGKILL)
        assert gone_within(zygote, 10)
        # Its pooled workers went with it: a session arriving before the executor saw
        # their links close may land on one and be closed. Later ones run in exec'd workers.
        deadline = time.monotonic() + 60
        while True:
            try:
                _, parent, command = worker_of_a_session(address)
                break
            except SessionClosedError:
                assert time.monotonic() < deadline, "the executor served no session since"
        assert parent == proc.pid
        assert "cumulus_p2p.host.worker" in command


async def test_a_zygote_that_exits_before_it_is_ready_is_an_error_that_says_so():
    with pytest.raises(OSError, match="exited before it was ready \\(status 3\\)"):
        await Zygote.start(["sh", "-c", "exit 3", "--"], dict(os.environ), timeout=30)
