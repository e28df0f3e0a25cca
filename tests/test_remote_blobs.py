"""Content-addressed uploads (``blobs/names.py``): a host that keeps a blob store is sent
the bytes it lacks and only the names of those it holds. Hosts are real executor
processes; bytes are counted on the consumer's channel."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

import cumulus_p2p.remote as remote
from cumulus_p2p._errors import RemoteExecutionError
from cumulus_p2p.blobs.names import BLOB_MIN, digest, is_digest
from cumulus_p2p.channel.transport import CountingFrameChannel, SocketFrameChannel
from cumulus_p2p.testing.executor import executor_process

# Starts executor processes, some to kill: scripts/test --fast skips it.
pytestmark = pytest.mark.slow

MiB = 2**20


@contextlib.contextmanager
def counted(address: str, **options):
    host, port = address.split(":")
    wire = {"bytes": 0}

    def count(n: int) -> None:
        wire["bytes"] += n

    channel = CountingFrameChannel(SocketFrameChannel.connect(host, int(port)), count)
    with remote.attach(channel=channel, **options) as session:
        session.synchronize()
        wire["bytes"] = 0
        yield session, wire


def names_in(root: Path) -> set[str]:
    return {p.name for p in root.iterdir() if is_digest(p.name)}


def weights() -> dict[str, torch.Tensor]:
    """40 MiB of a model's weights: four 4 MiB layers (one piece each, named together),
    a 24 MiB embedding (two pieces), and biases small enough to ride inline."""
    g = torch.Generator().manual_seed(3)
    state = {f"layer{i}.weight": torch.randn(1024, 1024, generator=g) for i in range(4)}
    state |= {f"layer{i}.bias": torch.randn(1024, generator=g) for i in range(4)}
    state["embedding.weight"] = torch.randn(6144, 1024, generator=g)
    return state


@pytest.fixture(params=["shared-process", "worker-per-session"])
def blob_host(request, tmp_path):
    blobs = tmp_path / "blobs"
    flags = ["--blob-dir", str(blobs), "--blob-cap", "1GiB", f"--{request.param}"]
    with executor_process(extra=flags) as (address, _):
        yield address, blobs


def test_a_second_upload_of_the_same_weights_sends_only_their_names(blob_host):
    address, blobs = blob_host
    state = weights()
    parameter_bytes = sum(t.numel() * t.element_size() for t in state.values())
    sent = []
    for _ in range(2):  # two sessions: a second consumer, or this one's second run
        with counted(address) as (session, wire):
            on_host = {k: v.to("cumulus") for k, v in state.items()}
            session.synchronize()
            sent.append(wire["bytes"])
            assert session.blob_questions <= 3  # a question per batch, not per tensor
            for key, value in state.items():
                assert torch.equal(on_host[key].cpu(), value), key
    assert sent[0] >= parameter_bytes
    assert sent[1] <= parameter_bytes // 100
    assert len(names_in(blobs)) == 4 + 2  # the layers and the embedding's pieces


def test_a_blob_whose_bytes_do_not_match_its_name_is_refused_and_the_session_lives(tmp_path):
    blobs = tmp_path / "blobs"
    with executor_process(extra=["--blob-dir", str(blobs)]) as (address, _):
        with counted(address) as (session, _):
            dst = torch.zeros(BLOB_MIN // 4, device="cumulus")
            forged = torch.ones(BLOB_MIN, dtype=torch.uint8)
            name = digest(torch.zeros(BLOB_MIN, dtype=torch.uint8).numpy())
            record = ["@blob", [dst._wire(), name, torch.float32, [BLOB_MIN // 4], None], {}, None]
            record[1][4] = session.add_blob(forged)
            session.submit(record)
            with pytest.raises(RemoteExecutionError, match="does not match its hash") as info:
                session.synchronize()
            assert info.value.remote_type == "BlobMismatchError"
            assert names_in(blobs) == set()  # nothing was stored
            assert torch.equal(dst.cpu(), torch.zeros(BLOB_MIN // 4))  # nor written
            weights_ = torch.randn(512, 1024)
            assert torch.equal(weights_.to("cumulus").cpu(), weights_)  # the session goes on


def test_private_uploads_are_not_kept_after_their_session(tmp_path):
    blobs = tmp_path / "blobs"
    secret = torch.randn(2048, 1024)  # 8 MiB
    with executor_process(extra=["--blob-dir", str(blobs)]) as (address, _):
        with counted(address, private=True) as (session, wire):
            assert torch.equal(secret.to("cumulus").cpu(), secret)
        assert names_in(blobs) == set()
        with counted(address) as (session, wire):
            secret.to("cumulus")
            session.synchronize()
            assert wire["bytes"] >= secret.numel() * 4  # the host had to be sent it again


def test_small_tensors_keep_the_inline_path(tmp_path):
    with executor_process(extra=["--blob-dir", str(tmp_path / "blobs")]) as (address, _):
        with counted(address) as (session, _):
            sent = session.ops_sent
            small = [torch.full((BLOB_MIN // 8,), float(i)) for i in range(64)]  # 512 KiB
            on_host = [t.to("cumulus") for t in small]
            session.synchronize()
            assert session.blob_questions == 0
            assert session.ops_sent - sent == 2 * len(small)  # allocation and copy_, as before
            assert all(torch.equal(r.cpu(), t) for r, t in zip(on_host, small, strict=True))


def test_the_hosts_store_stays_under_its_cap_and_keeps_the_latest(tmp_path):
    blobs = tmp_path / "blobs"
    with executor_process(extra=["--blob-dir", str(blobs), "--blob-cap", "20MiB"]) as (addr, _):
        with counted(addr) as (session, _):
            uploads = [torch.full((1024, 1024), float(i)) for i in range(12)]  # 4 MiB each
            for tensor in uploads:
                tensor.to("cumulus")
                session.synchronize()
        kept = names_in(blobs)
        assert sum((blobs / n).stat().st_size for n in kept) <= 20 * MiB
        latest = {digest(t.numpy()) for t in uploads[-5:]}
        assert kept == latest


def test_a_failover_to_a_host_without_the_blobs_replays_their_bytes(tmp_path):
    def dial(address: str):
        host, port = address.split(":")
        return lambda: SocketFrameChannel.connect(host, int(port))

    state = weights()
    stores = [tmp_path / "a", tmp_path / "b"]
    with (
        executor_process(extra=["--blob-dir", str(stores[0])]) as (first, first_host),
        executor_process(extra=["--blob-dir", str(stores[1])]) as (standby, _),
    ):
        with counted(first) as (session, _):  # the first host holds the weights already
            {k: v.to("cumulus") for k, v in state.items()}
            session.synchronize()
        attached = remote.attach(channel=dial(first)(), reconnect=dial(standby))
        with attached as session:
            on_host = {k: v.to("cumulus") for k, v in state.items()}
            session.synchronize()
            assert session.blob_bytes_skipped > 0  # named only, on the first host
            first_host.kill()
            first_host.wait()
            for key, value in state.items():
                assert torch.equal(on_host[key].cpu(), value), key
            assert session.failovers == 1
