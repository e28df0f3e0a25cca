"""Checkpoints kept off the consumer's link: the host keeps them, a standby host copies
them host to host, and a failover pulls the state from the standby. Hosts are real
executor processes with blob stores (the slow tier: each test starts several); "vanishing"
is SIGKILL."""

from __future__ import annotations

import secrets
from functools import partial
from pathlib import Path

import pytest
import torch
import trio

import cumulus_p2p.remote as remote
from cumulus_p2p._errors import StandbyFullError
from cumulus_p2p.blobs.names import digest
from cumulus_p2p.blobs.service import HELLO, PullError, Source, grant_of, pull, serve_blobs
from cumulus_p2p.blobs.standby import HostCheckpoint
from cumulus_p2p.blobs.store import BlobStore
from cumulus_p2p.channel.transport import SocketFrameChannel, TrioFrameChannel
from cumulus_p2p.host.session import DeviceContext, ExecutorSession
from cumulus_p2p.remote.checkpoint import Checkpoint
from cumulus_p2p.testing import models
from cumulus_p2p.testing.executor import executor_process
from cumulus_p2p.testing.memory import peak_since_reset, reset_peak
from cumulus_p2p.wire.protocol import PROTOCOL_VERSION, decode_frame, encode_frame

MiB = 1024 * 1024


def host(tmp_path: Path, name: str, *flags: str):
    """A real executor process with a blob store of its own."""
    extra = ["--blob-dir", str(tmp_path / name), *flags]
    return executor_process(quota="2GiB", extra=extra)


def dial(address: str):
    host_, port = address.split(":")
    return lambda: SocketFrameChannel.connect(host_, int(port))


def train(steps: int, on_step=lambda i: None):
    """The transformer task on cumulus for ``steps`` steps; losses and final weights."""
    return models.train("transformer", "cumulus", steps=steps, on_step=on_step)


def assert_same_run(got, expected) -> None:
    (losses, params), (ref_losses, ref_params) = got, expected
    assert losses == ref_losses
    for name, value in ref_params.items():
        assert torch.equal(params[name], value), name


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """Three hosts: the primary (killed by tests that need it dead: so per test below),
    a standby and a fresh one, and the uninterrupted run to compare with."""
    root = tmp_path_factory.mktemp("standby-hosts")
    with host(root, "standby") as (standby, _), host(root, "fresh") as (fresh, _):
        with remote.attach(standby):
            reference = train(10)
        yield standby, fresh, reference


def checkpoint_then_kill(session, primary, *, at: int = 3, kill_at: int = 6):
    def on_step(i: int) -> None:
        if i == at:
            assert isinstance(session.checkpoint(), HostCheckpoint)
        if i == kill_at:
            primary.kill()
            primary.wait()

    return on_step


# --- failover through the standby ------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("isolation", ["--shared-process", "--worker-per-session"])
def test_a_host_killed_mid_run_resumes_on_a_fresh_host_from_the_standby(tmp_path, hosts, isolation):
    *_, reference = hosts
    # Hosts of its own: the shared ones may already hold these pieces from another test.
    # With a worker per session, the primary's pieces are served from the session's worker.
    with (
        host(tmp_path, "primary", isolation) as (primary, proc),
        host(tmp_path, "standby") as (standby, _),
    ):
        with (
            host(tmp_path, "fresh") as (fresh, _),
            remote.attach(primary, reconnect=dial(fresh), standby=standby) as session,
        ):
            got = train(10, checkpoint_then_kill(session, proc))
            stats = session.failover_statistics()
    assert_same_run(got, reference)
    assert stats.cold_restores == 1 and stats.replicated_checkpoints == 1
    assert stats.checkpoint_read_bytes == 0  # nothing of the state came to the consumer
    assert stats.restore_pulled_bytes == stats.checkpoint_bytes  # the fresh host pulled it all


@pytest.mark.slow
def test_failing_over_to_the_standby_itself_pulls_nothing(tmp_path, hosts):
    standby, _, reference = hosts
    with host(tmp_path, "primary") as (primary, proc):
        with remote.attach(primary, reconnect=dial(standby), standby=standby) as session:
            got = train(10, checkpoint_then_kill(session, proc))
            stats = session.failover_statistics()
    assert_same_run(got, reference)
    assert stats.cold_restores == 1
    assert stats.restore_pulled_bytes == 0


@pytest.mark.slow
def test_the_standby_copies_only_the_pieces_it_lacks(tmp_path, hosts):
    standby, fresh, _ = hosts
    with remote.attach(fresh, reconnect=dial(fresh), standby=standby) as session:
        frozen = torch.randn(6 * MiB).to("cumulus")  # 24 MiB: two pieces, never written
        trained = torch.zeros(1024).to("cumulus")
        session.checkpoint()
        first = session.failover_statistics().last_replication_bytes
        trained += 1.0
        session.checkpoint()
        second = session.failover_statistics().last_replication_bytes
        assert frozen.cpu().shape == (6 * MiB,)
    assert first >= 24 * MiB
    assert second <= 4096  # the one storage that changed


@pytest.mark.slow
def test_a_checkpoint_counts_only_once_the_standby_holds_it(tmp_path, hosts):
    _, fresh, _ = hosts
    with host(tmp_path, "primary") as (primary, _), host(tmp_path, "standby") as (standby, sp):
        with remote.attach(primary, reconnect=dial(fresh), standby=standby) as session:
            x = torch.ones(4).to("cumulus")
            session.checkpoint()
            kept = session.failover_statistics().replicated_checkpoints
            sp.kill()
            sp.wait()
            x += 1
            # The standby is gone: this checkpoint goes to the consumer's store instead.
            assert isinstance(session.checkpoint(), Checkpoint)
            assert session.failover_statistics().replicated_checkpoints == kept == 1
            assert x.cpu().tolist() == [2.0] * 4


@pytest.mark.slow
def test_a_standby_whose_store_is_full_keeps_the_previous_checkpoint(tmp_path, hosts, caplog):
    _, fresh, _ = hosts
    with host(tmp_path, "standby", "--blob-cap", "8MiB") as (standby, _):
        with remote.attach(fresh, reconnect=dial(fresh), standby=standby) as session:
            small = torch.ones(1024).to("cumulus")
            first = session.checkpoint()
            big = torch.randn(4 * MiB).to("cumulus")  # 16 MiB: more than the standby's cap
            # The copy fails for want of room: the consumer's store takes this checkpoint.
            assert isinstance(session.checkpoint(), Checkpoint)
            stats = session.failover_statistics()
            assert stats.replicated_checkpoints == 1 and isinstance(first, HostCheckpoint)
            assert small.cpu()[0] == 1.0 and big.cpu().shape == (4 * MiB,)
    assert "has no room" in caplog.text


@pytest.mark.slow
def test_with_both_placements_a_lost_standby_restores_the_consumers_copy(tmp_path, hosts, caplog):
    *_, reference = hosts
    with (
        host(tmp_path, "primary") as (primary, proc),
        host(tmp_path, "standby") as (standby, standby_proc),
        host(tmp_path, "fresh") as (fresh, _),
    ):
        attached = remote.attach(
            primary, reconnect=dial(fresh), standby=standby, checkpoint_to="both"
        )
        with attached as session:

            def on_step(i: int) -> None:
                if i == 3:
                    assert isinstance(session.checkpoint(), Checkpoint)
                    assert session.wait_for_standby() is not None  # both hold it
                if i == 6:
                    for dying in (standby_proc, proc):
                        dying.kill()
                        dying.wait()

            got = train(10, on_step)
            stats = session.failover_statistics()
    assert_same_run(got, reference)
    assert stats.cold_restores == 1 and stats.restore_pulled_bytes == 0
    assert "restoring the consumer's copy instead" in caplog.text  # the standby was tried


def test_checkpoints_on_a_standby_need_one():
    with pytest.raises(ValueError, match="needs a standby"):
        remote.RemoteSession(None, reconnect=lambda: None, checkpoint_to="standby")


# --- who may fetch what ----------------------------------------------------------------------


def _blob_connection(address: str, grant: str) -> tuple[SocketFrameChannel, list]:
    channel = dial(address)()
    channel.send_frame(encode_frame([HELLO, PROTOCOL_VERSION, {"grant": grant}]))
    header, _ = decode_frame(channel.recv_frame())
    return channel, header


@pytest.mark.slow
def test_a_peer_without_the_grant_gets_nothing(tmp_path, hosts):
    standby, fresh, _ = hosts
    with remote.attach(fresh, reconnect=dial(fresh), standby=standby) as session:
        x = torch.arange(1024, dtype=torch.float32).to("cumulus")
        checkpoint = session.checkpoint()
        (kept,) = checkpoint.digests
        channel, header = _blob_connection(fresh, secrets.token_hex(32))
        assert header[0] == "refused"
        channel.close()

        channel, header = _blob_connection(fresh, grant_of(session.info["token"]))
        assert header == ["ready"]
        channel.send_frame(encode_frame(["get", [digest(b"not kept here")]]))
        refused, _ = decode_frame(channel.recv_frame())
        assert refused[0] == "refused"
        channel.send_frame(encode_frame(["get", [kept]]))
        answer, area = decode_frame(channel.recv_frame())
        assert answer[0] == "blobs" and digest(area[: answer[1][0]]) == kept
        channel.close()
        assert x.cpu()[-1] == 1023


@pytest.mark.slow
@pytest.mark.parametrize(
    ("hello", "then"),
    [
        ([HELLO, PROTOCOL_VERSION, {}], None),
        ([HELLO, PROTOCOL_VERSION, {"grant": "not hex"}], None),
        ("granted", ["get", [digest(b"x")] * 50]),
        ("granted", ["get", "everything"]),
    ],
    ids=["no-grant", "malformed-grant", "too-many-pieces", "not-a-list"],
)
def test_a_malformed_blob_request_ends_that_connection_with_a_reason(hosts, hello, then):
    _, fresh, _ = hosts
    with remote.attach(fresh) as session:
        if hello == "granted":
            hello = [HELLO, PROTOCOL_VERSION, {"grant": grant_of(session.info["token"])}]
        channel = dial(fresh)()
        channel.send_frame(encode_frame(hello))
        if then is not None:
            assert decode_frame(channel.recv_frame())[0] == ["ready"]
            channel.send_frame(encode_frame(then))
        header, _ = decode_frame(channel.recv_frame())
        assert header[0] == "fatal" and ("blob connection" in header[1] or "get" in header[1])
        channel.close()
        assert torch.ones(2).to("cumulus").cpu().tolist() == [1.0, 1.0]  # the host serves on


def _raw_session(address: str) -> tuple[SocketFrameChannel, str]:
    channel = dial(address)()
    channel.send_frame(encode_frame(["hello", PROTOCOL_VERSION, {}]))
    header, _ = decode_frame(channel.recv_frame())
    return channel, header[2]["token"]


def _pull(channel: SocketFrameChannel, source: str, grant: str, names: list[str]) -> dict:
    request = {"sources": [[source, grant]], "digests": names}
    channel.send_frame(encode_frame(["pull", request]))
    header, _ = decode_frame(channel.recv_frame())
    assert header[0] == "pulled"
    return header[1]


@pytest.mark.slow
def test_a_failed_pull_keeps_the_pieces_the_standby_held(hosts):
    standby, fresh, _ = hosts
    with remote.attach(fresh, reconnect=dial(fresh), standby=standby) as session:
        x = torch.full((1024,), 7.0).to("cumulus")
        (name,) = session.checkpoint().digests
        source = (fresh, grant_of(session.info["token"]))
        channel, token = _raw_session(standby)
        assert _pull(channel, *source, [name])["error"] is None
        failed = _pull(channel, *source, [digest(b"the primary never had this")])
        assert "no source" in failed["error"]
        # The first pull's piece is still held for this session, and served by its grant.
        reader, header = _blob_connection(standby, grant_of(token))
        assert header == ["ready"]
        reader.send_frame(encode_frame(["get", [name]]))
        answer, area = decode_frame(reader.recv_frame())
        assert answer[0] == "blobs" and digest(area[: answer[1][0]]) == name
        reader.close()
        channel.close()
        assert x.cpu()[0] == 7.0


GOOD_SOURCE = [["127.0.0.1:1", "ab" * 32]]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("message", "reason"),
    [
        (["pull", {"sources": [["nowhere", "x"]], "digests": []}], "pull source"),
        (["pull", {"sources": [["k3y@127.0.0.1:1", "ab" * 32]], "digests": []}], "pull source"),
        (["pull", {"sources": GOOD_SOURCE, "digests": ["not a digest"]}], "by digest"),
        (["restore", {"sources": GOOD_SOURCE, "storages": "all"}], "storages"),
        (["restore", {"sources": GOOD_SOURCE, "storages": [[1, 2, 3]]}], "bad storage entry"),
        (["restore", {"sources": GOOD_SOURCE}], "storages"),
    ],
    ids=[
        "bad-source",
        "bad-host-key",
        "bad-digest",
        "storages-not-a-list",
        "bad-entry",
        "no-storages",
    ],
)
def test_a_malformed_pull_or_restore_ends_only_that_session_with_a_reason(hosts, message, reason):
    standby, _, _ = hosts
    channel = dial(standby)()
    channel.send_frame(encode_frame(["hello", PROTOCOL_VERSION, {}]))
    assert decode_frame(channel.recv_frame())[0][0] == "welcome"
    channel.send_frame(encode_frame(message))
    header, _ = decode_frame(channel.recv_frame())
    assert header[0] == "fatal" and reason in header[1]
    channel.close()
    with remote.attach(standby):  # the host serves on
        assert torch.ones(2).to("cumulus").cpu().tolist() == [1.0, 1.0]


@pytest.mark.slow
def test_a_restore_over_the_quota_is_refused_and_leaves_no_storage(hosts):
    standby, _, _ = hosts
    channel = dial(standby)()
    channel.send_frame(encode_frame(["hello", PROTOCOL_VERSION, {"quota": MiB}]))
    assert decode_frame(channel.recv_frame())[0][0] == "welcome"
    names = [digest(b"a"), digest(b"b")]
    storages = [[1, torch.uint8, 1024, [names[0]]], [2, torch.uint8, 2 * MiB, [names[1]]]]
    channel.send_frame(encode_frame(["restore", {"sources": GOOD_SOURCE, "storages": storages}]))
    header, _ = decode_frame(channel.recv_frame())
    assert header[0] == "restored" and "quota" in header[1]["error"].lower()
    # Storage 1 was made, then undone with the rest: its handle is free again.
    again = [[1, torch.uint8, 0, []]]
    channel.send_frame(encode_frame(["restore", {"sources": GOOD_SOURCE, "storages": again}]))
    header, _ = decode_frame(channel.recv_frame())
    assert header[0] == "restored" and header[1]["error"] is None
    channel.close()


# --- pulling from untrusted sources ----------------------------------------------------------


PIECES = {digest(data): data for data in (b"a" * 5000, b"b" * 7000, b"c" * 3)}
GRANT = digest(b"the grant")


async def _source(nursery: trio.Nursery, serve) -> str:
    """A blob source on loopback; ``serve(name)`` says what it answers for a piece."""

    async def handler(stream: trio.SocketStream) -> None:
        channel = TrioFrameChannel(stream)
        header, _ = decode_frame(await channel.receive_frame())
        await serve_blobs(channel, header, lambda grant: serve if grant == GRANT else None)

    listeners = await nursery.start(partial(trio.serve_tcp, host="127.0.0.1"), handler, 0)
    return f"127.0.0.1:{listeners[0].socket.getsockname()[1]}"


async def test_a_source_sending_garbage_is_dropped_and_the_next_one_serves(tmp_path):
    store = BlobStore(tmp_path, cap=MiB)
    async with trio.open_nursery() as nursery:
        liar = await _source(nursery, lambda name: memoryview(b"x" * len(PIECES[name])))
        honest = await _source(nursery, lambda name: memoryview(PIECES[name]))
        sources = [Source(liar, GRANT), Source(honest, GRANT)]
        pulled = await pull(store, sources, list(PIECES), max_frame=8 * MiB)
        nursery.cancel_scope.cancel()
    assert pulled.fetched == len(PIECES)
    assert len(pulled.dropped) == 1 and liar in pulled.dropped[0]
    for name, data in PIECES.items():
        pinned = store.pin(name)
        buffer = memoryview(bytearray(pinned.size))
        pinned.read_into(buffer)
        pinned.close()
        assert bytes(buffer) == data


async def test_a_pull_no_source_can_serve_fails_and_keeps_no_garbage(tmp_path):
    store = BlobStore(tmp_path, cap=MiB)
    async with trio.open_nursery() as nursery:
        liar = await _source(nursery, lambda name: memoryview(b"x" * len(PIECES[name])))
        with pytest.raises(PullError, match="no source"):
            await pull(store, [Source(liar, GRANT)], list(PIECES), max_frame=8 * MiB)
        nursery.cancel_scope.cancel()
    assert store.statistics().blobs == 0


async def test_a_source_refuses_a_wrong_grant(tmp_path):
    store = BlobStore(tmp_path, cap=MiB)
    async with trio.open_nursery() as nursery:
        honest = await _source(nursery, lambda name: memoryview(PIECES[name]))
        with pytest.raises(PullError) as failed:
            await pull(store, [Source(honest, digest(b"guess"))], list(PIECES), max_frame=MiB)
        nursery.cancel_scope.cancel()
    assert "refused the grant" in failed.value.pulled.dropped[0]
    assert store.statistics().blobs == 0


# --- real sizes ------------------------------------------------------------------------------


@pytest.mark.slow
def test_600_mib_survives_a_failover_through_the_standby_bit_identically(tmp_path):
    rows, cols = 600 * MiB // (2048 * 4), 2048
    with (
        host(tmp_path, "primary") as (primary, proc),
        host(tmp_path, "standby") as (standby, _),
        host(tmp_path, "fresh") as (fresh, fresh_proc),
    ):
        attached = remote.attach(primary, reconnect=dial(fresh), standby=standby)
        with attached as session, torch.no_grad():
            src = torch.empty(rows, cols).uniform_(generator=torch.Generator().manual_seed(5))
            on_host = src.to("cumulus")
            on_host[0, :4] += 1.0
            session.checkpoint()
            on_host[1, :4] *= 2.0  # after the checkpoint: the log replays it
            expected = src.clone()
            expected[0, :4] += 1.0
            expected[1, :4] *= 2.0
            before = reset_peak(fresh_proc.pid)
            proc.kill()
            proc.wait()
            back = on_host.cpu()
            stats = session.failover_statistics()
            grown = peak_since_reset(fresh_proc.pid) - before
    assert torch.equal(back, expected)
    assert stats.cold_restores == 1 and stats.checkpoint_read_bytes == 0
    assert stats.restore_pulled_bytes >= 600 * MiB  # from the standby, not the consumer
    # The fresh host holds the tensor, plus a bounded window of pieces in flight.
    assert grown <= 600 * MiB + 160 * MiB


def test_a_standby_keeps_no_more_than_its_lease_lends_and_the_checkpoint_before_stays(tmp_path):
    store = BlobStore(tmp_path / "blobs", 64 * MiB)
    pieces = [bytes([i]) * MiB for i in range(3)]
    names = [digest(memoryview(piece)) for piece in pieces]
    for name, piece in zip(names, pieces, strict=True):
        assert store.put(name, memoryview(piece))
    ctx = DeviceContext(torch.device("cpu"), blobs=store)
    standby = ExecutorSession(ctx, quota_bytes=1, hold_bytes=2 * MiB)
    assert standby.hold(names[:2]) == 2
    with pytest.raises(StandbyFullError, match="lease a larger standby"):
        standby.hold(names)  # 3 MiB: more than the lease lends
    assert standby.kept.piece(names[0]) == pieces[0] and standby.kept.piece(names[2]) is None
    assert standby.stats.held_bytes == 2 * MiB  # what the provider's status shows


def test_a_standby_holds_no_bytes_until_it_holds_a_checkpoint(tmp_path):
    ctx = DeviceContext(torch.device("cpu"), blobs=BlobStore(tmp_path / "blobs", MiB))
    assert ExecutorSession(ctx, quota_bytes=1, hold_bytes=MiB).stats.held_bytes == 0


class OutgrownStandby:
    """A standby whose lease is too small for the session's checkpoints: it welcomes the
    session, then answers every pull that the checkpoint needs ``needed`` bytes."""

    peer_address = "127.0.0.1:9"

    def __init__(self, needed: int) -> None:
        self.needed = needed
        self._answers: list[list] = []

    def send_frame(self, parts) -> None:
        header, _ = decode_frame(bytearray(b"".join(bytes(p) for p in parts)))
        if header[0] == "hello":
            self._answers.append(["welcome", PROTOCOL_VERSION, {"token": "t" * 32}])
        elif header[0] == "pull":
            why = "the checkpoint is more than this standby is leased to keep"
            self._answers.append(["pulled", {"error": why, "needed_bytes": self.needed}])

    def recv_frame(self) -> bytearray:
        return bytearray(b"".join(bytes(p) for p in encode_frame(self._answers.pop(0))))

    def close(self) -> None:
        pass


@pytest.mark.slow
def test_a_checkpoint_that_outgrows_its_standby_gets_a_larger_one(tmp_path):
    asked: list[tuple[str, int]] = []
    with host(tmp_path, "primary") as (primary, _), host(tmp_path, "larger") as (larger, _):

        def replace(why: str, gib: int):
            asked.append((why, gib))
            return dial(larger)()

        outgrown = OutgrownStandby(needed=3 * 2**30)
        attached = remote.attach(
            primary, reconnect=dial(primary), standby=outgrown, replace_standby=replace
        )
        with attached as session:
            weights = torch.ones(1024).to("cumulus")
            session.checkpoint()
            session.wait_for_standby()  # the copy fails: the standby is outgrown
            weights += 1
            assert isinstance(session.checkpoint(), HostCheckpoint)
            assert session.wait_for_standby() is not None  # the larger one holds it
    ((why, gib),) = asked
    assert "outgrew the standby" in why
    assert gib == 5  # 3 GiB and half as much again, rounded up
