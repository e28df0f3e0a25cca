"""torch.distributed across hosts: a job's collectives run among its executors.

The slow specs run a standard torchrun DDP script (``tests/scripts/ddp_train.py``)
through the shim against two real executor processes, each rank's link metered by a
forwarder (``testing/tap.py``). The others drive the executor's side
(``host/collectives.py``) with real gloo groups on loopback, one thread a rank.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import torch.distributed.fsdp  # noqa: F401 - defines FSDP2's own ops (torch.ops.fsdp)

from cumulus_p2p import remote
from cumulus_p2p._errors import RemoteExecutionError
from cumulus_p2p.diloco import DiLoCo
from cumulus_p2p.host.collectives import (
    CollectiveGroups,
    Membership,
    collective_runs,
    is_collective,
)
from cumulus_p2p.host.handles import ErrorKind, OpFailed
from cumulus_p2p.remote.distributed import _ThroughConsumer
from cumulus_p2p.remote.regroup import peer_links
from cumulus_p2p.testing import nodes
from cumulus_p2p.testing.executor import executor_process
from cumulus_p2p.testing.tap import tap

SCRIPT = Path(__file__).parent / "scripts" / "ddp_train.py"
PREFIX = "0123456789abcdef0123456789abcdef"


def torchrun(*args: str, env: dict[str, str] | None = None) -> list[dict]:
    """Run a script on two ranks (``nodes.torchrun``); return each rank's JSON line."""
    done = nodes.torchrun(*args, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return nodes.json_lines(done.stdout)


@pytest.fixture(scope="module")
def two_executors():
    with executor_process() as (first, _), executor_process() as (second, _):
        yield first, second


def run_on_executors(
    executors, out: Path, steps: int, links: str = "tls"
) -> tuple[list[dict], list[int]]:
    """The script through the shim, rank i on executor i; also each rank's link bytes."""
    with tap(executors[0]) as first, tap(executors[1]) as second:
        env = {"CUMULUS_EXECUTOR": f"{first.address},{second.address}"}
        env["CUMULUS_PEER_LINKS"] = links
        ranks = torchrun("-m", "cumulus_p2p.shim", str(SCRIPT), str(out), str(steps), env=env)
        return ranks, [first.bytes, second.bytes]


@pytest.mark.slow
@pytest.mark.parametrize("links", ["tls", "plain"])
def test_a_torchrun_ddp_script_ends_with_the_parameters_of_local_gloo_ddp(
    links, two_executors, tmp_path
):
    saved, _ = nodes.local_ddp_run(SCRIPT, "3", scratch=tmp_path)
    run_on_executors(two_executors, tmp_path / "remote.pt", 3, links)
    local, remote = torch.load(saved), torch.load(tmp_path / "remote.pt")
    assert local.keys() == remote.keys()
    for name, value in local.items():
        assert torch.allclose(remote[name], value, rtol=0, atol=1e-6), name


@pytest.mark.slow
def test_gradients_are_reduced_between_hosts_not_over_the_consumers_link(two_executors, tmp_path):
    # The script uploads its model and downloads it at the end, whatever the steps: what a
    # step adds to a rank's link is what the collectives would cross it if they did.
    _, short = run_on_executors(two_executors, tmp_path / "short.pt", 2)
    _, long = run_on_executors(two_executors, tmp_path / "long.pt", 6)
    params = torch.load(tmp_path / "long.pt").values()
    param_bytes = sum(v.numel() * v.element_size() for v in params)
    for before, after in zip(short, long, strict=True):
        per_step = (after - before) / 4
        assert per_step < 0.01 * param_bytes, (per_step, param_bytes)


def ends_as_local(script: Path, args: list[str], executors, tmp_path) -> list[dict]:
    """Run ``script OUT *args`` through the shim, rank i on ``executors[i]``, and check
    that each rank's losses and the parameters it saved are local gloo's (the same
    script on this machine's CPU); return each rank's JSON line."""
    saved, local = nodes.local_ddp_run(script, *args, scratch=tmp_path)
    env = {"CUMULUS_EXECUTOR": ",".join(executors)}
    shim = ["-m", "cumulus_p2p.shim", str(script), str(tmp_path / "remote.pt"), *args]
    remote = torchrun(*shim, env=env)
    by_rank = {r["rank"]: r["losses"] for r in local}
    for ran in remote:
        assert ran["losses"] == pytest.approx(by_rank[ran["rank"]], rel=1e-6)
    local_params, remote_params = torch.load(saved), torch.load(tmp_path / "remote.pt")
    assert local_params.keys() == remote_params.keys()
    for name, value in local_params.items():
        assert torch.allclose(remote_params[name], value, rtol=0, atol=1e-6), name
    return remote


@pytest.fixture(scope="module")
def one_host_cut_off():
    """Two executors, the second of which takes no connections from other hosts."""
    with (
        executor_process() as (first, _),
        executor_process(extra=["--no-peer-links"]) as (second, _),
    ):
        yield first, second


@pytest.mark.slow
def test_a_ddp_job_whose_host_takes_no_peer_links_runs_its_collectives_through_the_consumer(
    one_host_cut_off, tmp_path
):
    saved, _ = nodes.local_ddp_run(SCRIPT, "3", scratch=tmp_path)
    with tap(one_host_cut_off[0]) as first, tap(one_host_cut_off[1]) as second:
        env = {"CUMULUS_EXECUTOR": f"{first.address},{second.address}"}
        args = ["-m", "cumulus_p2p.shim", str(SCRIPT), str(tmp_path / "remote.pt"), "3"]
        done = nodes.torchrun(*args, env=env)
        assert done.returncode == 0, done.stderr[-4000:]
        links = [first.bytes, second.bytes]
    local, remote = torch.load(saved), torch.load(tmp_path / "remote.pt")
    for name, value in local.items():
        assert torch.allclose(remote[name], value, rtol=0, atol=1e-6), name
    # Rank 0 said once where the collectives go, and why.
    assert done.stderr.count("the hosts of ranks [1] take no connections") == 1
    # Each step's gradients crossed both ranks' links, back to the consumer and out again.
    param_bytes = sum(v.numel() * v.element_size() for v in local.values())
    assert all(carried > 2 * 3 * param_bytes for carried in links), (links, param_bytes)


@pytest.mark.slow
def test_an_fsdp2_job_whose_host_takes_no_peer_links_ends_as_local_gloo_fsdp2(
    one_host_cut_off, tmp_path
):
    ends_as_local(SCRIPT.parent / "fsdp_train.py", ["3"], one_host_cut_off, tmp_path)


@pytest.mark.slow
def test_a_worker_tells_its_session_that_its_host_takes_no_peer_links():
    with executor_process(extra=["--worker-per-session", "--no-peer-links"]) as (address, _):
        with remote.attach(address) as session:
            assert session.info["peer_links"] is False


@pytest.mark.parametrize(
    ("sizes", "out_per_in", "why"),
    [
        ([(4, 4), (5, 5)], Fraction(1), "rank 0: 4 elements into 4, rank 1: 5 elements into 5"),
        ([(5, 2), (5, 2)], Fraction(1, 2), "5 elements do not split into 2 equal parts"),
        ([(4, 3), (4, 3)], Fraction(2), "writes 8 elements of the input's dtype, not 3"),
    ],
    ids=["unlike-ranks", "no-even-split", "wrong-output"],
)
def test_ranks_reducing_through_the_consumer_with_unfit_tensors_each_get_a_clear_error(
    sizes, out_per_in, why
):
    server = torch.distributed.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    port = server.port
    errors: list = [None, None]

    def rank(index: int, sent: torch.Tensor, received: torch.Tensor) -> None:
        store = torch.distributed.TCPStore("127.0.0.1", port, 2, is_master=False)
        through = _ThroughConsumer(store, index, 2, timedelta(seconds=10))
        try:
            through.agree(sent, received, out_per_in)
        except ValueError as exc:
            errors[index] = exc

    threads = [
        threading.Thread(target=rank, args=(i, torch.zeros(n), torch.zeros(m)))
        for i, (n, m) in enumerate(sizes)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert all(why in str(e) for e in errors), errors


def test_a_host_without_peer_links_refuses_to_serve_a_store_or_join_a_group():
    groups = CollectiveGroups(peer_links=False)
    with pytest.raises(OpFailed, match="no connections from other hosts"):
        groups.serve_store("127.0.0.1", 2, PREFIX)
    member = Membership("job", "127.0.0.1", 1, PREFIX, 0, 2, "127.0.0.1", 5.0)
    with pytest.raises(OpFailed, match="no connections from other hosts"):
        groups.join(member)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [[], ["--worker-per-session"]], ids=["shared", "workers"])
def test_two_ranks_on_one_executor_do_not_wait_on_each_others_device_turn(workers, tmp_path):
    # A collective waits for the other rank: in a device turn, it would keep that rank's
    # own turn from coming, until the group's timeout.
    with executor_process(extra=workers) as (address, _):
        env = {"CUMULUS_EXECUTOR": f"{address},{address}"}
        ranks = torchrun(
            "-m", "cumulus_p2p.shim", str(SCRIPT), str(tmp_path / "p.pt"), "2", env=env
        )
    assert sorted(rank["rank"] for rank in ranks) == [0, 1]


#: A rank that joins a group of two whose other rank never comes, then waits out its timeout.
LONELY_RANK = """
import sys, torch, cumulus_p2p.remote as remote
with remote.attach(sys.argv[1]) as session:
    port = session.call(["@pg_store", ["127.0.0.1", 2, "0123456789abcdef"], {}, None])
    join = ["job", "127.0.0.1", port, "0123456789abcdef", 0, 2, "127.0.0.1", 6.0]
    print("joining", flush=True)
    session.submit(["@pg_join", join, {}, None])
    try:
        session.synchronize()
    except Exception as exc:
        print(type(exc).__name__, flush=True)
"""


@pytest.mark.slow
@pytest.mark.timing  # a bound of 3 s against the lonely rank's 6: alone, not under load
def test_a_rank_waiting_for_its_group_does_not_hold_up_another_tenant(executor_address, cumulus):
    lonely = subprocess.Popen(
        [sys.executable, "-c", LONELY_RANK, executor_address], stdout=subprocess.PIPE, text=True
    )
    try:
        assert lonely.stdout.readline().strip() == "joining"
        time.sleep(0.5)  # its join has reached the executor and waits there
        started = time.monotonic()
        x = torch.arange(4.0, device="cumulus")
        assert (x * 2).sum().item() == 12.0
        assert time.monotonic() - started < 3.0  # not the 6 s the lonely rank waits
        assert lonely.stdout.readline().strip() == "RemoteRuntimeError"  # its timeout
    finally:
        lonely.kill()
        lonely.wait()


def test_collectives_are_cut_out_of_a_batch_in_order():
    ops = [["aten.add.Tensor"], ["@pg_allreduce"], ["@pg_allreduce"], ["aten.mul.Tensor"], ["x"]]
    runs = collective_runs(ops)
    assert runs == [[ops[0]], [ops[1]], [ops[2]], [ops[3], ops[4]]]
    assert [is_collective(run[0]) for run in runs] == [False, True, True, False]


@pytest.mark.slow
def test_diloco_across_two_executors_ends_with_the_parameters_of_local_gloo_diloco(
    two_executors, tmp_path
):
    script, args = SCRIPT.parent / "diloco_train.py", ["6", "3", "512", "sgd"]
    remote = ends_as_local(script, args, two_executors, tmp_path)
    assert [r["syncs"] for r in remote] == [2, 2]


@pytest.mark.slow
def test_an_fsdp2_script_ends_with_the_parameters_of_local_gloo_fsdp2(two_executors, tmp_path):
    ends_as_local(SCRIPT.parent / "fsdp_train.py", ["3"], two_executors, tmp_path)


def test_a_functional_collectives_wait_tensor_returns_its_input(cumulus):
    tensor = torch.ones(4, device="cumulus")
    assert torch.ops._c10d_functional.wait_tensor(tensor) is tensor


def test_an_fsdp2_op_gives_on_cumulus_what_it_gives_on_the_cpu(cumulus):
    # chunk_cat lays out the gradients FSDP2 reduce-scatters: each one's rows in chunks,
    # padded (3 rows make 2 chunks of 2).
    grads = [torch.arange(6.0).reshape(3, 2), torch.arange(4.0)]
    expected = torch.empty(2, 6)
    torch.ops.fsdp.chunk_cat(grads, 0, 2, out=expected)
    out = torch.empty(2, 6, device="cumulus")
    torch.ops.fsdp.chunk_cat([g.to("cumulus") for g in grads], 0, 2, out=out)
    assert torch.equal(out.cpu(), expected)


def test_diloco_refuses_a_sync_interval_below_one_step():
    with pytest.raises(ValueError, match="at least 1"):
        DiLoCo(torch.nn.Linear(2, 2), None, sync_every=0)  # type: ignore[arg-type]


def form_group(
    world: int, *, timeout_s: float = 10.0, links: str = "tls"
) -> list[CollectiveGroups]:
    """``world`` sessions' groups, joined as one job named ``job``."""
    groups = [CollectiveGroups() for _ in range(world)]
    port = groups[0].serve_store("127.0.0.1", world, PREFIX, links)
    joins = [member(port, rank, world, timeout_s, links=links) for rank in range(world)]
    each_rank(groups, lambda rank, group: group.join(joins[rank]))
    return groups


def member(
    port: int, rank: int, world: int, timeout_s: float, prefix: str = PREFIX, links: str = "tls"
) -> Membership:
    return Membership("job", "127.0.0.1", port, prefix, rank, world, "127.0.0.1", timeout_s, links)


def each_rank(groups, work) -> list:
    """Run ``work(rank, group)`` on every rank at once; return results (or the OpFailed)."""
    results: list = [None] * len(groups)

    def run(rank: int) -> None:
        try:
            results[rank] = work(rank, groups[rank])
        except OpFailed as exc:
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(len(groups))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return results


def test_a_groups_store_listens_on_the_hosts_address_alone():
    groups = CollectiveGroups()
    port = groups.serve_store("127.0.0.1", 2, PREFIX)
    socket.create_connection(("127.0.0.1", port), timeout=5).close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.2", port), timeout=5)


@pytest.mark.parametrize("links", ["tls", "plain"])
def test_an_all_reduce_sums_every_ranks_tensor_in_place(links):
    groups = form_group(2, links=links)
    tensors = [torch.full((5,), 1.0), torch.full((5,), 2.0)]
    each_rank(groups, lambda rank, group: group.all_reduce("job", tensors[rank], "SUM"))
    assert all(torch.equal(t, torch.full((5,), 3.0)) for t in tensors)


def test_a_strided_view_is_reduced_in_place_through_a_copy():
    groups = form_group(2)
    bases = [torch.zeros(4, 4) + rank + 1 for rank in range(2)]
    each_rank(groups, lambda rank, group: group.all_reduce("job", bases[rank].t()[1], "MAX"))
    assert torch.equal(bases[0][:, 1], torch.full((4,), 2.0))
    assert torch.equal(bases[0][:, 0], torch.full((4,), 1.0))  # the rest is untouched


def test_a_broadcast_copies_the_roots_tensor_to_every_rank():
    groups = form_group(2)
    tensors = [torch.arange(3.0), torch.zeros(3)]
    each_rank(groups, lambda rank, group: group.broadcast("job", tensors[rank], 0))
    assert torch.equal(tensors[1], torch.arange(3.0))


def test_an_all_gather_into_one_tensor_lays_the_ranks_tensors_end_to_end_in_rank_order():
    groups = form_group(2)
    outputs = [torch.zeros(6), torch.zeros(6)]
    each_rank(
        groups,
        lambda rank, group: group.all_gather_base(
            "job", outputs[rank], torch.full((3,), rank + 1.0)
        ),
    )
    expected = torch.tensor([1.0, 1.0, 1.0, 2.0, 2.0, 2.0])
    assert all(torch.equal(out, expected) for out in outputs)


def test_an_all_gather_into_a_strided_view_writes_it_through_a_copy():
    groups = form_group(2)
    bases = [torch.zeros(4, 2), torch.zeros(4, 2)]
    each_rank(
        groups,
        lambda rank, group: group.all_gather_base(
            "job", bases[rank][:, 1], torch.full((2,), rank + 1.0)
        ),
    )
    assert torch.equal(bases[0][:, 1], torch.tensor([1.0, 1.0, 2.0, 2.0]))
    assert torch.equal(bases[0][:, 0], torch.zeros(4))  # the rest is untouched


def test_a_reduce_scatter_leaves_each_rank_its_part_of_the_average():
    # FSDP2 reduces fp32 gradients with AVG.
    groups = form_group(2)
    inputs = [torch.arange(4.0), torch.arange(4.0) * 3]
    outputs = [torch.zeros(2), torch.zeros(2)]
    each_rank(
        groups,
        lambda rank, group: group.reduce_scatter("job", outputs[rank], inputs[rank], "AVG"),
    )
    assert torch.equal(outputs[0], torch.tensor([0.0, 2.0]))
    assert torch.equal(outputs[1], torch.tensor([4.0, 6.0]))


@pytest.mark.parametrize(
    ("tensor", "output", "error"),
    [
        (torch.ones(4), torch.zeros(3), "writes 2 elements of the input's dtype, not 3"),
        (torch.ones(5), torch.zeros(2), "5 elements do not split into 2 equal parts"),
        (torch.ones(4), torch.zeros(2, dtype=torch.float64), "of the input's dtype"),
    ],
    ids=["output-too-big", "uneven-input", "output-dtype"],
)
def test_a_reduce_scatter_that_cannot_fit_its_output_fails_on_every_rank_and_the_group_lives_on(
    tensor, output, error
):
    groups = form_group(2)
    results = each_rank(
        groups, lambda rank, group: group.reduce_scatter("job", output.clone(), tensor, "SUM")
    )
    assert all(isinstance(r, OpFailed) and error in str(r) for r in results), results
    again = [torch.zeros(1), torch.zeros(1)]
    each_rank(
        groups, lambda rank, group: group.reduce_scatter("job", again[rank], torch.ones(2), "SUM")
    )
    assert torch.equal(again[1], torch.full((1,), 2.0))


def test_ranks_bringing_outputs_of_different_sizes_to_a_reduce_scatter_all_get_a_clear_error():
    groups = form_group(2)
    outputs = [torch.zeros(2), torch.zeros(3)]
    results = each_rank(
        groups,
        lambda rank, group: group.reduce_scatter("job", outputs[rank], torch.ones(4), "SUM"),
    )
    for result in results:
        assert isinstance(result, OpFailed)
        assert "rank 0: 4 elements into 2, rank 1: 4 elements into 3" in str(result)


def test_ranks_bringing_tensors_of_different_sizes_all_get_a_clear_error():
    groups = form_group(2)
    tensors = [torch.ones(10), torch.ones(12)]
    results = each_rank(groups, lambda rank, group: group.all_reduce("job", tensors[rank], "SUM"))
    assert all(isinstance(r, OpFailed) and "different tensors" in str(r) for r in results)
    # Nobody was aborted, and the group is still in step for the next collective.
    again = [torch.ones(2), torch.ones(2)]
    each_rank(groups, lambda rank, group: group.all_reduce("job", again[rank], "SUM"))
    assert torch.equal(again[0], torch.full((2,), 2.0))


def test_a_collective_whose_other_ranks_never_come_fails_after_the_groups_timeout():
    groups = form_group(2, timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(OpFailed, match="collective in group 'job'") as failed:
        groups[0].all_reduce("job", torch.ones(3), "SUM")
    assert time.monotonic() - started < 10
    # The script's to see, not a lost peer's: going back would only wait for it again.
    assert failed.value.kind == ErrorKind.RUNTIME


def test_a_host_without_the_jobs_prefix_cannot_join_its_group():
    groups = [CollectiveGroups(), CollectiveGroups(), CollectiveGroups()]
    port = groups[0].serve_store("127.0.0.1", 2, PREFIX)
    outsider = member(port, 1, 2, 2.0, prefix="f" * 32)
    joins = [member(port, 0, 2, 2.0), member(port, 1, 2, 2.0), outsider]
    results = each_rank(groups, lambda rank, group: group.join(joins[rank]))
    assert results[:2] == [None, None]
    assert isinstance(results[2], OpFailed) and "could not join" in str(results[2])


@pytest.mark.parametrize(
    "args",
    [
        ["job"],
        ["job", "127.0.0.1", 1, PREFIX, 0, 2, "127.0.0.1", True],
        ["job", "127.0.0.1", 1, PREFIX, 2, 2, "127.0.0.1", 5.0],
        ["job", "127.0.0.1", 1, "short", 0, 2, "127.0.0.1", 5.0],
        ["job", "127.0.0.1", 70000, PREFIX, 0, 2, "127.0.0.1", 5.0],
        ["job", "127.0.0.1", 1, PREFIX, 0, 2, "127.0.0.1", 5.0, "udp"],
    ],
    ids=[
        "too-few-fields",
        "timeout-not-a-number",
        "rank-outside-world",
        "short-prefix",
        "port",
        "unknown-links",
    ],
)
def test_a_malformed_join_is_refused_with_what_is_wrong(args):
    with pytest.raises(OpFailed):
        Membership.parse(args)


def test_a_collective_in_a_group_the_session_never_joined_fails_and_the_session_lives_on(cumulus):
    tensor = torch.ones(4, device="cumulus")
    cumulus.submit(["@pg_allreduce", ["job", tensor._wire(), "SUM"], {}, None])
    with pytest.raises(RemoteExecutionError, match="in no group 'job'"):
        cumulus.synchronize()
    assert (tensor * 2).sum().item() == 8.0


#: Where a record names the test's tensor.
A_TENSOR = object()


@pytest.mark.parametrize(
    ("record", "args", "error"),
    [
        ("@pg_reduce_scatter", ["job", A_TENSOR, A_TENSOR], r"takes \[group, output, tensor, op\]"),
        ("@pg_reduce_scatter", ["job", A_TENSOR, A_TENSOR, "MEDIAN"], "unknown reduction 'MEDIAN'"),
        ("@pg_allgather_base", ["job", A_TENSOR], r"takes \[group, output, tensor\]"),
    ],
    ids=["reduce-scatter-without-op", "unknown-reduction", "all-gather-without-input"],
)
def test_a_malformed_sharding_collective_is_refused_and_the_session_lives_on(
    cumulus, record, args, error
):
    tensor = torch.ones(4, device="cumulus")
    wires = [tensor._wire() if arg is A_TENSOR else arg for arg in args]
    cumulus.submit([record, wires, {}, None])
    with pytest.raises(RemoteExecutionError, match=error):
        cumulus.synchronize()
    assert (tensor * 2).sum().item() == 8.0


def test_a_join_with_other_links_than_its_store_is_refused():
    groups = CollectiveGroups()
    port = groups.serve_store("127.0.0.1", 2, PREFIX, "plain")
    with pytest.raises(OpFailed, match="other links"):
        groups.join(member(port, 0, 2, 2.0, links="tls"))


def test_an_unknown_peer_links_setting_is_refused_naming_the_choices(monkeypatch):
    monkeypatch.setenv("CUMULUS_PEER_LINKS", "fast")
    with pytest.raises(ValueError, match="'tls' .* or 'plain'"):
        peer_links()


def test_closing_a_sessions_groups_closes_their_links_between_hosts():
    groups = form_group(2)
    ports = [tunnel.port for group in groups for tunnel in group._tunnels.values()]
    assert len(ports) == 2  # one tunnel a rank: rank 0's also admits the others to its store
    for group in groups:
        group.close()
    for port in ports:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5)
