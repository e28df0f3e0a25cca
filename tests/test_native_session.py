"""A native session end to end: the device's batches replayed by the host's executor.

Each test runs in the native-device child process (``testing/native_process.py``),
against a ``cumulus-executor`` process on loopback: the module's own, shared by the tests
that need a plain one (each opens a session of its own there), or one started for the
test: with a small quota, a worker per session, or behind the secure channel.
"""

from __future__ import annotations

import contextlib
import functools
import time

import pytest
import torch
import torch.nn.functional as F

from cumulus_p2p import native
from cumulus_p2p._errors import SessionClosedError
from cumulus_p2p.testing.models import assert_trains_as_on_the_cpu
from cumulus_p2p.testing.models import train_tiny_transformer as _train
from cumulus_p2p.testing.native_process import in_native_process, stop_native_process
from cumulus_p2p.wire import native as wire

pytestmark = [pytest.mark.slow, pytest.mark.native]


@pytest.fixture(scope="module", autouse=True)
def _native_child():
    yield
    _stop_module_executor()
    stop_native_process()


#: In the child: what stops the module's plain executor (``_module_executor``).
_module_stack = contextlib.ExitStack()


@functools.cache
def _module_executor() -> str:
    """The address of the module's plain executor (one thread, 8 GiB), started on first
    use: starting one costs a process its torch import, 1.5 s of CPU."""
    from cumulus_p2p.testing.executor import executor_process

    started = executor_process(env={"OMP_NUM_THREADS": "1"})
    address, _ = _module_stack.enter_context(started)
    return address


@in_native_process
def _stop_module_executor() -> None:
    _module_stack.close()
    _module_executor.cache_clear()


@contextlib.contextmanager
def _session(*, executor_quota: str | None = None, extra: tuple[str, ...] = (), **options):
    """A native session on loopback (plain TCP); ``options`` as ``NativeSession``'s. The
    executor is the module's, or with a quota or ``extra`` flags a fresh one. Either runs
    one thread, as this process does: sums split across threads round differently."""
    from cumulus_p2p.native.session import NativeSession
    from cumulus_p2p.testing.executor import executor_process

    with contextlib.ExitStack() as stack:
        if executor_quota is None and not extra:
            address = _module_executor()
        else:
            one_thread = {"OMP_NUM_THREADS": "1"}
            quota = executor_quota or "8GiB"
            started = executor_process(quota=quota, extra=list(extra), env=one_thread)
            address, _ = stack.enter_context(started)
        host, port = address.split(":")
        with NativeSession.connect(host, int(port), **options) as session:
            yield session


@in_native_process
def test_a_tiny_transformer_trains_bit_identically_to_local_cpu():
    with _session(flush_bytes=0) as session:
        remote_losses, remote_params = _train("cumulus", steps=4)
        # One flush per sync point: the executor's choice of attention kernel (one
        # layout), each step's loss.item(), then each parameter's read.
        assert session.flushes == 1 + 4 + len(remote_params)
    assert_trains_as_on_the_cpu(remote_losses, remote_params)
    assert remote_losses[-1] < remote_losses[0]


@in_native_process
def test_foreach_ops_that_return_lists_give_local_cpus_values():
    torch.manual_seed(0)
    a, b = ([torch.rand(n) + 0.5 for n in (3, 4, 5)] for _ in range(2))
    calls = [
        lambda a, b: torch._foreach_sqrt(a),
        lambda a, b: torch._foreach_exp(a),
        lambda a, b: torch._foreach_sub(a, b, alpha=0.5),
        lambda a, b: torch._foreach_div(a, b),
        lambda a, b: torch._foreach_add(a, 3.0),
        lambda a, b: torch._foreach_mul(a, [1.0, 2.0, 3.0]),
        lambda a, b: torch._foreach_addcmul(a, a, b, 0.1),
        lambda a, b: torch._foreach_lerp(a, b, 0.3),
        lambda a, b: torch._foreach_pow(a, 2.0),
        lambda a, b: torch._foreach_norm(a),
    ]
    with _session():
        remote = [[t.to("cumulus") for t in x] for x in (a, b)]
        for call in calls:
            got = [t.cpu() for t in call(*remote)]
            for mine, local in zip(got, call(a, b), strict=True):
                assert torch.equal(mine, local)


@in_native_process
def test_histogramdd_gives_local_cpus_histogram_and_edges():
    torch.manual_seed(0)
    samples, weights = torch.rand(50, 2), torch.rand(50)
    with _session():
        hist, edges = torch.histogramdd(
            samples.to("cumulus"), bins=[3, 4], weight=weights.to("cumulus"), density=True
        )
        got = hist.cpu(), [e.cpu() for e in edges]
    local_hist, local_edges = torch.histogramdd(samples, bins=[3, 4], weight=weights, density=True)
    assert torch.equal(got[0], local_hist)
    for mine, local in zip(got[1], local_edges, strict=True):
        assert torch.equal(mine, local)


@in_native_process
def test_a_compiled_model_ships_its_graphs_and_trains_bit_identically_to_eager():
    import warnings

    from cumulus_p2p.native.compile import EAGER_WARNING

    torch._dynamo.reset()  # this child compiled other models: their captures go

    with _session() as session:
        eager, eager_params = _train("cumulus", steps=3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled, compiled_params = _train("cumulus", steps=3, compiled=True)
        assert len(session.graphs) == 2  # the forward and the backward, each sent once
    assert not [w for w in caught if EAGER_WARNING in str(w.message)]
    assert compiled == eager
    for a, b in zip(compiled_params, eager_params, strict=True):
        assert torch.equal(a, b)


def _train_at_lengths(device: str, lengths: list[int], *, compiled: bool) -> list[float]:
    """Adam steps of a tiny transformer, each step's batch as long as ``lengths`` says."""
    from cumulus_p2p.testing.models import TinyTransformer

    torch.manual_seed(0)
    model = TinyTransformer(vocab=16, dim=8, heads=2, layers=2, ctx=8, dropout=0.0).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    forward = torch.compile(model) if compiled else model
    losses = []
    for length in lengths:
        x = torch.randint(0, 16, (2, length))
        y = torch.roll(x, -1, dims=1).to(device)
        opt.zero_grad()
        loss = F.cross_entropy(forward(x.to(device)).reshape(-1, 16), y.reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _compiled_at_lengths(lengths: list[int], most_shapes: int) -> list[float]:
    """``_train_at_lengths`` compiled, with at most ``most_shapes`` graphs per symbolic one."""
    from cumulus_p2p.native import compile as native_compile

    torch._dynamo.reset()  # earlier captures (of this child's other tests) go
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native_compile, "MAX_SHAPES", most_shapes)
        return _train_at_lengths("cumulus", lengths, compiled=True)


@in_native_process
def test_a_compiled_model_whose_lengths_change_ships_a_graph_per_length():
    import warnings

    from cumulus_p2p.native.compile import EAGER_WARNING

    lengths = [4, 6, 5, 6, 4, 5]  # from the second, dynamo's graphs have symbolic sizes
    with _session() as session:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            shipped = _compiled_at_lengths(lengths, most_shapes=16)
        # A forward and a backward at 4 (static sizes), then one of each per length.
        assert len(session.graphs) == 2 + 2 * 3
        assert not [w for w in caught if EAGER_WARNING in str(w.message)]
        # The same captured graphs, their ops recorded one by one, as before.
        with pytest.warns(UserWarning, match=EAGER_WARNING):
            op_by_op = _compiled_at_lengths(lengths, most_shapes=0)
        eager = _train_at_lengths("cumulus", lengths, compiled=False)
    assert shipped == op_by_op
    # Dynamo's symbolic graphs decompose differently from eager (so on a CPU too).
    assert shipped == pytest.approx(eager, rel=1e-6)


@in_native_process
def test_a_symbolic_graph_past_its_most_shapes_runs_op_by_op_with_the_same_results():
    lengths = [4, 5, 6, 7, 5]
    with _session():
        shipped = _compiled_at_lengths(lengths, most_shapes=16)
        with pytest.warns(UserWarning, match="more than 1 shapes of one graph"):
            capped = _compiled_at_lengths(lengths, most_shapes=1)
    assert capped == shipped


@in_native_process
def test_a_symbolic_graph_that_fails_to_trace_at_new_sizes_runs_op_by_op_saying_why():
    from cumulus_p2p.native import compile as native_compile

    def fails(gm, args):
        raise RuntimeError("no fake kernel for this op")

    lengths = [4, 5, 6]
    with _session(), pytest.MonkeyPatch.context() as patch:
        shipped = _compiled_at_lengths(lengths, most_shapes=16)
        patch.setattr(native_compile._AtShape, "traced", staticmethod(fails))
        with pytest.warns(UserWarning, match="tracing it at new sizes failed.*no fake kernel"):
            op_by_op = _compiled_at_lengths(lengths, most_shapes=16)
    assert op_by_op == shipped


@in_native_process
def test_a_compiled_forward_and_backward_cost_the_same_few_records_at_any_depth():
    from cumulus_p2p.testing.models import TinyTransformer

    torch._dynamo.reset()  # this child compiled other models: their captures go

    ext = native.load()
    sent = {}
    with _session():
        for layers in (2, 4):
            torch.manual_seed(0)
            model = TinyTransformer(vocab=16, dim=8, heads=2, layers=layers, ctx=4).to("cumulus")
            x = torch.randint(0, 16, (2, 4)).to("cumulus")
            for name, forward in (("eager", model), ("compiled", torch.compile(model))):
                forward(x).sum().backward()  # a compiled model captures on its first call
                model.zero_grad(set_to_none=True)
                before = ext.ops_recorded()
                forward(x).sum().backward()
                sent[name, layers] = ext.ops_recorded() - before
                model.zero_grad(set_to_none=True)
    # Two RUN records, the sum and its backward: as many for four layers as for two.
    assert sent["compiled", 2] == sent["compiled", 4] <= 6
    assert sent["eager", 4] > sent["eager", 2] > 10 * sent["compiled", 2]


@in_native_process
def test_a_compiled_models_dropout_draws_the_masks_eager_draws():
    from cumulus_p2p.testing.models import train

    torch._dynamo.reset()  # this child compiled other models: their captures go

    with _session():
        eager, _ = train("transformer", "cumulus", steps=3)  # dropout 0.1
        compiled, _ = train("transformer", "cumulus", steps=3, compiled=True)
    assert compiled == pytest.approx(eager, rel=1e-5)


@in_native_process
def test_dropout_on_a_cpu_executor_draws_the_masks_local_cpu_draws():
    from cumulus_p2p.testing.models import train

    with _session():
        remote, _ = train("transformer", "cumulus", steps=3)  # dropout 0.1
    local, _ = train("transformer", "cpu", steps=3)
    assert remote == local


@in_native_process
def test_fork_rng_on_the_device_restores_the_executors_generator():
    with _session():
        with torch.random.fork_rng(device_type="cumulus"):
            first = torch.randn(4, device="cumulus").cpu()
        again = torch.randn(4, device="cumulus").cpu()
    assert torch.equal(first, again)


@in_native_process
def test_early_flushes_change_nothing_but_when_the_executor_replays():
    with _session(flush_bytes=0) as session:
        synced, _ = _train("cumulus", steps=2)
        sync_flushes = session.flushes
    with _session(flush_bytes=4096) as session:
        early, _ = _train("cumulus", steps=2)
        assert session.flushes > sync_flushes
    assert early == synced


@in_native_process
def test_readbacks_return_the_executors_bytes():
    with _session():
        a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        x = a.to("cumulus")
        assert torch.equal(x.cpu(), a)
        assert torch.equal(x.t()[1:].cpu(), a.t()[1:])  # a strided view
        assert (x * 2).sum().item() == 132.0
        assert x.to(torch.int64).cpu().dtype == torch.int64
        assert torch.equal((x > 5).cpu(), a > 5)
        assert x.cpu().to(torch.float64).equal(x.to("cpu", torch.float64))


@in_native_process
def test_torch_save_writes_the_executors_bytes_and_views_stay_views():
    import io

    model = torch.nn.Linear(4, 3)
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with _session():
        model.to("cumulus")
        weight = model.weight.detach()
        buffer = io.BytesIO()
        torch.save({"state": model.state_dict(), "view": weight.t()[1:]}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, map_location="cpu")
    assert loaded["state"].keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(loaded["state"][key], value)
    assert torch.equal(loaded["view"], expected["weight"].t()[1:])
    # One storage saved for both: the view still shares the weight's bytes.
    assert loaded["view"].untyped_storage().data_ptr() == (
        loaded["state"]["weight"].untyped_storage().data_ptr()
    )


@in_native_process
def test_torch_load_of_tensors_saved_on_the_device_restores_them_there():
    import io

    expected = torch.arange(12.0).reshape(3, 4)
    buffer = io.BytesIO()
    with _session():
        torch.save({"w": expected.to("cumulus")}, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer)["w"]
        assert loaded.device.type == "cumulus"
        assert torch.equal(loaded.cpu(), expected)
        assert (loaded * 2).sum().item() == 2 * expected.sum().item()


@in_native_process
def test_an_executor_failure_is_raised_at_the_next_readback_and_every_later_one():
    from cumulus_p2p.native.session import NativeSessionError

    with _session(executor_quota="4096"):
        small = torch.ones(4).to("cumulus")
        assert small.sum().item() == 4.0
        torch.empty(2048, device="cumulus")  # 8 KiB: over the quota
        with pytest.raises(NativeSessionError, match="needs 8192 more bytes") as error:
            small.cpu()
        assert error.value.kind == "out_of_memory"
        with pytest.raises(NativeSessionError, match="needs 8192 more bytes"):
            small.sum().item()


@in_native_process
def test_a_session_runs_in_a_worker_process_of_its_own():
    with _session(extra=("--worker-per-session",)) as session:
        assert session.info["worker_pid"] > 0
        losses, _ = _train("cumulus", steps=2)
    assert losses[1] < losses[0]


@in_native_process
def test_a_session_over_the_secure_channel_reads_back_what_it_wrote():
    import tempfile

    from cumulus_p2p.native.session import NativeSession
    from cumulus_p2p.testing.executor import secure_executor_channel

    with tempfile.TemporaryDirectory() as data_dir:
        with secure_executor_channel(data_dir) as (channel, _):
            with NativeSession(channel) as session:
                a = torch.arange(6, dtype=torch.float32)
                assert torch.equal((a.to("cumulus") + 1).cpu(), a + 1)
                assert session.info["native"] == wire.VERSION


@in_native_process
def test_a_session_asking_more_than_the_executors_quota_gets_the_executors():
    with _session(executor_quota="4096", quota=1 << 30) as session:
        assert session.info["quota"] == 4096


@in_native_process
def test_a_lost_executor_is_replaced_and_training_goes_on_with_the_same_losses():
    from cumulus_p2p.channel.transport import SocketFrameChannel
    from cumulus_p2p.native.session import NativeSession
    from cumulus_p2p.testing.executor import executor_process

    one_thread = {"OMP_NUM_THREADS": "1"}
    with executor_process(env=one_thread) as (first, killed):
        with executor_process(env=one_thread) as (second, _):
            host, port = second.split(":")
            moved_to = []

            def reconnect(lost: str):
                moved_to.append(lost)
                return SocketFrameChannel.connect(host, int(port))

            channel = SocketFrameChannel.connect(*_split(first))
            with NativeSession(channel, reconnect=reconnect) as session:
                moved, _ = _train("cumulus", steps=4, kill_after=2, kill=killed.kill)
                assert session.failovers == 1
                assert "lost the executor" in moved_to[0]
    local, _ = _train("cpu", steps=4)
    assert moved == local


@in_native_process
def test_a_session_whose_log_outgrew_its_bound_says_it_cannot_move():
    from cumulus_p2p.channel.transport import SocketFrameChannel
    from cumulus_p2p.native.session import NativeSession
    from cumulus_p2p.testing.executor import executor_process

    with executor_process() as (address, killed):
        channel = SocketFrameChannel.connect(*_split(address))
        with NativeSession(channel, reconnect=_never, log_bytes=1024) as session:
            x = torch.ones(1024).to("cumulus")  # a 4 KiB upload: over the bound
            session.flush()  # no readback, so no checkpoint, before the executor is lost
            killed.kill()
            killed.wait()
            with pytest.raises(SessionClosedError, match="outgrew the 1024 bytes"):
                x.sum().item()
            assert session.failovers == 0


@in_native_process
def test_a_session_closed_after_its_executor_is_gone_just_ends():
    from cumulus_p2p.channel.transport import SocketFrameChannel
    from cumulus_p2p.native.session import NativeSession
    from cumulus_p2p.testing.executor import executor_process

    with executor_process() as (address, killed):
        session = NativeSession(SocketFrameChannel.connect(*_split(address)), reconnect=_never)
        x = torch.ones(4).to("cumulus")
        assert x.sum().item() == 4.0
        killed.kill()
        killed.wait()
        session.flush()  # the first write to a closed peer still succeeds; it answers RST
        time.sleep(0.2)
        session.close()  # the next write fails: no move to another host, and no error


@contextlib.contextmanager
def _two_executors():
    """A plain-TCP channel to a first executor, its process (to kill), and a
    ``reconnect`` that opens a channel to a second one."""
    from cumulus_p2p.channel.transport import SocketFrameChannel
    from cumulus_p2p.testing.executor import executor_process

    one_thread = {"OMP_NUM_THREADS": "1"}
    with executor_process(env=one_thread) as (first, killed):
        with executor_process(env=one_thread) as (second, _):

            def reconnect(lost: str):
                return SocketFrameChannel.connect(*_split(second))

            yield SocketFrameChannel.connect(*_split(first)), killed, reconnect


@in_native_process
def test_a_lost_executor_is_replaced_from_the_last_checkpoint_with_the_same_losses():
    from cumulus_p2p.native.session import NativeSession

    with _two_executors() as (channel, killed, reconnect):
        # A log this small holds about a step: without checkpoints the session could not
        # move by the time the executor is lost.
        options = {"reconnect": reconnect, "checkpoint_interval": 0, "log_bytes": 256 * 1024}
        with NativeSession(channel, **options) as session:
            moved, moved_params = _train("cumulus", steps=6, kill_after=4, kill=killed.kill)
            assert session.failovers == 1 and session.checkpoints >= 4
    assert_trains_as_on_the_cpu(moved, moved_params)


@in_native_process
def test_a_compiled_job_moved_past_its_checkpoint_defines_its_graphs_on_the_new_host():
    from cumulus_p2p.native.session import NativeSession

    torch._dynamo.reset()  # this child compiled other models: their captures go

    with _two_executors() as (channel, killed, reconnect):
        # Checkpoints at every sync point cut the log: the batches that defined the
        # graphs are gone from it by the time the executor is lost.
        options = {"reconnect": reconnect, "checkpoint_interval": 0, "log_bytes": 256 * 1024}
        with NativeSession(channel, **options) as session:
            moved, _ = _train("cumulus", steps=5, kill_after=3, kill=killed.kill, compiled=True)
            assert session.failovers == 1 and len(session.graphs) == 2
    local, _ = _train("cpu", steps=5)
    assert moved == local


@in_native_process
def test_checkpoints_kept_on_disk_move_a_session_and_go_when_it_closes(tmp_path):
    from cumulus_p2p.native.session import NativeSession

    directory = tmp_path / "checkpoints"
    with _two_executors() as (channel, killed, reconnect):
        options = {"reconnect": reconnect, "checkpoint_interval": 0, "checkpoint_dir": directory}
        with NativeSession(channel, **options) as session:
            moved, _ = _train("cumulus", steps=4, kill_after=2, kill=killed.kill)
            assert session.failovers == 1 and session.checkpoints >= 2
            assert any(directory.iterdir())
    assert not directory.exists()
    assert moved == _train("cpu", steps=4)[0]


@in_native_process
def test_a_moved_session_draws_the_random_numbers_it_would_have_drawn():
    from cumulus_p2p.native.session import NativeSession

    def draws(kill=lambda: None) -> torch.Tensor:
        torch.manual_seed(3)  # a SEED record, before the checkpoint: the move must not need it
        first = torch.rand(8, device="cumulus")
        assert first.sum().item() > 0  # a sync point: the checkpoint
        kill()
        return torch.cat([first, torch.rand(8, device="cumulus")]).cpu()

    with _session():
        expected = draws()
    with _two_executors() as (channel, killed, reconnect):
        with NativeSession(channel, reconnect=reconnect, checkpoint_interval=0) as session:
            moved = draws(killed.kill)
            assert session.failovers == 1
    assert torch.equal(moved, expected)


@in_native_process
def test_a_checkpoint_reads_back_only_the_pieces_that_changed():
    from cumulus_p2p.native.session import NativeSession

    with _two_executors() as (channel, killed, reconnect):
        with NativeSession(channel, reconnect=reconnect) as session:
            frozen = torch.arange(5 * 1024 * 1024, dtype=torch.float32).to("cumulus")  # 2 pieces
            trained = torch.zeros(16).to("cumulus")
            session.checkpoint()
            assert session.checkpoint_bytes == frozen.nbytes + trained.nbytes
            trained.add_(1)
            session.checkpoint()
            assert session.checkpoint_bytes == frozen.nbytes + 2 * trained.nbytes
            killed.kill()
            killed.wait()
            assert torch.equal(trained.cpu(), torch.ones(16))
            assert torch.equal(frozen.cpu(), torch.arange(5 * 1024 * 1024, dtype=torch.float32))
            assert session.failovers == 1


def _never(lost: str):
    raise AssertionError(f"no move was possible, yet one was tried: {lost}")


def _split(address: str) -> tuple[str, int]:
    host, port = address.split(":")
    return host, int(port)


@in_native_process
def test_a_600_mib_tensor_uploads_and_reads_back_bit_identically_in_bounded_frames():
    from cumulus_p2p.native.session import MAX_BATCH_BYTES

    with _session(flush_bytes=0) as session:
        largest = _largest_frame(session)
        a = torch.arange(600 * 2**20 // 4, dtype=torch.int32)
        x = a.to("cumulus")
        assert torch.equal(x.cpu(), a)
        assert max(largest) <= MAX_BATCH_BYTES + 2**20
        assert (x[-3:] + 1).tolist() == a[-3:].add(1).tolist()


@in_native_process
def test_many_uploads_without_a_sync_go_in_frames_that_each_fit():
    from cumulus_p2p.channel.transport import DEFAULT_MAX_FRAME
    from cumulus_p2p.native.session import MAX_BATCH_BYTES

    # A model's weights: 17 tensors of one piece each (16 MiB), 272 MiB in all, more
    # than one frame may carry, and no sync point among them.
    with _session(flush_bytes=0) as session:
        largest = _largest_frame(session)
        parts = [torch.full((4 * 2**20,), float(i)) for i in range(17)]
        assert 17 * parts[0].nbytes > DEFAULT_MAX_FRAME
        moved = [part.to("cumulus") for part in parts]
        assert [x[-1].item() for x in moved] == [float(i) for i in range(17)]
        assert max(largest) <= MAX_BATCH_BYTES + 2**20


@in_native_process
def test_attention_runs_the_fused_kernel_the_executors_device_picks():
    # With a mask or without, a CPU executor runs the CPU's flash kernel, as local CPU
    # does: the same bits, where the math path would round differently.
    q = torch.randn(2, 2, 16, 8, generator=torch.Generator().manual_seed(0))
    causal = torch.ones(16, 16, dtype=torch.bool).tril()
    local = [
        F.scaled_dot_product_attention(q, q, q, is_causal=True),
        F.scaled_dot_product_attention(q, q, q, attn_mask=causal),
    ]
    with _session():
        x, mask = q.to("cumulus"), causal.to("cumulus")
        remote = [
            F.scaled_dot_product_attention(x, x, x, is_causal=True).cpu(),
            F.scaled_dot_product_attention(x, x, x, attn_mask=mask).cpu(),
        ]
    for got, expected in zip(remote, local, strict=True):
        assert torch.equal(got, expected)


@in_native_process
def test_attention_pinned_to_math_by_sdpa_kernel_takes_the_math_path():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from cumulus_p2p import native

    ext = native.load()

    def ops_of(attend) -> tuple[int, torch.Tensor]:
        before = ext.ops_recorded()
        out = attend()
        return ext.ops_recorded() - before, out.cpu()

    with _session():
        q = torch.randn(2, 2, 16, 8).to("cumulus")
        fused_ops, fused = ops_of(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True))
        with sdpa_kernel(SDPBackend.MATH):
            math_ops, math = ops_of(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True))
    assert math_ops > 2 * fused_ops
    assert torch.allclose(math, fused, atol=1e-6)


@in_native_process
def test_the_executor_is_asked_for_an_attention_kernel_once_per_layout():
    with _session(flush_bytes=0) as session:
        q = torch.randn(2, 2, 16, 8).to("cumulus")
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
        asked = session.flushes
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
        assert session.flushes == asked  # nothing sent: no sync point, no question
        F.scaled_dot_product_attention(q[:1], q[:1], q[:1], is_causal=True)
        assert session.flushes == asked + 1


@in_native_process
def test_a_large_transposed_tensor_uploads_and_reads_back_in_pieces():
    with _session() as session:
        largest = _largest_frame(session)
        a = torch.arange(40 * 2**20 // 4, dtype=torch.float32).reshape(2048, -1).t()
        x = a.to("cumulus")
        assert not x.is_contiguous()
        assert torch.equal(x.cpu(), a)
        assert torch.equal(x.to("cpu", torch.float64), a.double())
        assert max(largest) < 40 * 2**20


def _largest_frame(session) -> list[int]:
    """Record each frame's size the session sends from now on."""
    sizes = [0]
    send = session._channel.send_frame

    def counted(parts):
        sizes.append(sum(len(memoryview(p).cast("B")) for p in parts))
        send(parts)

    session._channel.send_frame = counted
    return sizes


@in_native_process
def test_lazily_conjugated_and_negated_views_compute_as_on_the_cpu():
    torch.manual_seed(0)
    z = torch.randn(3, 4, dtype=torch.complex64)
    r = torch.randn(5, 6, 7)
    with _session():
        x, y = z.to("cumulus"), r.to("cumulus")
        assert torch.equal(x.conj().cpu(), z.conj())  # a readback of a conj view
        assert torch.equal((x.conj() * 2).cpu(), z.conj() * 2)  # an op torch resolves first
        assert torch.equal((x.conj().t() @ x).cpu(), z.conj().t() @ z)  # one that takes the bit
        assert torch.equal(z.conj().to("cumulus").cpu(), z.conj())  # an upload of one
        assert torch.equal(torch._neg_view(y).cpu(), -r)
        hfft = torch.fft.hfft(y, n=10, dim=1, norm="ortho")  # conj inside: it used to recurse
        assert torch.equal(hfft.cpu(), torch.fft.hfft(r, n=10, dim=1, norm="ortho"))


@in_native_process
def test_ops_whose_outputs_only_running_can_shape_run_on_the_executor_at_once():
    a = torch.tensor([3.0, 1.0, 3.0, 2.0, 1.0])
    with _session() as session:
        x = a.to("cumulus")
        flushes = session.flushes
        values, inverse, counts = torch.unique(x, return_inverse=True, return_counts=True)
        assert session.flushes == flushes + 1  # one round trip: the shapes come back
        assert values.tolist() == [1.0, 2.0, 3.0]
        assert inverse.tolist() == [2, 0, 2, 1, 0] and counts.tolist() == [2, 1, 2]
        assert (x[x > 1.5] * 2).tolist() == [6.0, 6.0, 4.0]  # boolean masks: nonzero
        assert torch.nonzero(x > 2).tolist() == [[0], [2]]
        assert torch.equal(x, x) and not torch.equal(x, x + 1)


@in_native_process
def test_an_out_variant_the_executor_resizes_keeps_the_layout_it_chose():
    torch.manual_seed(0)
    a, b = torch.randn(4, 3), torch.randn(4, 2)
    with _session():
        got = torch.linalg.lstsq(a.to("cumulus"), b.to("cumulus"), driver="gelsy")
        solution = got.solution.cpu()
    assert torch.allclose(solution, torch.linalg.lstsq(a, b, driver="gelsy").solution, atol=1e-5)


@in_native_process
def test_python_numbers_promote_as_scalars_do_on_the_cpu():
    with _session():
        x = torch.arange(4).to("cumulus")
        scaled = x * 2.5
        assert scaled.dtype == torch.float32
        assert scaled.tolist() == [0.0, 2.5, 5.0, 7.5]
        assert (torch.ones(2, dtype=torch.float16).to("cumulus") + 1e-3).dtype == torch.float16


@in_native_process
def test_a_convolutional_net_trains_bit_identically_to_local_cpu():
    def train(device: str) -> list[float]:
        torch.manual_seed(0)
        net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 4, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.ConvTranspose2d(4, 2, 2, stride=2),
            torch.nn.Flatten(),
            torch.nn.Linear(2 * 12 * 12, 3),
        )
        x = torch.randn(2, 3, 6, 6)
        net, x = net.to(device), x.to(device)
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        losses = []
        for _ in range(3):
            opt.zero_grad()
            loss = net(x).square().mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    with _session():
        remote = train("cumulus")
    local = train("cpu")
    assert remote == local
    assert local[-1] < local[0]


@in_native_process
def test_torch_manual_seed_reaches_the_executors_generator():
    with _session():
        torch.manual_seed(1)
        first = torch.rand(4, device="cumulus").cpu()
        torch.manual_seed(1)
        again = torch.rand(4, device="cumulus").cpu()
        torch.manual_seed(2)
        other = torch.rand(4, device="cumulus").cpu()
    torch.manual_seed(1)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    assert torch.equal(first, torch.rand(4))  # the executor's CPU generator, seeded alike


@in_native_process
def test_autocast_on_cumulus_casts_as_on_cuda():
    torch.manual_seed(0)
    a, w = torch.randn(4, 8), torch.randn(8, 3)
    with _session():
        x, y = a.to("cumulus"), w.to("cumulus")
        with torch.autocast("cumulus", dtype=torch.bfloat16):
            product = x @ y  # matmuls run in the region's dtype
            kept = torch.exp(product)  # numerically sensitive ops run in float32
            summed = product.float().sum()
        assert (product.dtype, kept.dtype) == (torch.bfloat16, torch.float32)
        assert torch.equal(product.cpu(), (a.bfloat16() @ w.bfloat16()))
        assert summed.item() == (a.bfloat16() @ w.bfloat16()).float().sum().item()


def _cuttable(address: str):
    """A channel to ``address`` and its socket: ``sock.shutdown(SHUT_RDWR)`` is a cut."""
    import socket

    from cumulus_p2p.channel.transport import SocketFrameChannel

    sock = socket.create_connection(_split(address), timeout=10)
    sock.settimeout(None)
    return SocketFrameChannel(sock), sock


@in_native_process
@pytest.mark.parametrize("workers", [False, True], ids=["one process", "worker per session"])
def test_a_cut_connection_resumes_the_session_parked_on_its_host_without_a_restore(workers):
    import socket

    from cumulus_p2p.channel.transport import SocketFrameChannel
    from cumulus_p2p.native.session import NativeSession
    from cumulus_p2p.testing.executor import executor_process

    extra = ["--worker-per-session"] if workers else []
    with executor_process(extra=extra, env={"OMP_NUM_THREADS": "1"}) as (address, _):
        channel, sock = _cuttable(address)

        def reconnect(lost: str):
            return SocketFrameChannel.connect(*_split(address))

        with NativeSession(channel, reconnect=reconnect) as session:
            moved, params = _train(
                "cumulus", steps=4, kill_after=2, kill=lambda: sock.shutdown(socket.SHUT_RDWR)
            )
            counts = (session.resumes, session.failovers)
            assert counts == (1, 0), counts
    assert_trains_as_on_the_cpu(moved, params)


@in_native_process
def test_a_batch_that_ran_before_the_cut_is_not_run_again_and_its_reply_is_sent_again():
    import socket

    from cumulus_p2p.channel.transport import SocketFrameChannel
    from cumulus_p2p.native.session import NativeSession
    from cumulus_p2p.testing.executor import executor_process

    with executor_process() as (address, _):
        channel, sock = _cuttable(address)
        cut = []

        def reconnect(lost: str):
            return SocketFrameChannel.connect(*_split(address))

        class CutAfterSend:
            """The cut comes after the request went out, before its reply is read."""

            def __init__(self, inner):
                self.inner = inner

            def __getattr__(self, name):
                return getattr(self.inner, name)

            def send_frame(self, parts):
                self.inner.send_frame(parts)
                if cut == ["armed"]:
                    time.sleep(0.5)  # the executor runs the batch and answers
                    sock.shutdown(socket.SHUT_RDWR)
                    sock.close()  # the answer is lost with the connection
                    cut.append("done")

        with NativeSession(CutAfterSend(channel), reconnect=reconnect) as session:
            x = torch.ones(4).to("cumulus")
            cut.append("armed")
            x.add_(1)  # in place: run twice, the sum would be 12
            assert x.sum().item() == 8.0
            assert cut == ["armed", "done"], cut
            counts = (session.resumes, session.failovers)
            assert counts == (1, 0), counts


@in_native_process
def test_a_second_session_uploads_what_its_host_holds_by_digest(tmp_path):
    from cumulus_p2p.channel.transport import SocketFrameChannel
    from cumulus_p2p.native.session import NativeSession
    from cumulus_p2p.testing.executor import executor_process

    weights = torch.randn(5 * 1024 * 1024)  # 20 MiB: two pieces
    with (
        executor_process(extra=["--blob-dir", str(tmp_path / "a")]) as (first, killed),
        executor_process() as (second, _),
    ):
        with NativeSession.connect(*_split(first)) as session:
            weights.to("cumulus").sum().item()
            assert session.upload_bytes_named == 0  # the host held nothing yet
        # The next run: its host holds the pieces; its move goes to a host that does not.
        channel = SocketFrameChannel.connect(*_split(first))
        reconnect = lambda _: SocketFrameChannel.connect(*_split(second))  # noqa: E731
        with NativeSession(channel, reconnect=reconnect) as session:
            on_device = weights.to("cumulus")
            assert torch.equal(on_device.cpu(), weights)
            assert session.upload_bytes_named == weights.nbytes
            killed.kill()
            killed.wait()
            assert torch.equal((on_device * 2).cpu(), weights * 2)
            assert session.failovers == 1


@in_native_process
def test_a_session_moved_to_another_host_leaves_its_large_uploads_public_there(tmp_path):
    from cumulus_p2p.blobs.names import digest
    from cumulus_p2p.blobs.store import BlobStore
    from cumulus_p2p.channel.transport import SocketFrameChannel
    from cumulus_p2p.native.session import NativeSession
    from cumulus_p2p.testing.executor import executor_process

    weights = torch.randn(5 * 1024 * 1024)  # 20 MiB: a 16 MiB piece and a 4 MiB one
    raw = weights.numpy().tobytes()
    pieces = {digest(memoryview(raw[: 16 << 20])), digest(memoryview(raw[16 << 20 :]))}
    blobs = tmp_path / "second"
    with (
        executor_process() as (first, killed),
        executor_process(extra=["--blob-dir", str(blobs)]) as (second, _),
    ):
        channel = SocketFrameChannel.connect(*_split(first))
        reconnect = lambda _: SocketFrameChannel.connect(*_split(second))  # noqa: E731
        with NativeSession(channel, reconnect=reconnect) as session:
            on_device = weights.to("cumulus")
            assert torch.equal(on_device.cpu(), weights)
            killed.kill()
            killed.wait()
            # The uploads reach the second host in the batches the move sends again.
            assert torch.equal((on_device * 2).cpu(), weights * 2)
            assert session.failovers == 1
    assert BlobStore(blobs, cap=2**30).public() == pieces


@in_native_process
def test_a_private_session_names_no_upload_and_its_host_keeps_none(tmp_path):
    from cumulus_p2p.blobs.names import is_digest
    from cumulus_p2p.native.session import NativeSession
    from cumulus_p2p.testing.executor import executor_process

    weights = torch.randn(5 * 1024 * 1024)
    blobs = tmp_path / "blobs"
    with executor_process(extra=["--blob-dir", str(blobs)]) as (address, _):
        for _ in range(2):
            with NativeSession.connect(*_split(address), private=True) as session:
                assert torch.equal(weights.to("cumulus").cpu(), weights)
                assert session.upload_bytes_named == 0
    assert not [p for p in blobs.rglob("*") if is_digest(p.name)]
