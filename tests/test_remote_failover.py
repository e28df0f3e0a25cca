"""Failover: a session survives its executor vanishing, and the executor keeps sessions whose
consumer vanished. Hosts are real executor processes; "vanishing" is SIGKILL or a cut socket.
"""

from __future__ import annotations

import os
import socket
import time
from contextlib import contextmanager

import pytest
import torch

import cumulus_p2p.remote as remote
from cumulus_p2p._errors import (
    CheckpointCorruptError,
    FailoverError,
    RemoteExecutionError,
    RemoteProtocolError,
    SessionClosedError,
)
from cumulus_p2p.blobs.names import PIECE, digest
from cumulus_p2p.channel.secure import connect_secure
from cumulus_p2p.channel.transport import SocketFrameChannel
from cumulus_p2p.host.hostcache import HostCache
from cumulus_p2p.host.session import Batch, DeviceContext, ExecutorSession
from cumulus_p2p.identity import NodeIdentity
from cumulus_p2p.remote.checkpoint import (
    Checkpoint,
    DirectoryCheckpointStore,
    StorageImage,
)
from cumulus_p2p.remote.client import RemoteSession
from cumulus_p2p.remote.failover import CheckpointPolicy, ImageAssembler, ReplayLog, plan_reads
from cumulus_p2p.testing.executor import executor_process
from cumulus_p2p.testing.models import TASKS
from cumulus_p2p.wire.manifest import Manifest, StorageEntry
from cumulus_p2p.wire.protocol import (
    PROTOCOL_VERSION,
    CpuTensorRef,
    TensorRef,
    decode_frame,
    encode_frame,
)

# Starts executor processes and kills them: scripts/test --fast skips it.
pytestmark = pytest.mark.slow

# --- helpers -------------------------------------------------------------------------------

CONSUMER = NodeIdentity.generate()
CONSUMER_KEY = CONSUMER.public_key.hex()


def dial(address: str):
    """A ``reconnect`` callable: a fresh plain-TCP channel to ``address`` per call."""
    host, port = address.split(":")
    return lambda: SocketFrameChannel.connect(host, int(port))


def cuttable(address: str) -> tuple[SocketFrameChannel, socket.socket]:
    """A channel and its socket; ``sock.shutdown(SHUT_RDWR)`` is a network cut."""
    host, port = address.split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.settimeout(None)
    return SocketFrameChannel(sock), sock


class KillOnSend:
    """A channel that SIGKILLs its executor just before the send after ``arm()``, so the
    frame goes out to a dead host and the client is left waiting for its reply."""

    def __init__(self, inner: SocketFrameChannel, proc) -> None:
        self.inner, self.proc, self.armed = inner, proc, False
        self.max_frame = inner.max_frame

    def arm(self) -> None:
        self.armed = True

    def send_frame(self, parts) -> None:
        if self.armed:
            self.armed = False
            self.proc.kill()
            self.proc.wait()
        self.inner.send_frame(parts)

    def recv_frame(self) -> bytearray:
        return self.inner.recv_frame()

    def close(self) -> None:
        self.inner.close()


def kill(proc) -> None:
    proc.kill()
    proc.wait()


def train_steps(task: str, steps: int, on_step=lambda i: None):
    """``testing.models.train`` on cumulus, with a hook after each step."""
    spec = TASKS[task]
    torch.manual_seed(0)
    model = spec.make_model().to("cumulus")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(2)
    torch.manual_seed(1)
    losses = []
    for i in range(steps):
        x, y = spec.make_batch(gen)
        x, y = x.to("cumulus"), y.to("cumulus")
        opt.zero_grad()
        loss = spec.loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        on_step(i)
    return losses, {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def assert_bit_identical(got, expected) -> None:
    (losses, params), (ref_losses, ref_params) = got, expected
    assert losses == ref_losses
    assert params.keys() == ref_params.keys()
    for name, value in ref_params.items():
        assert torch.equal(params[name], value), name


@pytest.fixture(scope="module")
def standby():
    """The replacement host failover moves sessions to."""
    with executor_process(device="cpu", quota="2GiB") as (address, _proc):
        yield address


@pytest.fixture
def doomed():
    """A host that a test kills."""
    with executor_process(device="cpu", quota="2GiB") as running:
        yield running


@pytest.fixture(scope="module")
def uninterrupted(executor_address):
    """The transformer run that nothing happens to: the result failover must reproduce."""
    with remote.attach(executor_address):
        return train_steps("transformer", 6)


# --- the host vanishes: SIGKILL --------------------------------------------------------------


@pytest.mark.parametrize(
    ("interval", "checkpoint_at"),
    [(None, None), (0.0, None), (None, 1)],
    ids=["replay_from_start", "checkpoint_every_sync", "checkpoint_on_demand"],
)
def test_training_killed_mid_run_finishes_on_a_second_host_bit_identically(
    doomed, standby, uninterrupted, interval, checkpoint_at
):
    address, proc = doomed
    channel = dial(address)()
    with remote.attach(
        channel=channel, reconnect=dial(standby), checkpoint_interval=interval
    ) as session:

        def on_step(i: int) -> None:
            if i == checkpoint_at:
                session.checkpoint()
            if i == 3:
                kill(proc)

        result = train_steps("transformer", 6, on_step)
        assert session.failovers == 1
        assert session.failover_statistics().cold_restores == 1
    assert_bit_identical(result, uninterrupted)


@contextmanager
def secure_executor(tmp_path, name: str):
    """An executor serving the secure channel to ``CONSUMER``; yields a dialer and the proc."""
    extra = ["--secure", "--data-dir", str(tmp_path / name), "--allow-key", CONSUMER_KEY]
    with executor_process(extra=extra) as (address, proc):
        host, port = address.split(":")
        key = proc.provider_key

        def connect():
            return connect_secure(
                host,
                int(port),
                identity=CONSUMER,
                expected_peer_public_key=key,
                resume_timeout=0.5,
            )

        yield connect, proc


def test_training_over_the_secure_channel_survives_its_host_being_killed(tmp_path, uninterrupted):
    with (
        secure_executor(tmp_path, "a") as (to_a, proc),
        secure_executor(tmp_path, "b") as (to_b, _),
    ):
        with remote.attach(channel=to_a(), reconnect=to_b, checkpoint_interval=0.0) as session:
            result = train_steps("transformer", 6, lambda i: kill(proc) if i == 2 else None)
            assert session.failovers == 1
    assert_bit_identical(result, uninterrupted)


def test_a_query_sent_to_a_dying_host_is_answered_by_the_replacement(doomed, standby):
    address, proc = doomed
    channel = KillOnSend(dial(address)(), proc)
    with remote.attach(channel=channel, reconnect=dial(standby)) as session:
        x = torch.arange(10.0, device="cumulus") * 3
        channel.arm()
        assert x.sum().item() == 135.0
        assert session.failovers == 1
        assert session.last_failover_s is not None


def test_random_draws_continue_the_same_stream_after_failover(executor_address, doomed, standby):
    def draws(between=lambda session: None, **attach):
        with remote.attach(**attach) as session:
            torch.manual_seed(5)
            first = torch.rand(4, device="cumulus").cpu()
            between(session)
            return (
                first,
                torch.rand(4, device="cumulus").cpu(),
                torch.randn(3, device="cumulus").cpu(),
            )

    def checkpoint_then_kill(session):
        session.checkpoint()
        kill(proc)

    expected = draws(address=executor_address)
    address, proc = doomed
    got = draws(checkpoint_then_kill, channel=dial(address)(), reconnect=dial(standby))
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


def test_checkpoints_kept_on_disk_restore_the_session(doomed, standby, tmp_path):
    address, proc = doomed
    store = DirectoryCheckpointStore(tmp_path)
    with remote.attach(
        channel=dial(address)(), reconnect=dial(standby), checkpoint_store=store
    ) as session:
        weights = torch.linspace(0, 1, 1000, device="cumulus")
        session.checkpoint()
        assert store.path.exists()
        kill(proc)
        assert (weights * 2).sum().item() == pytest.approx(1000.0)
        assert session.failovers == 1


def test_a_cold_restore_starts_the_checkpoint_interval_over(doomed, standby):
    address, proc = doomed
    with remote.attach(
        channel=dial(address)(), reconnect=dial(standby), checkpoint_interval=3.0
    ) as session:
        weights = torch.ones(1000, device="cumulus")
        session.checkpoint()
        weights += 1
        # The interval has passed when the host dies; one as long again, under a loaded
        # machine's slowest failover, has not when the failover ends.
        time.sleep(3.1)
        kill(proc)
        assert weights.sum().item() == 2000  # fails over: restore, replay, this sync point
        stats = session.failover_statistics()
        assert (stats.cold_restores, stats.checkpoints) == (1, 1)


def test_without_reconnect_a_killed_host_raises_session_closed(doomed):
    address, proc = doomed
    with remote.attach(address):
        x = torch.ones(3, device="cumulus")
        kill(proc)
        with pytest.raises(SessionClosedError) as info:
            x.sum().item()
        assert not isinstance(info.value, FailoverError)


def test_failover_gives_up_with_failover_error_when_no_host_answers(doomed):
    address, proc = doomed
    calls = []

    def nowhere():
        calls.append(1)
        raise ConnectionRefusedError("no host")

    with remote.attach(channel=dial(address)(), reconnect=nowhere) as session:
        x = torch.ones(3, device="cumulus")
        kill(proc)
        with pytest.raises(FailoverError, match="3 failover attempts failed"):
            x.sum().item()
        assert session.closed
    assert len(calls) == 3


def test_detaching_from_a_dead_host_does_not_fail_over(doomed):
    address, proc = doomed
    calls = []
    with remote.attach(channel=dial(address)(), reconnect=lambda: calls.append(1)):
        torch.ones(3, device="cumulus").sum()
        kill(proc)
    assert calls == []


def test_periodic_checkpoints_keep_the_replay_log_short(executor_address):
    with remote.attach(
        channel=dial(executor_address)(),
        reconnect=dial(executor_address),
        checkpoint_interval=0.0,
    ) as session:
        x = torch.ones(100, device="cumulus")
        for _ in range(3):
            x = x * 2
            x.sum().item()
        stats = session.failover_statistics()
        assert stats.checkpoints == 3
        assert stats.log_frames == 0
        assert stats.checkpoint_bytes >= 400


def test_a_full_replay_log_forces_a_checkpoint_without_a_sync_point(executor_address):
    connect = dial(executor_address)
    session = RemoteSession(connect(), reconnect=connect, max_log_bytes=4096)
    try:
        upload = session.add_blob(torch.zeros(2048))  # 8 KiB: past the bound in one batch
        session.submit(
            ["aten.clone.default", [upload], {}, [[session.new_handle(), [2048], [1], 0]]]
        )
        session.flush()
        stats = session.failover_statistics()
        assert (stats.checkpoints, stats.log_frames, stats.checkpoint_bytes) == (1, 0, 8192)
    finally:
        session.close()


def test_checkpoint_options_without_reconnect_are_refused(executor_address):
    channel = dial(executor_address)()
    with pytest.raises(ValueError, match="reconnect"):
        RemoteSession(channel, checkpoint_interval=1.0)
    channel.close()


# --- the connection drops, the host lives: the host-side cache -------------------------------


def test_cut_connection_resumes_from_the_host_cache_without_upload(executor_address):
    channel, sock = cuttable(executor_address)
    with remote.attach(channel=channel, reconnect=dial(executor_address)) as session:
        x = torch.arange(10.0, device="cumulus")
        assert x.sum().item() == 45.0
        sock.shutdown(socket.SHUT_RDWR)
        assert (x * 2).sum().item() == 90.0
        stats = session.failover_statistics()
        assert (stats.cache_resumes, stats.cold_restores) == (1, 0)


def test_a_compiled_run_resumes_from_the_host_cache_with_its_graphs(executor_address):
    def train(cut_at: int | None = None):
        channel, sock = cuttable(executor_address)
        with remote.attach(channel=channel, reconnect=dial(executor_address)) as session:
            torch.manual_seed(0)
            model = torch.nn.Sequential(
                torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
            ).to("cumulus")
            opt = torch.optim.Adam(model.parameters())
            forward, step = torch.compile(model), torch.compile(opt.step)
            gen = torch.Generator().manual_seed(0)
            losses = []
            for k in range(5):
                if k == cut_at:
                    sock.shutdown(socket.SHUT_RDWR)
                loss = forward(torch.randn(4, 8, generator=gen).to("cumulus")).square().mean()
                loss.backward()
                step()
                opt.zero_grad()
                losses.append(loss.item())
            return losses, session.failover_statistics(), session.graphs_defined

    uncut, _, _ = train()
    cut, stats, graphs = train(cut_at=3)
    assert cut == uncut
    assert (stats.cache_resumes, stats.cold_restores) == (1, 0)
    assert graphs == 3  # forward, backward, optimizer step: each defined once


class LostOnFirstRead:
    """Answers the first checkpoint read as a provider's supervisor does when the worker
    running the session dies meanwhile: a ``lost`` message, and the connection gone."""

    def __init__(self, inner: SocketFrameChannel) -> None:
        self.inner = inner
        self.max_frame = inner.max_frame
        self.reply: bytes | None = None
        self.reads = 0

    def send_frame(self, parts) -> None:
        header, _ = decode_frame(bytearray(b"".join(bytes(p) for p in parts)))
        query = header[4] if header[0] == "batch" else None
        if self.reads == 0 and isinstance(query, list) and query[:1] == ["read"]:
            self.reads += 1
            self.inner.close()
            lost = ["lost", "the worker process running it was killed", "host"]
            self.reply = b"".join(bytes(p) for p in encode_frame(lost))
            return
        self.inner.send_frame(parts)

    def recv_frame(self) -> bytearray:
        if self.reply is not None:
            reply, self.reply = self.reply, None
            return bytearray(reply)
        return self.inner.recv_frame()

    def close(self) -> None:
        self.inner.close()


def test_a_host_lost_while_a_checkpoint_is_read_fails_over(executor_address):
    channel = LostOnFirstRead(dial(executor_address)())
    with remote.attach(
        channel=channel, reconnect=dial(executor_address), checkpoint_interval=0.0
    ) as session:
        x = torch.arange(10.0, device="cumulus")
        assert x.sum().item() == 45.0  # a sync point: the checkpoint's read meets "lost"
        assert (x * 2).sum().item() == 90.0
        assert channel.reads == 1
        assert session.failovers == 1


def test_cut_while_waiting_for_a_reply_still_gets_that_reply(executor_address):
    channel, sock = cuttable(executor_address)

    class CutOnRecv:
        max_frame = channel.max_frame
        armed = False

        def send_frame(self, parts):
            channel.send_frame(parts)

        def recv_frame(self):
            if self.armed:  # the reply is lost with the connection
                self.armed = False
                sock.shutdown(socket.SHUT_RDWR)
                raise SessionClosedError("connection to executor lost")
            return channel.recv_frame()

        def close(self):
            channel.close()

    cutting = CutOnRecv()
    with remote.attach(channel=cutting, reconnect=dial(executor_address)) as session:
        x = torch.arange(10.0, device="cumulus")
        cutting.armed = True
        assert (x + 1).sum().item() == 55.0
        assert session.failover_statistics().cache_resumes == 1


def test_resume_takes_over_a_session_whose_old_connection_still_looks_alive(executor_address):
    old_channel = dial(executor_address)()
    old = RemoteSession(old_channel)
    handle = old.new_handle()
    old.submit(["aten.ones.default", [[3]], {}, [[handle, [3], [1], 0]]])
    old.synchronize()  # batch 1: the op and a sync
    new = dial(executor_address)()
    welcome = _exchange(new, ["resume", PROTOCOL_VERSION, {"token": old.info["token"]}])
    assert welcome[2]["resumed"] and welcome[2]["last_seq"] == 1
    fetch = ["batch", 2, [], [], ["fetch", TensorRef(handle, torch.float32, 0, (3,), (1,))], []]
    new.send_frame(encode_frame(fetch))
    header, area = decode_frame(new.recv_frame())
    assert header[:3] == ["reply", 2, None]
    assert torch.equal(torch.frombuffer(bytearray(area[:12]), dtype=torch.float32), torch.ones(3))
    with pytest.raises(SessionClosedError):
        old_channel.recv_frame()  # the executor let go of the old connection
    new.close()
    old_channel.close()


def test_with_the_cache_off_a_cut_session_is_restored_cold():
    with executor_process(device="cpu", extra=["--cache-grace", "0"]) as (address, _proc):
        channel, sock = cuttable(address)
        with remote.attach(channel=channel, reconnect=dial(address)) as session:
            x = torch.arange(10.0, device="cumulus")
            session.checkpoint()
            sock.shutdown(socket.SHUT_RDWR)
            assert (x * 2).sum().item() == 90.0
            stats = session.failover_statistics()
            assert (stats.cache_resumes, stats.cold_restores) == (0, 1)


def _raw(address: str) -> SocketFrameChannel:
    return dial(address)()


def _exchange(channel: SocketFrameChannel, header: list) -> list:
    channel.send_frame(encode_frame(header))
    return decode_frame(channel.recv_frame())[0]


def test_unknown_session_token_is_refused_and_the_connection_can_still_say_hello(
    executor_address,
):
    channel = _raw(executor_address)
    refused = _exchange(channel, ["resume", PROTOCOL_VERSION, {"token": "00" * 16}])
    assert refused[0] == "refused"
    assert "unknown or expired session token" in refused[1]
    welcome = _exchange(channel, ["hello", PROTOCOL_VERSION, {}])
    assert welcome[0] == "welcome" and isinstance(welcome[2]["token"], str)
    channel.close()


def test_token_of_a_session_that_said_bye_is_refused(executor_address):
    with remote.attach(executor_address) as session:
        token = session.info["token"]
    channel = _raw(executor_address)
    assert _exchange(channel, ["resume", PROTOCOL_VERSION, {"token": token}])[0] == "refused"
    channel.close()


@pytest.mark.parametrize("options", [{}, {"token": 5}, {"token": "x" * 65}])
def test_malformed_resume_is_a_fatal_protocol_error(executor_address, options):
    channel = _raw(executor_address)
    fatal = _exchange(channel, ["resume", PROTOCOL_VERSION, options])
    assert fatal[0] == "fatal" and "token from welcome" in fatal[1]
    channel.close()


# --- restore records: bad input is refused, the session survives ----------------------------


def _restore_record(handle, dtype, nbytes, start, data_len, blob=0) -> list:
    data = CpuTensorRef(torch.uint8, (data_len,), blob)
    return ["@restore", [handle, dtype, nbytes, start, data], {}, None]


def _named_restore(nbytes, start, name) -> list:
    return ["@restore", [7, torch.float32, nbytes, start, name], {}, None]


def _refused(session: RemoteSession, ops: list, blobs: list[bytes], kind: str) -> str:
    for record in ops:
        session.submit(record)
    for blob in blobs:
        session.add_blob(torch.tensor(list(blob), dtype=torch.uint8))
    with pytest.raises(RemoteExecutionError) as info:
        session.synchronize()
    assert info.value.remote_type == kind
    session.synchronize()  # reported once; the session carries on
    return str(info.value)


@pytest.fixture
def raw_session(executor_address):
    session = RemoteSession(dial(executor_address)(), quota_bytes=1 << 20)
    yield session
    session.close()


@pytest.mark.parametrize(
    ("record", "kind", "words"),
    [
        (_restore_record(0, torch.float32, 8, 0, 8), "InvalidHandleError", "bad handle"),
        (_restore_record(-4, torch.float32, 8, 0, 8), "InvalidHandleError", "bad handle"),
        (_restore_record(2**62, torch.float32, 8, 0, 8), "InvalidHandleError", "bad handle"),
        (_restore_record("7", torch.float32, 8, 0, 8), "InvalidHandleError", "bad handle"),
        (_restore_record(7, "float", 8, 0, 8), "TypeError", "dtype"),
        (_restore_record(7, torch.float32, 4, 0, 8), "IndexError", "out of bounds"),
        (_restore_record(7, torch.float32, 8, 4, 8), "IndexError", "out of bounds"),
        (_restore_record(7, torch.float32, -8, 0, 8), "ValueError", "non-negative"),
        (_restore_record(7, torch.float32, 8, 0, 9), "RemoteProtocolError", "does not match"),
        (_restore_record(7, torch.float32, 8, 0, 8, blob=3), "RemoteProtocolError", "blob"),
        (_restore_record(9, torch.float32, 16, 8, 8), "InvalidHandleError", "byte 0"),
        (_restore_record(7, torch.float32, 1 << 30, 0, 8), "OutOfMemoryError", "quota"),
        (["@restore", [7, torch.float32, 8], {}, None], "RemoteProtocolError", "takes"),
        (_named_restore(8, 0, "ab" * 32), "RemoteProtocolError", "does not hold blob"),
        (_named_restore(8, 4, "ab" * 32), "IndexError", "multiple of"),
        (_named_restore(8, 0, "not a name"), "RemoteProtocolError", "a piece's name"),
    ],
    ids=[
        "handle_zero",
        "handle_negative",
        "handle_too_large",
        "handle_not_int",
        "dtype_not_dtype",
        "piece_past_declared_size",
        "piece_past_end",
        "negative_size",
        "blob_size_lies",
        "missing_blob",
        "continuation_of_unknown_storage",
        "over_quota",
        "too_few_fields",
        "named_piece_not_held",
        "named_piece_not_at_a_piece_boundary",
        "data_neither_bytes_nor_name",
    ],
)
def test_bad_restore_record_is_refused_with_a_clear_error(raw_session, record, kind, words):
    message = _refused(raw_session, [record], [bytes(8)], kind)
    assert words in message


def test_restore_into_a_handle_in_use_is_refused(raw_session):
    record = _restore_record(11, torch.float32, 8, 0, 8)
    raw_session.submit(record)
    raw_session.add_blob(torch.zeros(8, dtype=torch.uint8))
    raw_session.synchronize()
    assert "already in use" in _refused(raw_session, [record], [bytes(8)], "InvalidHandleError")


def test_restore_continuation_must_repeat_size_and_dtype(raw_session):
    raw_session.submit(_restore_record(12, torch.float32, 16, 0, 8))
    raw_session.add_blob(torch.zeros(8, dtype=torch.uint8))
    raw_session.synchronize()
    wrong = _restore_record(12, torch.float64, 16, 8, 8)
    assert "holds 16 bytes" in _refused(raw_session, [wrong], [bytes(8)], "ValueError")


@pytest.mark.parametrize("length", [0, 16, 5057])
def test_rng_state_of_the_wrong_size_is_refused(raw_session, length):
    record = ["@rng", [CpuTensorRef(torch.uint8, (length,), 0)], {}, None]
    assert "does not fit" in _refused(raw_session, [record], [bytes(length)], "ValueError")


def test_rng_state_of_the_right_size_but_garbage_is_refused(raw_session):
    size = torch.Generator().get_state().numel()
    record = ["@rng", [CpuTensorRef(torch.uint8, (size,), 0)], {}, None]
    message = _refused(raw_session, [record], [bytes([7]) * size], "ValueError")
    assert "not a valid generator state" in message


def test_restored_storage_reads_back_as_its_bytes(raw_session):
    values = torch.arange(4, dtype=torch.float32)
    raw_session.submit(_restore_record(21, torch.float32, 16, 0, 8))
    raw_session.submit(_restore_record(21, torch.float32, 16, 8, 8, blob=1))
    raw_bytes = values.view(torch.uint8)
    raw_session.add_blob(raw_bytes[:8])
    raw_session.add_blob(raw_bytes[8:])
    data = raw_session.fetch(TensorRef(21, torch.float32, 0, (4,), (1,)))
    assert torch.equal(torch.frombuffer(bytearray(data), dtype=torch.float32), values)


# --- sans-IO cores ---------------------------------------------------------------------------


def _batch(seq: int, ops: list, query=None, blobs=()) -> Batch:
    return Batch(seq, ops, [], query, [memoryview(bytearray(b)) for b in blobs])


def test_executor_session_checkpoint_and_restore_round_trip():
    ctx = DeviceContext(torch.device("cpu"))
    source = ExecutorSession(ctx, quota_bytes=1 << 20)
    source.run_batch(_batch(1, [["aten.randn.default", [[5]], {}, [[3, [5], [1], 0]]]]))
    manifest = source.run_batch(_batch(2, [], ["checkpoint"]))
    ((handle, dtype, nbytes, (name,)),) = manifest.result["storages"]
    data = source.run_batch(_batch(3, [], ["read", [[handle, 0, nbytes]]])).blobs[0]
    assert digest(data) == name
    after = source.run_batch(_batch(4, [["aten.rand.default", [[3]], {}, [[4, [3], [1], 0]]]]))
    assert after is None

    target = ExecutorSession(DeviceContext(torch.device("cpu")), quota_bytes=1 << 20)
    restore = [
        _restore_record(handle, dtype, nbytes, 0, nbytes),
        ["@rng", [CpuTensorRef(torch.uint8, (len(manifest.blobs[0]),), 1)], {}, None],
        ["aten.rand.default", [[3]], {}, [[4, [3], [1], 0]]],
    ]
    reply = target.run_batch(_batch(2, restore, ["sync"], [bytes(data), bytes(manifest.blobs[0])]))
    assert reply.error is None
    for handle_ in (3, 4):
        assert torch.equal(target.snapshot_storages()[handle_], source.snapshot_storages()[handle_])


def test_executor_session_resends_only_its_latest_reply():
    session = ExecutorSession(DeviceContext(torch.device("cpu")), quota_bytes=1 << 20)
    session.run_batch(_batch(1, [["aten.ones.default", [[2]], {}, [[1, [2], [1], 0]]]]))
    first = session.run_batch(_batch(2, [], ["fetch", TensorRef(1, torch.float32, 0, (2,), (1,))]))
    again = session.resend(2)
    assert bytes(again.blobs[0]) == bytes(first.blobs[0])
    with pytest.raises(RemoteProtocolError):
        session.resend(1)


def test_parking_keeps_the_session_random_stream():
    ctx = DeviceContext(torch.device("cpu"))
    parked = ExecutorSession(ctx, quota_bytes=1 << 20)
    other = ExecutorSession(ctx, quota_bytes=1 << 20)
    draw = ["aten.rand.default", [[4]], {}, None]
    parked.run_batch(_batch(1, [["@seed", [3], {}, None]]))
    parked.park()
    other.run_batch(_batch(1, [draw] * 5))  # another tenant draws meanwhile
    parked.unpark()
    parked.run_batch(_batch(2, [["aten.rand.default", [[4]], {}, [[1, [4], [1], 0]]]]))
    torch.manual_seed(3)
    assert torch.equal(parked.snapshot_storages()[1], torch.rand(4))


def test_host_cache_returns_a_parked_value_once():
    cache: HostCache[str] = HostCache(max_bytes=100, grace=10)
    assert cache.park("t", "session", 10, now=0) == []
    assert cache.take("t", now=5) == "session"
    assert cache.take("t", now=5) is None


def test_host_cache_drops_entries_after_their_grace_period():
    cache: HostCache[str] = HostCache(max_bytes=100, grace=10)
    cache.park("t", "session", 10, now=0)
    assert cache.take("t", now=10) is None
    assert cache.expire(now=10) == ["session"]
    assert cache.statistics().bytes == 0


def test_host_cache_evicts_the_oldest_to_stay_within_its_bytes():
    cache: HostCache[str] = HostCache(max_bytes=100, grace=10)
    cache.park("a", "A", 60, now=0)
    cache.park("b", "B", 30, now=1)
    assert cache.park("c", "C", 50, now=2) == ["A"]
    assert "b" in cache and "c" in cache


def test_host_cache_names_the_oldest_holding_memory_to_move_to_disk_before_a_newcomer():
    cache: HostCache[str] = HostCache(max_bytes=100, grace=10)
    cache.park("a", "A", 60, now=0)
    cache.park("b", "B", 30, now=1)
    assert cache.crowding(50) == [("a", "A")]
    cache.demoted("a", "A")
    assert cache.park("c", "C", 50, now=2) == []  # nothing dropped: A is on disk
    assert cache.statistics().bytes == 80 and "a" in cache
    assert cache.take("a", now=3) == "A"


def test_host_cache_names_none_to_move_when_the_newcomer_fits_or_never_could():
    cache: HostCache[str] = HostCache(max_bytes=100, grace=10)
    cache.park("a", "A", 60, now=0)
    assert cache.crowding(40) == []
    assert cache.crowding(101) == []


def test_host_cache_passes_by_entries_on_disk_and_ignores_a_demotion_after_a_take():
    cache: HostCache[str] = HostCache(max_bytes=100, grace=10)
    cache.park("a", "A", 60, now=0)
    cache.demoted("a", "A")
    cache.park("b", "B", 60, now=1)
    assert cache.crowding(60) == [("b", "B")]
    assert cache.take("b", now=2) == "B"
    cache.demoted("b", "B")  # taken meanwhile: nothing to record
    assert cache.statistics().bytes == 0


def test_host_cache_refuses_what_it_cannot_hold():
    assert HostCache(max_bytes=100, grace=10).park("t", "S", 101, now=0) == ["S"]
    assert HostCache(max_bytes=100, grace=0).park("t", "S", 1, now=0) == ["S"]


def test_host_cache_gives_a_session_only_to_its_owner():
    cache: HostCache[str] = HostCache(max_bytes=100, grace=10)
    cache.park("t", "S", 1, now=0, owner=b"alice")
    assert cache.take("t", now=1, owner=b"mallory") is None
    assert cache.take("t", now=1, owner=b"alice") == "S"


def test_replay_log_keeps_frames_after_the_checkpoint_only():
    log = ReplayLog()
    for seq in (1, 2, 3):
        log.record(seq, [b"frame", memoryview(bytes([seq]))], has_query=seq == 2)
    log.reset(2)
    assert [(f.seq, f.frame) for f in log.since(0)] == [(3, b"frame\x03")]
    assert (log.after_seq, log.nbytes) == (2, 6)


def test_checkpoint_policy_waits_for_a_sync_point_after_its_interval():
    policy = CheckpointPolicy(interval=10, max_log_bytes=1000, last=0)
    assert not policy.due(now=5, log_bytes=10, at_sync_point=True)
    assert not policy.due(now=15, log_bytes=10, at_sync_point=False)
    assert policy.due(now=15, log_bytes=10, at_sync_point=True)
    assert not policy.due(now=15, log_bytes=0, at_sync_point=True)


def test_checkpoint_policy_forces_a_checkpoint_when_the_log_is_full():
    policy = CheckpointPolicy(interval=None, max_log_bytes=1000)
    assert policy.due(now=0, log_bytes=1000, at_sync_point=False)


def _entry(handle: int, data: bytes) -> StorageEntry:
    image = StorageImage.of(handle, torch.uint8, data)
    return StorageEntry(handle, torch.uint8, len(data), image.digests)


def test_reads_are_planned_within_the_budget_and_cover_every_byte():
    manifest = Manifest("cpu", memoryview(b""), (_entry(1, bytes(10)), _entry(2, bytes(25))))
    plan = plan_reads(manifest, lambda name: False, budget=8)
    assert all(sum(length for _, _, length in query) <= 8 for query in plan)
    covered = {(h, s + i) for query in plan for h, s, n in query for i in range(n)}
    assert covered == {(1, i) for i in range(10)} | {(2, i) for i in range(25)}


def test_reads_leave_out_the_pieces_already_held():
    frozen, changed = bytes(PIECE) + b"\x01" * 10, b"\x02" * 10
    manifest = Manifest("cpu", memoryview(b""), (_entry(1, frozen), _entry(2, changed)))
    held = set(manifest.storages[0].digests[:1])  # the frozen storage's first piece
    plan = plan_reads(manifest, held.__contains__, budget=PIECE)
    assert plan == [[[1, PIECE, 10], [2, 0, 10]]]


def test_a_read_piece_that_does_not_match_its_digest_is_refused():
    manifest = Manifest("cpu", memoryview(b""), (_entry(1, b"honest bytes"),))
    images = ImageAssembler(manifest, lambda name: None)
    with pytest.raises(RemoteProtocolError, match="do not match their digest"):
        images.add([[1, 0, 12]], [memoryview(b"forged bytes")])


def test_an_image_reuses_held_pieces_without_copying_them():
    data = bytes(range(256)) * 10
    manifest = Manifest("cpu", memoryview(b""), (_entry(1, data),))
    held = memoryview(data)
    images = ImageAssembler(manifest, {digest(data): held}.get)
    (image,) = images.checkpoint(5).storages
    assert image.pieces[0].obj is held.obj


def test_checkpoints_read_only_what_changed_since_the_last_one(executor_address):
    with remote.attach(
        channel=dial(executor_address)(), reconnect=dial(executor_address)
    ) as session:
        frozen = torch.randn(3 * PIECE // 4, device="cumulus")  # 3 pieces, never written
        adapter = torch.zeros(1000, device="cumulus")
        session.checkpoint()
        first = session.failover_statistics()
        adapter += 1
        session.checkpoint()
        second = session.failover_statistics()
        assert first.checkpoint_read_bytes == first.checkpoint_bytes >= 3 * PIECE
        assert second.checkpoint_read_bytes == 4000
        assert (frozen.sum() * 0 + adapter.sum()).item() == 1000


@pytest.mark.parametrize("on_disk", [False, True], ids=["memory", "disk"])
def test_a_checkpoint_after_an_upload_reads_back_only_what_changed_since(
    executor_address, tmp_path, on_disk
):
    store = DirectoryCheckpointStore(tmp_path) if on_disk else None
    with remote.attach(
        channel=dial(executor_address)(),
        reconnect=dial(executor_address),
        checkpoint_store=store,
    ) as session:
        weights = torch.ones(5 * PIECE // 16).to("cumulus")  # 1.25 pieces
        session.checkpoint()
        untouched = session.failover_statistics().checkpoint_read_bytes
        weights[-10:] += 1  # the second piece only
        session.checkpoint()
        second = session.failover_statistics().checkpoint_read_bytes
        assert weights.sum().item() == 5 * PIECE // 16 + 10
    assert (untouched, second) == (0, PIECE // 4)


def test_a_checkpoint_due_during_an_upload_is_taken_as_it_ends_reading_nothing_back(
    executor_address,
):
    with remote.attach(
        channel=dial(executor_address)(), reconnect=dial(executor_address), checkpoint_interval=0
    ) as session:
        weights = torch.ones(5 * PIECE // 16).to("cumulus")
        stats = session.failover_statistics()  # before any op that could change the weights
        assert (stats.checkpoints, stats.checkpoint_read_bytes) == (1, 0)
        assert stats.checkpoint_bytes == 5 * PIECE // 4
        assert weights.sum().item() == 5 * PIECE // 16


def test_a_second_session_on_the_same_checkpoint_directory_reads_nothing_it_holds(
    executor_address, tmp_path
):
    data = torch.arange(PIECE // 4, dtype=torch.float32)
    read = []
    for _ in range(2):
        with remote.attach(
            channel=dial(executor_address)(),
            reconnect=dial(executor_address),
            checkpoint_store=DirectoryCheckpointStore(tmp_path),
        ) as session:
            weights = data.to("cumulus")
            session.checkpoint()
            read.append(session.failover_statistics().checkpoint_read_bytes)
            assert weights.sum().item() == data.sum().item()
    assert read == [PIECE, 0]


def test_directory_store_keeps_only_the_pieces_a_manifest_names(tmp_path):
    store = DirectoryCheckpointStore(tmp_path)
    old, new = StorageImage.of(1, torch.uint8, b"old"), StorageImage.of(1, torch.uint8, b"new")
    store.save(Checkpoint(1, "cpu", memoryview(b"r"), (old,)))
    store.save(Checkpoint(2, "cpu", memoryview(b"r"), (new,)))
    assert sorted(p.name for p in store.pieces_dir.iterdir()) == [new.digests[0]]


def test_directory_store_keeps_pieces_another_session_names(tmp_path):
    mine = DirectoryCheckpointStore(tmp_path, name="mine")
    theirs = DirectoryCheckpointStore(tmp_path, name="theirs")
    shared = StorageImage.of(1, torch.uint8, b"shared")
    theirs.save(Checkpoint(1, "cpu", memoryview(b"r"), (shared,)))
    mine.save(Checkpoint(1, "cpu", memoryview(b"r"), (shared,)))
    mine.save(Checkpoint(2, "cpu", memoryview(b"r"), ()))
    assert theirs.load().storages[0].tobytes() == b"shared"


def test_a_full_disk_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    store = DirectoryCheckpointStore(tmp_path)
    store.save(Checkpoint(1, "cpu", memoryview(b"r"), (StorageImage.of(1, torch.uint8, b"a"),)))

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("cumulus_p2p.remote.checkpoint._replace", no_space)
    with pytest.raises(OSError):
        store.save(Checkpoint(2, "cpu", memoryview(b"r"), (StorageImage.of(1, torch.uint8, b"b"),)))
    monkeypatch.undo()
    loaded = store.load()
    assert (loaded.seq, loaded.storages[0].tobytes()) == (1, b"a")


def test_directory_store_reads_back_what_it_saved(tmp_path):
    store = DirectoryCheckpointStore(tmp_path)
    assert store.load() is None
    image = StorageImage.of(7, torch.float16, bytes(range(10)))
    store.save(Checkpoint(42, "cpu", memoryview(b"rng"), (image,)))
    loaded = store.load()
    assert (loaded.seq, loaded.device, bytes(loaded.rng_state)) == (42, "cpu", b"rng")
    ((handle, dtype, data),) = [(s.handle, s.dtype, s.tobytes()) for s in loaded.storages]
    assert (handle, dtype, data) == (7, torch.float16, bytes(range(10)))


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_directory_store_reports_a_damaged_manifest(tmp_path, damage):
    store = DirectoryCheckpointStore(tmp_path)
    image = StorageImage.of(7, torch.float32, bytes(16))
    store.save(Checkpoint(1, "cpu", memoryview(b"r"), (image,)))
    content = store.path.read_bytes()
    damaged = {
        "truncate": content[:-3],
        "garbage": content[:8] + b"\xc1\xc1\xc1\xc1",
        "empty": b"",
    }[damage]
    store.path.write_bytes(damaged)
    with pytest.raises(CheckpointCorruptError):
        store.load()


@pytest.mark.parametrize("damage", ["altered", "missing"])
def test_directory_store_reports_a_damaged_piece(tmp_path, damage):
    store = DirectoryCheckpointStore(tmp_path)
    image = StorageImage.of(7, torch.float32, bytes(16))
    store.save(Checkpoint(1, "cpu", memoryview(b"r"), (image,)))
    piece = store.pieces_dir / image.digests[0]
    if damage == "altered":
        piece.write_bytes(b"\x01" * 16)
    else:
        piece.unlink()
    with pytest.raises(CheckpointCorruptError, match=image.digests[0]):
        store.load()


def test_directory_store_keeps_the_newest_other_runs_and_drops_older_ones(tmp_path):
    for run, mtime in (("oldest", 1.0), ("previous", 2.0)):
        other = DirectoryCheckpointStore(tmp_path, name=run)
        image = StorageImage.of(1, torch.uint8, run.encode())
        other.save(Checkpoint(1, "cpu", memoryview(b"r"), (image,)))
        os.utime(other.path, (mtime, mtime))
    now = DirectoryCheckpointStore(tmp_path, name="now", keep_others=1)
    now.save(Checkpoint(1, "cpu", memoryview(b"r"), (StorageImage.of(1, torch.uint8, b"x"),)))
    left = sorted(p.name for p in tmp_path.glob("*.cumulus-checkpoint"))
    assert left == ["now.cumulus-checkpoint", "previous.cumulus-checkpoint"]
    assert len(list((tmp_path / "pieces").iterdir())) == 2


def test_directory_store_never_drops_a_manifest_another_running_session_saved_lately(tmp_path):
    for run in ("one", "two", "three"):  # three sessions running at once, saved just now
        store = DirectoryCheckpointStore(tmp_path, name=run, keep_others=1)
        store.save(Checkpoint(1, "cpu", memoryview(b"r"), (StorageImage.of(1, torch.uint8, b"x"),)))
    assert len(list(tmp_path.glob("*.cumulus-checkpoint"))) == 3
