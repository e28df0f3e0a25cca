"""A job of several GPUs outlives one of its hosts (``remote/regroup.py``).

The specs run the standard torchrun DDP script (``tests/scripts/ddp_train.py``) through
the shim against real executor processes, each rank's entry in ``CUMULUS_EXECUTOR``
naming a spare to fail over to (``a,b|c``), and SIGKILL a host in the middle of the job.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from cumulus_p2p import remote
from cumulus_p2p.channel.transport import SocketFrameChannel
from cumulus_p2p.host.handles import ErrorKind
from cumulus_p2p.remote.client import group_broke
from cumulus_p2p.remote.errors import remote_error
from cumulus_p2p.testing import nodes
from cumulus_p2p.testing.executor import executor_process
from cumulus_p2p.testing.tap import tap

SCRIPTS = Path(__file__).parent / "scripts"
#: Steps of the DDP script, and its hidden width: long enough to kill a host mid-way.
STEPS, HIDDEN = "120", "256"
#: Bytes on rank 0's link once the model is up and the steps have begun.
STEPPING = 600_000
#: How long a host that hangs stays silent before the job gives it up, in these specs.
SILENCE_S = "5"


def run_killing_a_host(
    script: Path,
    args: list[str],
    out: Path,
    *,
    spare: bool = True,
    extra: list[str] = (),
    how: signal.Signals = signal.SIGKILL,
):
    """Run ``script OUT *args`` on two ranks, rank 0 on one executor and rank 1 on
    another with a spare behind it (or a closed port, ``spare=False``); SIGKILL rank 1's
    executor once the steps have begun (or send it ``how``: SIGSTOP hangs it, its
    kernel still answering). ``extra``: the executors' own flags. Returns torchrun's
    completed process."""
    # A hung host is told from a slow one by its silence: short here, to end quickly.
    silence = {"CUMULUS_SILENCE_S": SILENCE_S} if how is signal.SIGSTOP else {}
    started = functools.partial(executor_process, extra=list(extra), env=silence)
    with (
        started() as (first, _),
        started() as (second, doomed),
        started() if spare else contextlib.nullcontext(("127.0.0.1:9", None)) as (behind, _),
        tap(first) as metered,
    ):
        env = {
            "CUMULUS_EXECUTOR": f"{metered.address},{second}|{behind}",
            "CUMULUS_CHECKPOINT_INTERVAL": "0.5",
            **silence,
        }
        shim = ["-m", "cumulus_p2p.shim", str(script), str(out), *args]
        done: dict = {}
        job = threading.Thread(target=lambda: done.update(run=nodes.torchrun(*shim, env=env)))
        job.start()
        deadline = time.monotonic() + 240
        while metered.bytes < STEPPING and job.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert job.is_alive(), "the job ended before a host could be killed"
        time.sleep(0.5)
        doomed.send_signal(how)
        job.join()
        doomed.kill()  # a stopped one would sit out the SIGTERM its context ends with
        doomed.wait()
    return done["run"]


@pytest.mark.slow
def test_a_ddp_job_whose_host_is_killed_ends_as_an_undisturbed_run(tmp_path):
    saved, local = nodes.local_ddp_run(SCRIPTS / "ddp_train.py", STEPS, HIDDEN, scratch=tmp_path)
    run = run_killing_a_host(SCRIPTS / "ddp_train.py", [STEPS, HIDDEN], tmp_path / "remote.pt")
    assert run.returncode == 0, run.stderr[-4000:]
    by_rank = {r["rank"]: r["losses"] for r in local}
    for ran in nodes.json_lines(run.stdout):
        assert ran["losses"] == by_rank[ran["rank"]]  # bit for bit: the same stream again
    remote = torch.load(tmp_path / "remote.pt")
    for name, value in torch.load(saved).items():
        assert torch.equal(remote[name], value), name
    # Both ranks went back, to the checkpoint they took together (at the latest, when
    # DDP broadcast the model): the one whose host died, and the one whose host lived.
    moved = "its state came from this machine's checkpoint"
    assert run.stderr.count(moved) == 2, run.stderr[-4000:]


@pytest.mark.slow
def test_a_ddp_job_whose_host_hangs_ends_as_an_undisturbed_run(tmp_path):
    # A stopped process: its kernel still acknowledges every byte, so no link breaks.
    saved, local = nodes.local_ddp_run(SCRIPTS / "ddp_train.py", STEPS, HIDDEN, scratch=tmp_path)
    run = run_killing_a_host(
        SCRIPTS / "ddp_train.py", [STEPS, HIDDEN], tmp_path / "remote.pt", how=signal.SIGSTOP
    )
    assert run.returncode == 0, run.stderr[-4000:]
    by_rank = {r["rank"]: r["losses"] for r in local}
    for ran in nodes.json_lines(run.stdout):
        assert ran["losses"] == by_rank[ran["rank"]]
    remote = torch.load(tmp_path / "remote.pt")
    for name, value in torch.load(saved).items():
        assert torch.equal(remote[name], value), name
    assert run.stderr.count("its state came from this machine's checkpoint") == 2, run.stderr
    # The hung host's rank heard nothing from it; the other rank's host, no pulse.
    assert "not even a keepalive: it hangs" in run.stderr, run.stderr[-4000:]
    assert "a peer sent no pulse for 5 s: it hangs" in run.stderr, run.stderr[-4000:]


def ends_as_local_despite_a_killed_host(script: str, args: list[str], tmp_path: Path) -> str:
    """Run ``script`` killing a host mid-way (``run_killing_a_host``); check that each
    rank's losses and the saved parameters are those of local gloo; return stderr."""
    saved, local = nodes.local_ddp_run(SCRIPTS / script, *args, scratch=tmp_path)
    run = run_killing_a_host(SCRIPTS / script, args, tmp_path / "remote.pt")
    assert run.returncode == 0, run.stderr[-4000:]
    by_rank = {r["rank"]: r["losses"] for r in local}
    for ran in nodes.json_lines(run.stdout):
        assert ran["losses"] == pytest.approx(by_rank[ran["rank"]], rel=1e-6)
    remote = torch.load(tmp_path / "remote.pt")
    for name, value in torch.load(saved).items():
        assert torch.allclose(remote[name], value, rtol=0, atol=1e-6), name
    return run.stderr


@pytest.mark.slow
def test_a_diloco_job_whose_host_is_killed_finishes_with_the_replacement_in_its_group(tmp_path):
    stderr = ends_as_local_despite_a_killed_host(
        "diloco_train.py", ["120", "10", HIDDEN, "sgd"], tmp_path
    )
    assert stderr.count("cumulus: session moved to") == 2, stderr[-4000:]


@pytest.mark.slow
def test_an_fsdp2_job_whose_host_is_killed_ends_as_local_fsdp2(tmp_path):
    stderr = ends_as_local_despite_a_killed_host("fsdp_train.py", ["60", HIDDEN], tmp_path)
    assert stderr.count("cumulus: session moved to") == 2, stderr[-4000:]


@pytest.mark.slow
def test_a_job_reducing_through_the_consumer_outlives_a_host_by_moving_that_rank_alone(tmp_path):
    # Through the consumer, a host holds no collective: its rank's log replays anywhere.
    saved, local = nodes.local_ddp_run(SCRIPTS / "ddp_train.py", STEPS, HIDDEN, scratch=tmp_path)
    run = run_killing_a_host(
        SCRIPTS / "ddp_train.py", [STEPS, HIDDEN], tmp_path / "r.pt", extra=["--no-peer-links"]
    )
    assert run.returncode == 0, run.stderr[-4000:]
    by_rank = {r["rank"]: r["losses"] for r in local}
    for ran in nodes.json_lines(run.stdout):
        assert ran["losses"] == pytest.approx(by_rank[ran["rank"]], rel=1e-6)
    assert run.stderr.count("cumulus: session moved to") == 1, run.stderr[-4000:]


@pytest.mark.slow
def test_a_job_that_loses_a_host_with_no_spare_left_ends_saying_why(tmp_path):
    run = run_killing_a_host(
        SCRIPTS / "ddp_train.py", [STEPS, HIDDEN], tmp_path / "p.pt", spare=False
    )
    assert run.returncode != 0
    assert "failover attempts failed" in run.stderr
    assert "no executor answers" in run.stderr


def test_a_collective_whose_group_broke_sends_the_group_back():
    broken = remote_error(ErrorKind.GROUP, "collective in group 'default': peer gone", "@pg_x")
    assert group_broke(broken)


@pytest.mark.parametrize("kind", [ErrorKind.VALUE, ErrorKind.RUNTIME, ErrorKind.OUT_OF_MEMORY])
def test_any_other_error_is_the_scripts_to_see_not_a_reason_to_go_back(kind):
    # A rank that brought a tensor of the wrong size would bring it again after going back.
    assert not group_broke(remote_error(kind, "the ranks brought different tensors", "op"))


@pytest.fixture
def recoverable(executor_address):
    """A session with failover to its own executor, handed to a group that meets no one."""
    host, _, port = executor_address.rpartition(":")
    reconnect = lambda: SocketFrameChannel.connect(host, int(port))  # noqa: E731
    with remote.attach(executor_address, reconnect=reconnect) as session:
        session.join_group_recovery(lambda ask, channel, info: None, lambda: None)
        yield session


def test_a_held_checkpoint_keeps_the_whole_log_until_the_group_commits_it(recoverable):
    x = torch.arange(4.0, device="cumulus") * 2
    recoverable.checkpoint()
    assert recoverable.failover_statistics().log_frames > 0  # failover still starts before
    recoverable.commit_checkpoint()
    assert recoverable.failover_statistics().log_frames == 0
    assert x.sum().item() == 12.0


def test_going_back_drops_a_held_checkpoint_and_replays_to_the_same_state(recoverable):
    x = torch.arange(4.0, device="cumulus") * 2
    recoverable.checkpoint()
    recoverable.roll_back("spec")
    with pytest.raises(ValueError, match="no checkpoint is held"):
        recoverable.commit_checkpoint()
    assert (x + 1).tolist() == [1.0, 3.0, 5.0, 7.0]
    assert recoverable.failovers == 1


def test_a_session_whose_failover_is_not_the_groups_refuses_to_join_one(executor_address):
    with remote.attach(executor_address) as session:  # no failover at all
        with pytest.raises(ValueError, match="only with failover"):
            session.join_group_recovery(lambda ask, channel, info: None, lambda: None)


def test_going_back_counts_again_the_peer_bytes_of_what_it_replays(executor_address):
    # A host counts the bytes its collectives carry to other hosts each time it runs
    # them, a replayed log's too; the consumer must count as much, or refuse its receipts.
    host, _, port = executor_address.rpartition(":")
    counted: list[int] = []

    def connect() -> SocketFrameChannel:
        channel = SocketFrameChannel.connect(host, int(port))
        channel.count_peer_bytes = counted.append  # as a leased channel counts them
        return channel

    with remote.attach(channel=connect(), reconnect=connect) as session:
        session.join_group_recovery(lambda ask, channel, info: None, lambda: None)
        x = torch.arange(4.0, device="cumulus")
        session.checkpoint()
        session.commit_checkpoint()
        y = x * 2  # a stand-in for a collective that carried 1000 bytes
        session.count_peer_bytes(1000)
        session.synchronize()
        session.roll_back("spec")
        assert y.tolist() == [0.0, 2.0, 4.0, 6.0]
    assert counted == [1000, 1000]
