"""Tensors of any size cross in pieces (``remote/transfer.py``): uploads, reads, checkpoints
and restores, with memory bounded by one window of pieces, progress reports, and the
executor refusing pieces that do not fit. Hosts are real executor processes.
"""

from __future__ import annotations

import math

import pytest
import torch

import cumulus_p2p.remote as remote
from cumulus_p2p._errors import RemoteExecutionError
from cumulus_p2p.channel.transport import SocketFrameChannel
from cumulus_p2p.host.session import MAX_READ_BYTES
from cumulus_p2p.remote.checkpoint import DirectoryCheckpointStore
from cumulus_p2p.remote.client import RemoteSession
from cumulus_p2p.remote.errors import RemoteOutOfMemoryError
from cumulus_p2p.remote.transfer import STREAM_CHUNK, TransferProgress, pieces
from cumulus_p2p.testing.executor import executor_process
from cumulus_p2p.testing.memory import peak_since_reset, reset_peak
from cumulus_p2p.wire.protocol import CpuTensorRef, TensorRef

MiB = 2**20
#: 600 MiB of float32 rows as wide as a 2048-wide embedding's.
BIG_ROWS, BIG_COLS = 600 * MiB // (2048 * 4), 2048
BIG = BIG_ROWS * BIG_COLS * 4
#: What either side may hold beyond the tensor while it moves: a few 16 MiB pieces (the one
#: in flight, the socket's buffers, allocator slack), never a second copy of the tensor.
WINDOW = 96 * MiB


def dial(address: str):
    host, port = address.split(":")
    return lambda: SocketFrameChannel.connect(host, int(port))


def big_tensor() -> torch.Tensor:
    return torch.empty(BIG_ROWS, BIG_COLS).uniform_(generator=torch.Generator().manual_seed(5))


# --- the plan (sans-IO) ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "make_view", "budget"),
    [
        ((100, 30), lambda t: t, 1000),
        ((100, 30), lambda t: t.t(), 1000),  # a column block per piece
        ((3, 5000), lambda t: t, 1000),  # a row over budget: rows split one by one
        ((4, 3, 7), lambda t: t.permute(2, 0, 1), 50),
        ((1000,), lambda t: t[::3], 64),
        ((7,), lambda t: t, 1),  # one element per piece at least
    ],
    ids=["rows", "transposed", "row_over_budget", "permuted_3d", "strided_1d", "tiny_budget"],
)
def test_pieces_cover_every_element_once_within_the_budget(shape, make_view, budget):
    base = torch.zeros(shape, dtype=torch.float32)
    view = make_view(base)
    seen = torch.zeros(view.shape, dtype=torch.int32)
    for piece in pieces(view.shape, view.stride(), view.storage_offset(), 4, budget):
        assert math.prod(piece.sizes) * 4 <= max(budget, 4)
        local = view[piece.index]
        # The wire layout names exactly the elements the local index selects.
        assert (tuple(local.shape), tuple(local.stride()), local.storage_offset()) == (
            piece.sizes,
            piece.strides,
            piece.offset,
        )
        seen[piece.index] += 1
    assert torch.equal(seen, torch.ones_like(seen))


def test_a_small_tensor_is_one_piece():
    assert list(pieces((4, 4), (4, 1), 0, 4, 64)) == [((), (4, 4), (4, 1), 0)]


def test_progress_speaks_at_intervals_and_once_more_at_the_end():
    progress = TransferProgress("upload", 100, started=10.0, interval=2.0)
    said = [progress.advance(25, now=t) for t in (10.5, 12.0, 12.5, 13.0)]
    assert said == [False, True, False, True]  # 2 s in, then at the end
    assert "upload: 0 of 0 MiB (100%)" in progress.line(now=13.0)
    quiet = TransferProgress("read", 100, started=0.0, interval=2.0)
    assert not quiet.advance(100, now=1.0)  # finished before the first interval: no line


# --- streamed uploads and reads --------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "layout", "src_dtype"),
    [
        ((2560, 4096), lambda t: t, torch.float32),
        ((4096, 2560), lambda t: t.t(), torch.float64),  # strided target, converted dtype
        ((2, 5 * MiB), lambda t: t, torch.float32),  # rows larger than a piece
    ],
    ids=["rows", "transposed_float64_source", "huge_rows"],
)
def test_a_tensor_larger_than_a_piece_uploads_and_reads_back_exactly(
    cumulus, shape, layout, src_dtype
):
    dst = layout(torch.zeros(shape, device="cumulus"))
    src = torch.randn(dst.shape, generator=torch.Generator().manual_seed(1), dtype=src_dtype)
    assert src.numel() * src.element_size() > STREAM_CHUNK
    sent = cumulus.ops_sent
    dst.copy_(src)
    assert cumulus.ops_sent - sent > 1  # it went in pieces
    assert torch.equal(dst.cpu(), src.to(torch.float32))
    assert torch.equal(layout(src.to(torch.float32)).to("cumulus").cpu(), layout(src.float()))


def test_a_modules_parameter_larger_than_a_piece_moves_in_pieces(cumulus):
    # module.to() copies each Parameter as itself, not as a plain tensor.
    embedding = torch.nn.Embedding(5 * 2048, 1024)
    weight = embedding.weight.detach().clone()
    sent = cumulus.ops_sent
    embedding.to("cumulus")
    # Its allocation, then a copy per piece.
    assert cumulus.ops_sent - sent > math.ceil(weight.nbytes / STREAM_CHUNK)
    assert torch.equal(embedding.weight.cpu(), weight)


def test_long_transfers_report_progress_until_done(cumulus):
    reports: list[tuple[str, int, int]] = []
    cumulus.progress_interval = 0.0
    cumulus.on_progress = lambda p: reports.append((p.what, p.done, p.total))
    src = torch.arange(10 * MiB, dtype=torch.float32)  # 40 MiB: three pieces
    back = src.to("cumulus").cpu()
    assert torch.equal(back, src)
    for what in ("upload", "read"):
        done = [d for w, d, total in reports if w == what]
        assert done == sorted(done) and len(done) >= 3
        assert done[-1] == src.numel() * 4 == [t for w, _, t in reports if w == what][0]


def test_an_upload_over_quota_fails_at_its_first_piece_and_the_session_lives_on(
    executor_address,
):
    with remote.attach(executor_address, quota_bytes=32 * MiB) as session:
        src = torch.ones(12 * MiB, dtype=torch.float32)  # 48 MiB
        session.synchronize()
        sent = session.ops_sent
        with pytest.raises(RemoteOutOfMemoryError, match="quota"):
            src.to("cumulus")
        assert session.ops_sent - sent == 2  # the allocation and one piece; not the rest
        assert torch.equal(torch.arange(5.0).to("cumulus").cpu(), torch.arange(5.0))


# --- the executor refuses pieces that do not fit ---------------------------------------------


def _copy_record(session: RemoteSession, target: TensorRef, values: torch.Tensor) -> list:
    return ["aten.copy_.default", [target, session.add_blob(values)], {}, [None]]


@pytest.mark.parametrize(
    ("target", "kind", "words"),
    [
        (lambda h: TensorRef(h, torch.float32, 12, (8,), (1,)), "IndexError", "out of bounds"),
        (lambda h: TensorRef(h, torch.float32, 0, (8,), (3,)), "IndexError", "out of bounds"),
        (
            lambda h: TensorRef(h + 10**6, torch.float32, 0, (8,), (1,)),
            "InvalidHandleError",
            "no tensor",
        ),
    ],
    ids=["piece_past_the_end", "stride_past_the_end", "unknown_handle"],
)
def test_a_piece_that_does_not_fit_its_storage_is_refused(cumulus, target, kind, words):
    dst = torch.zeros(16, device="cumulus")
    cumulus.submit(_copy_record(cumulus, target(dst._rs.handle), torch.ones(8)))
    with pytest.raises(RemoteExecutionError, match=words) as info:
        cumulus.synchronize()
    assert info.value.remote_type == kind
    assert torch.equal(dst.cpu(), torch.zeros(16))  # nothing was written; the session lives


def test_a_fetch_over_the_reply_limit_is_refused_and_pieces_still_read(cumulus):
    big = torch.zeros(MAX_READ_BYTES // 4 + 1, device="cumulus")
    with pytest.raises(RemoteExecutionError, match="in pieces") as info:
        cumulus.fetch(big._ref())
    assert info.value.remote_type == "ValueError"
    assert torch.equal(big.cpu(), torch.zeros(big.shape))  # the client's pieces are fine


def _restore_record(handle: int, nbytes: int, start: int, length: int, blob: int) -> list:
    data = CpuTensorRef(torch.uint8, (length,), blob)
    return ["@restore", [handle, torch.uint8, nbytes, start, data], {}, None]


@pytest.mark.parametrize(
    ("starts", "words"),
    [
        ((0, 8, 4), "starts at byte 16, not 4"),  # overlaps what came before
        ((0, 16), "starts at byte 8, not 16"),  # leaves a gap
        ((0, 8, 16, 8), "not being restored"),  # after the storage was complete
    ],
    ids=["overlap", "gap", "after_complete"],
)
def test_restore_pieces_must_come_in_order(cumulus, starts, words):
    handle = cumulus.new_handle()
    for blob, start in enumerate(starts):
        cumulus.submit(_restore_record(handle, 24, start, 8, blob))
        cumulus.add_blob(torch.full((8,), blob, dtype=torch.uint8))
    with pytest.raises(RemoteExecutionError, match=words) as info:
        cumulus.synchronize()
    assert info.value.remote_type == "RemoteProtocolError"
    cumulus.synchronize()  # reported once; the session carries on


# --- real sizes ------------------------------------------------------------------------------


@pytest.mark.slow
def test_600_mib_uploads_and_reads_back_within_a_bounded_window_on_both_sides():
    with executor_process(device="cpu", quota="2GiB") as (address, host):
        with remote.attach(address) as session:
            session.synchronize()
            src = big_tensor()
            host_before, mine_before = reset_peak(host.pid), reset_peak()
            on_host = src.to("cumulus")
            session.synchronize()
            assert peak_since_reset(host.pid) - host_before <= BIG + WINDOW
            assert peak_since_reset() - mine_before <= WINDOW

            host_before, mine_before = reset_peak(host.pid), reset_peak()
            back = on_host.cpu()
            assert peak_since_reset(host.pid) - host_before <= WINDOW
            assert peak_since_reset() - mine_before <= BIG + WINDOW
            assert torch.equal(back, src)


@pytest.mark.slow
def test_600_mib_survives_a_checkpoint_a_restore_and_a_failover_bit_identically(tmp_path):
    store = DirectoryCheckpointStore(tmp_path)
    with (
        executor_process(device="cpu", quota="2GiB") as (doomed, first_host),
        executor_process(device="cpu", quota="2GiB") as (standby, second_host),
    ):
        attached = remote.attach(
            channel=dial(doomed)(), reconnect=dial(standby), checkpoint_store=store
        )
        with attached as session, torch.no_grad():
            src = big_tensor()
            on_host = src.to("cumulus")
            on_host[0, :4] += 1.0  # a change after the upload, which the log replays
            expected = src.clone()
            expected[0, :4] += 1.0

            checkpoint = session.checkpoint()
            (image,) = [i for i in checkpoint.storages if i.nbytes == BIG]
            saved = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.float32).view(
                src.shape
            )
            assert torch.equal(saved, expected)
            del checkpoint, image, saved

            on_host[1, :4] *= 2.0
            expected[1, :4] *= 2.0
            standby_before = reset_peak(second_host.pid)
            first_host.kill()
            first_host.wait()
            back = on_host.cpu()
            assert session.failover_statistics().cold_restores == 1
            assert peak_since_reset(second_host.pid) - standby_before <= BIG + WINDOW
            assert torch.equal(back, expected)
