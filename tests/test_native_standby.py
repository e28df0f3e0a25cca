"""A native session's checkpoints kept on a standby host, end to end.

Three ``cumulus-executor`` processes on loopback, each with a blob store: the session's
host, the standby, and the host a failover moves to. Each test runs in the
native-device child process (``testing/native_process.py``).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from cumulus_p2p._errors import SessionClosedError
from cumulus_p2p.testing.native_process import in_native_process

pytestmark = [pytest.mark.slow, pytest.mark.native, pytest.mark.usefixtures("native_child")]


def _split(address: str) -> tuple[str, int]:
    host, port = address.split(":")
    return host, int(port)


@contextlib.contextmanager
def _hosts(tmp_path, *, standby_flags: tuple[str, ...] = ()):
    """The session's host (its channel and process), a standby link, and a
    ``reconnect`` to a third host, each executor with a blob store of its own; the
    fresh channels each ``reconnect`` opened are counted in ``moves``."""
    from cumulus_p2p.blobs.standby import StandbyLink
    from cumulus_p2p.channel.transport import SocketFrameChannel
    from cumulus_p2p.testing.executor import executor_process

    def started(name: str, *flags: str):
        extra = ["--blob-dir", str(tmp_path / name), *flags]
        return executor_process(extra=extra, env={"OMP_NUM_THREADS": "1"})

    with (
        started("first") as (first, killed),
        started("standby", *standby_flags) as (standby, standby_process),
        started("second") as (second, _),
    ):
        moves: list[str] = []

        def reconnect(lost: str):
            moves.append(lost)
            return SocketFrameChannel.connect(*_split(second))

        link = StandbyLink(SocketFrameChannel.connect(*_split(standby)), address=standby)
        hosts = {"killed": killed, "standby_process": standby_process, "moves": moves}
        yield SocketFrameChannel.connect(*_split(first)), link, reconnect, hosts


@contextlib.contextmanager
def _standby_session(tmp_path):
    """A ``NativeSession`` on the first of ``_hosts``, with its standby link and its
    ``reconnect``: (session, standby link, hosts)."""
    from cumulus_p2p.native.session import NativeSession

    with _hosts(tmp_path) as (channel, standby, reconnect, hosts):
        with NativeSession(channel, reconnect=reconnect, standby=standby) as session:
            yield session, standby, hosts


def _kill(process) -> None:
    """Kill a host's process and wait until it is gone."""
    process.kill()
    process.wait()


def _weights() -> tuple[torch.Tensor, torch.Tensor]:
    """A frozen tensor of three pieces (40 MiB) and a small trained one, on the CPU."""
    torch.manual_seed(0)
    return torch.randn(10 * 1024 * 1024), torch.zeros(64)


@in_native_process
def test_a_moved_session_is_restored_from_the_standby_not_the_consumers_link(tmp_path):
    from cumulus_p2p.native.checkpoint import StandbyCheckpoint

    frozen_cpu, trained_cpu = _weights()
    with _standby_session(tmp_path) as (session, standby, hosts):
        frozen, trained = frozen_cpu.to("cumulus"), trained_cpu.to("cumulus")
        trained.add_(frozen[:64])
        assert isinstance(session.checkpoint(), StandbyCheckpoint)
        trained.mul_(2)  # after the checkpoint: replayed from the log
        _kill(hosts["killed"])
        expected = (trained_cpu + frozen_cpu[:64]) * 2
        assert torch.equal(trained.cpu(), expected)
        assert torch.equal(frozen.cpu(), frozen_cpu)
        assert session.failovers == 1
        assert session.checkpoint_bytes == 0  # no piece came to the consumer
        assert session.restored_bytes >= frozen_cpu.nbytes  # the new host pulled them
        assert standby.replications[0].fetched_bytes >= frozen_cpu.nbytes


@in_native_process
def test_training_moved_through_the_standby_keeps_a_local_runs_losses(tmp_path):
    from cumulus_p2p.native.session import NativeSession
    from cumulus_p2p.testing.models import assert_trains_as_on_the_cpu
    from cumulus_p2p.testing.models import train_tiny_transformer as _train

    with _hosts(tmp_path) as (channel, standby, reconnect, hosts):
        options = {"reconnect": reconnect, "checkpoint_interval": 0, "log_bytes": 256 * 1024}
        with NativeSession(channel, standby=standby, **options) as session:
            kill = hosts["killed"].kill
            moved, moved_params = _train("cumulus", steps=6, kill_after=4, kill=kill)
            assert session.failovers == 1 and session.checkpoints >= 3
            assert session.checkpoint_bytes == 0
            assert standby.replications
    assert_trains_as_on_the_cpu(moved, moved_params)


@in_native_process
def test_a_second_checkpoint_copies_only_the_pieces_that_changed(tmp_path):
    from cumulus_p2p.blobs.names import PIECE

    frozen_cpu, trained_cpu = _weights()
    with _standby_session(tmp_path) as (session, standby, _):
        frozen, trained = frozen_cpu.to("cumulus"), trained_cpu.to("cumulus")
        session.checkpoint()
        trained.add_(1)
        session.checkpoint()
        first, second = standby.replications
        assert first.fetched_bytes == frozen.nbytes + trained.nbytes
        assert second.fetched_bytes == trained.nbytes < PIECE


@in_native_process
def test_a_lost_standby_sends_the_checkpoints_to_the_consumer_and_the_session_still_moves(
    tmp_path,
):
    from cumulus_p2p.native.checkpoint import Checkpoint

    frozen_cpu, trained_cpu = _weights()
    with _standby_session(tmp_path) as (session, _, hosts):
        frozen, trained = frozen_cpu.to("cumulus"), trained_cpu.to("cumulus")
        session.checkpoint()
        _kill(hosts["standby_process"])
        trained.add_(1)
        session.checkpoint()  # the copy fails: this one comes to the consumer
        taken = session.checkpoint()  # the standby is let go: straight to the consumer
        assert isinstance(taken, Checkpoint)
        assert session.checkpoint_bytes >= frozen_cpu.nbytes
        _kill(hosts["killed"])
        assert torch.equal(trained.cpu(), trained_cpu + 1)
        assert torch.equal(frozen.cpu(), frozen_cpu)


@in_native_process
def test_a_lost_standby_is_replaced_and_the_new_one_restores_the_moved_session(tmp_path):
    from cumulus_p2p.blobs.standby import StandbyLink
    from cumulus_p2p.channel.transport import SocketFrameChannel
    from cumulus_p2p.native.checkpoint import StandbyCheckpoint
    from cumulus_p2p.native.session import NativeSession
    from cumulus_p2p.testing.executor import executor_process

    frozen_cpu, trained_cpu = _weights()
    spare = ["--blob-dir", str(tmp_path / "spare")]
    with (
        executor_process(extra=spare) as (spare_address, _),
        _hosts(tmp_path) as (channel, standby, reconnect, hosts),
    ):
        asked = []

        def replace(why: str, gib: int):
            asked.append(why)
            link = SocketFrameChannel.connect(*_split(spare_address))
            return StandbyLink(link, address=spare_address)

        options = {"reconnect": reconnect, "standby": standby, "replace_standby": replace}
        with NativeSession(channel, **options) as session:
            frozen, trained = frozen_cpu.to("cumulus"), trained_cpu.to("cumulus")
            session.checkpoint()
            _kill(hosts["standby_process"])
            trained.add_(1)
            session.checkpoint()  # the copy fails: this one comes to the consumer
            trained.add_(1)
            taken = session.checkpoint()  # to the new standby
            assert isinstance(taken, StandbyCheckpoint)
            assert taken.held.sources[0].address == spare_address
            assert len(asked) == 1 and "lost the standby" in asked[0]
            _kill(hosts["killed"])
            assert torch.equal(trained.cpu(), trained_cpu + 2)
            assert torch.equal(frozen.cpu(), frozen_cpu)
            assert session.restored_bytes >= frozen_cpu.nbytes


@in_native_process
def test_a_restore_the_standby_cannot_serve_says_the_session_cannot_move(tmp_path):

    frozen_cpu, trained_cpu = _weights()
    with _standby_session(tmp_path) as (session, _, hosts):
        trained = trained_cpu.to("cumulus")
        session.checkpoint()
        _kill(hosts["standby_process"])
        _kill(hosts["killed"])
        with pytest.raises(SessionClosedError, match="could not restore .* from its standby"):
            trained.cpu()
