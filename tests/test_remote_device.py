"""What ordinary PyTorch code needs from the ``cumulus`` device, one behaviour per test."""

from __future__ import annotations

import copy
import io
import threading

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.fsdp._fully_shard import _fsdp_param
from torch.utils.checkpoint import checkpoint

import cumulus_p2p.remote as remote
from cumulus_p2p._errors import RemoteExecutionError, SessionClosedError
from cumulus_p2p.remote import RemoteOutOfMemoryError, RemoteTensor, fsdp


def test_device_module_reports_an_attached_session(cumulus):
    assert torch.cumulus.is_available()
    assert torch.cumulus.device_count() == 1
    torch.cumulus.synchronize()


def test_device_is_unavailable_without_a_session():
    remote.detach()
    assert not torch.cumulus.is_available()
    with pytest.raises(SessionClosedError, match="attach"):
        torch.zeros(2, device="cumulus")


def test_backward_runs_on_the_attaching_thread_while_attached(executor_address):
    threads = []
    with remote.attach(executor_address):
        x = torch.ones(3, device="cumulus", requires_grad=True)
        x.register_hook(lambda grad: threads.append(threading.get_ident()))
        (x * 2).sum().backward()
        assert x.grad.tolist() == [2.0, 2.0, 2.0]
    assert threads == [threading.get_ident()]
    assert torch._C._is_multithreading_enabled()  # detach gave torch its default back


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_activation_checkpointing_gives_the_gradients_of_a_local_run(cumulus, reentrant):
    grads = []
    for device in ("cpu", "cumulus"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
        ).to(device)
        x = torch.randn(3, 4).to(device).requires_grad_()
        checkpoint(model, x, use_reentrant=reentrant).sum().backward()
        grads.append([x.grad.cpu(), model[0].weight.grad.cpu()])
    assert all(torch.allclose(a, b) for a, b in zip(*grads, strict=True))


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(5, device="cumulus"),
        lambda: torch.zeros(2, 3, device="cumulus"),
        lambda: torch.ones(4, device="cumulus"),
        lambda: torch.full((2,), 7.0, device="cumulus"),
        lambda: torch.empty(3, device="cumulus"),
        lambda: torch.randn(3, device="cumulus"),
        lambda: torch.rand(3, device="cumulus"),
        lambda: torch.randint(0, 5, (3,), device="cumulus"),
        lambda: torch.tensor([1.0, 2.0], device="cumulus"),
        lambda: torch.zeros_like(torch.ones(2, device="cumulus")),
        lambda: torch.linspace(0, 1, 5, device="cumulus"),
        lambda: torch.eye(3, device="cumulus"),
    ],
)
def test_factories_honour_the_device(cumulus, make):
    t = make()
    assert isinstance(t, RemoteTensor)
    assert t.device == torch.device("cumulus", 0)


def test_factory_values_match_the_cpu(cumulus):
    assert torch.arange(2, 11, 3, device="cumulus").tolist() == [2, 5, 8]
    assert torch.full((2, 2), 3.5, device="cumulus").cpu().tolist() == [[3.5, 3.5], [3.5, 3.5]]
    assert torch.tensor([[1, 2], [3, 4]], device="cumulus").sum().item() == 10


def test_manual_seed_makes_random_ops_reproducible_and_equal_to_cpu(cumulus):
    torch.manual_seed(123)
    first = torch.randn(5, device="cumulus").cpu()
    dropped = F.dropout(torch.ones(100, device="cumulus"), 0.5).cpu()
    torch.manual_seed(123)
    assert torch.equal(torch.randn(5, device="cumulus").cpu(), first)
    assert torch.equal(torch.randn(5), first)  # the CPU draws the same stream
    torch.manual_seed(123)
    torch.randn(5, device="cumulus")
    assert torch.equal(F.dropout(torch.ones(100, device="cumulus"), 0.5).cpu(), dropped)


def test_tied_weights_stay_one_parameter_after_to(cumulus):
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head}).to("cumulus")
    assert model["emb"].weight is model["head"].weight
    assert isinstance(model["emb"].weight, torch.nn.Parameter)
    assert len(list(model.parameters())) == 1


def test_item_bool_and_format_are_sync_points(cumulus):
    x = torch.tensor([1.5, -2.0], device="cumulus")
    assert x.sum().item() == pytest.approx(-0.5)
    assert bool((x > 0).any())
    assert f"{x.max():.2f}" == "1.50"


def test_print_shows_values_and_device(cumulus):
    text = repr(torch.tensor([1.0, 2.0], device="cumulus"))
    assert text.startswith("tensor([1., 2.]")
    assert "device='cumulus:0'" in text


def test_data_dependent_shapes(cumulus):
    x = torch.tensor([0.0, 3.0, 0.0, 5.0], device="cumulus")
    assert x.nonzero().cpu().tolist() == [[1], [3]]
    assert x[x > 0].cpu().tolist() == [3.0, 5.0]
    assert torch.unique(torch.tensor([3, 1, 3, 2], device="cumulus")).cpu().tolist() == [1, 2, 3]


def test_boolean_mask_assignment_and_list_indexing(cumulus):
    x = torch.arange(6.0, device="cumulus")
    x[x > 3] = 0.0
    assert x.cpu().tolist() == [0.0, 1.0, 2.0, 3.0, 0.0, 0.0]
    assert x[[0, 2, 3]].cpu().tolist() == [0.0, 2.0, 3.0]


def test_topk_and_multinomial(cumulus):
    values, indices = torch.tensor([1.0, 9.0, 3.0, 7.0], device="cumulus").topk(2)
    assert values.cpu().tolist() == [9.0, 7.0] and indices.cpu().tolist() == [1, 3]
    torch.manual_seed(0)
    draws = torch.multinomial(torch.tensor([0.0, 1.0, 0.0], device="cumulus"), 4, True)
    assert draws.cpu().tolist() == [1, 1, 1, 1]


def test_views_share_remote_storage(cumulus):
    x = torch.zeros(2, 3, device="cumulus")
    x.t()[1].fill_(4.0)
    assert x.cpu().tolist() == [[0.0, 4.0, 0.0], [0.0, 4.0, 0.0]]


def test_state_dict_round_trips_through_torch_save(cumulus):
    model = torch.nn.Linear(3, 2).to("cumulus")
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    assert loaded["weight"].device.type == "cpu"
    fresh = torch.nn.Linear(3, 2).to("cumulus")
    fresh.load_state_dict(loaded)
    torch.testing.assert_close(fresh.weight.cpu(), model.weight.cpu())


def test_autocast_does_not_crash(cumulus):
    model = torch.nn.Linear(4, 4).to("cumulus")
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        out = model(torch.ones(2, 4, device="cumulus"))
    assert out.shape == (2, 4)


def test_executor_error_raises_at_next_sync_with_type_and_op(cumulus):
    weight = torch.randn(4, 3, device="cumulus")
    bad_index = torch.tensor([0, 9], device="cumulus")
    out = F.embedding(bad_index, weight)  # queued; the executor fails it later
    with pytest.raises(RemoteExecutionError) as info:
        out.sum().item()
    assert isinstance(info.value, IndexError)
    assert info.value.op == "aten.embedding.default"
    assert "index out of range" in str(info.value)


def test_session_continues_after_a_failed_op(cumulus):
    with pytest.raises(RemoteExecutionError):
        F.embedding(torch.tensor([9], device="cumulus"), torch.ones(2, 2, device="cumulus")).cpu()
    assert (torch.ones(3, device="cumulus") * 2).sum().item() == 6.0


def test_shape_errors_raise_immediately_like_local_torch(cumulus):
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        torch.ones(2, 3, device="cumulus") @ torch.ones(2, 3, device="cumulus")


def test_freed_tensors_release_executor_memory(cumulus):
    before = cumulus.stats()["bytes_in_use"]
    big = torch.zeros(256, 1024, device="cumulus")
    assert cumulus.stats()["bytes_in_use"] >= before + big.numel() * 4
    del big
    assert cumulus.stats()["bytes_in_use"] == before
    assert torch.cumulus.memory_allocated() == before


def test_fsdp2_freeing_a_tensors_storage_frees_it_on_the_executor_under_the_same_handle(cumulus):
    fsdp.adapt()
    gathered = torch.zeros(256, 1024, device="cumulus")
    before = cumulus.stats()["bytes_in_use"]
    _fsdp_param.free_storage(gathered)
    assert cumulus.stats()["bytes_in_use"] == before - gathered.numel() * 4
    assert torch.cumulus.memory_allocated() == before - gathered.numel() * 4
    _fsdp_param.alloc_storage(gathered)
    assert cumulus.stats()["bytes_in_use"] == before
    gathered.fill_(3.0)  # the same tensor object writes to the memory allocated again
    assert gathered.sum().item() == 3.0 * gathered.numel()


def test_fsdp2_storage_functions_leave_other_devices_tensors_to_torch(cumulus):
    fsdp.adapt()
    local = torch.zeros(4)
    _fsdp_param.free_storage(local)
    assert local.untyped_storage().size() == 0
    _fsdp_param.alloc_storage(local)
    assert local.untyped_storage().size() == 16


def test_a_malformed_resize_record_is_refused_and_the_session_lives_on(cumulus):
    tensor = torch.ones(4, device="cumulus")
    cumulus.submit(["@resize_storage", [tensor._wire(), "16"], {}, None])
    with pytest.raises(RemoteExecutionError, match=r"takes \[tensor, nbytes\]"):
        cumulus.synchronize()
    assert (tensor * 2).sum().item() == 8.0


def test_ops_on_another_stream_ordered_by_waits_and_events_see_each_others_results(cumulus):
    x = torch.ones(4, device="cumulus")
    side = torch.cumulus.Stream(priority=-1)
    side.wait_stream(torch.cumulus.current_stream())
    with torch.cumulus.stream(side):
        y = x * 2
        done = torch.cumulus.Event()
        done.record()
    torch.cumulus.current_stream().wait_event(done)
    assert (y + x).tolist() == [3.0, 3.0, 3.0, 3.0]


def test_an_events_synchronize_waits_for_the_ops_before_its_record(cumulus):
    F.embedding(torch.tensor([9], device="cumulus"), torch.ones(2, 2, device="cumulus"))
    event = torch.cumulus.Event()
    event.record()
    with pytest.raises(RemoteExecutionError, match="index out of range"):
        event.synchronize()


def test_timing_events_measure_the_ops_between_their_records(cumulus):
    start, end = torch.cumulus.Event(enable_timing=True), torch.cumulus.Event(enable_timing=True)
    start.record()
    torch.ones(64, 64, device="cumulus") @ torch.ones(64, 64, device="cumulus")
    end.record()
    assert start.elapsed_time(end) >= 0.0


def test_an_op_outside_aten_runs_here_with_its_kernel_for_the_device(cumulus, spec_ops):
    doubled = torch.ops.cumulus_spec.twice(torch.arange(3.0, device="cumulus"))
    assert doubled.tolist() == [0.0, 2.0, 4.0]


def test_an_op_outside_aten_without_a_kernel_for_the_device_is_refused_by_name(cumulus, spec_ops):
    with pytest.raises(NotImplementedError, match="cumulus_spec::cpu_only has no kernel"):
        torch.ops.cumulus_spec.cpu_only(torch.ones(2, device="cumulus"))


@pytest.fixture(scope="module")
def spec_ops():
    """Ops of a library of the tests' own: ``twice`` with a CompositeExplicitAutograd
    kernel (as the functional collectives have), ``cpu_only`` with a CPU one alone."""
    library = torch.library.Library("cumulus_spec", "DEF")
    library.define("twice(Tensor x) -> Tensor")
    library.impl("twice", lambda x: x * 2, "CompositeExplicitAutograd")
    library.define("cpu_only(Tensor x) -> Tensor")
    library.impl("cpu_only", lambda x: x * 2, "CPU")
    yield
    library._destroy()


def test_an_ops_result_is_freed_when_its_last_reference_goes_without_the_gc(cumulus):
    # A loop of big results must not pile up remote memory until a collection runs.
    import gc

    a, b = torch.ones(64, 64, device="cumulus"), torch.ones(64, 64, device="cumulus")
    before = cumulus.stats()["bytes_in_use"]
    gc.disable()
    try:
        for _ in range(5):
            assert (a @ b)[0, 0].item() == 64.0
        cumulus.synchronize()
        assert cumulus.stats()["bytes_in_use"] == before
    finally:
        gc.enable()


def test_quota_overflow_is_an_out_of_memory_error_and_session_survives(executor_address):
    with remote.attach(executor_address, quota_bytes=1 << 20):
        keep = torch.ones(1000, device="cumulus")
        with pytest.raises(RemoteOutOfMemoryError) as info:
            torch.empty(1 << 20, device="cumulus").fill_(1).sum().item()
        assert isinstance(info.value, torch.OutOfMemoryError)
        assert "quota" in str(info.value)
        assert keep.sum().item() == 1000.0


def test_detach_closes_the_session(executor_address):
    handle = remote.attach(executor_address)
    x = torch.ones(2, device="cumulus")
    remote.detach()
    assert handle.session.closed
    with pytest.raises(SessionClosedError):
        (x + 1).cpu()


def test_in_place_layout_ops_change_only_the_layout(cumulus):
    x = torch.arange(6.0, device="cumulus").reshape(2, 3)
    queued = x * 1  # names x by its old layout
    x.t_()
    assert x.shape == (3, 2)
    assert x.cpu().tolist() == [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]
    assert queued.cpu().tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert (torch.ones(2, 3, device="cumulus") @ torch.ones(3, device="cumulus")).tolist() == [
        3.0,
        3.0,
    ]


def test_eval_mode_batch_norm_matches_cpu(cumulus):
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm2d(3)
    bn.running_mean.uniform_()
    x = torch.randn(2, 3, 4, 4)
    with torch.no_grad():  # a live CPU graph would pin the weights (see issue notes)
        expected = bn.eval()(x)
    got = bn.to("cumulus").eval()(x.to("cumulus"))
    torch.testing.assert_close(got.cpu(), expected, rtol=0, atol=0)


def test_single_element_views_download(cumulus):
    x = torch.arange(6.0).reshape(2, 3)
    assert torch.diagonal(x.to("cumulus")[:1, 1:2]).cpu().tolist() == [1.0]


def test_a_cpu_model_with_gradients_moves_with_its_gradients(cumulus):
    # Module._apply swaps each moved parameter (and its grad) with its CPU original right
    # after queueing the upload; the upload must not name the swapped-out object.
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    lin(torch.randn(2, 4)).sum().backward()
    weight, grad = lin.weight.detach().clone(), lin.weight.grad.clone()
    lin.to("cumulus")
    torch.cumulus.synchronize()
    assert lin.weight.device.type == lin.weight.grad.device.type == "cumulus"
    assert torch.equal(lin.weight.cpu(), weight)
    assert torch.equal(lin.weight.grad.cpu(), grad)


def test_a_remote_model_moves_again_right_after_backward(cumulus):
    # Queued backward ops name views of the weights; Module._apply's swap_tensors refuses
    # a parameter that anything else still references.
    torch.manual_seed(0)
    local, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    far = copy.deepcopy(local).to("cumulus")
    local(x).sum().backward()
    loss = far(x.to("cumulus")).sum()
    loss.backward()
    far.to("cumulus")  # no sync point since backward
    torch.testing.assert_close(far.weight.cpu(), local.weight, rtol=0, atol=0)
    torch.testing.assert_close(far.weight.grad.cpu(), local.weight.grad, rtol=0, atol=0)


def test_a_pinning_data_loader_feeds_the_remote_device(cumulus):
    data = torch.utils.data.TensorDataset(torch.arange(8.0).reshape(4, 2))
    loader = torch.utils.data.DataLoader(data, batch_size=2, pin_memory=True)
    sums = [batch.to("cumulus", non_blocking=True).sum().item() for (batch,) in loader]
    assert sums == [6.0, 22.0]


def test_fork_rng_restores_the_remote_generator(cumulus):
    torch.manual_seed(3)
    expected = torch.rand(4)  # the CPU stream a CPU executor reproduces
    torch.manual_seed(3)
    with torch.random.fork_rng(device_type="cumulus"):
        torch.rand(16, device="cumulus")  # drawn, then forgotten
    assert torch.equal(torch.rand(4, device="cumulus").cpu(), expected)


def test_a_generator_state_of_the_wrong_size_fails_at_the_next_sync(cumulus):
    torch.cumulus.set_rng_state(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="does not fit"):
        torch.cumulus.synchronize()
    assert torch.cumulus.get_rng_state().numel() > 3  # the session carries on


def test_below_autograd_contiguous_copies_a_transposed_tensor_in_its_order(cumulus):
    # An op's handling here, or a library's kernel run here, dispatches below autograd:
    # ``contiguous`` then reaches the device as itself, whose schema claims a view.
    source = torch.arange(12.0).reshape(3, 4)
    transposed = source.to("cumulus").t()
    with torch._C._AutoDispatchBelowAutograd():
        dense = transposed.contiguous()
    assert dense.is_contiguous()
    assert torch.equal(dense.cpu(), source.t())
