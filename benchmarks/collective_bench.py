"""Collectives between a job's hosts (issue 33): all-reduce speed, DDP and DiLoCo.

Two real CPU executor processes on loopback, each serving one rank's session; every
figure is measured in the same run against its baseline:

- ``allreduce_gb_s``: a float32 tensor all-reduced by the ``cumulus`` backend (the
  executors reduce among themselves in a gloo group; the ranks only send the record),
  bytes of the tensor per second of wall time, from the rank's side (its sync included),
  over the default links between the hosts: TLS 1.3 tunnels (``host/peerlinks.py``);
- ``allreduce_plain_gb_s``: the same over plain links (``CUMULUS_PEER_LINKS=plain``:
  gloo's own TCP, for hosts on one trusted network), and ``ddp_step_plain_s``, the DDP
  arm's step over plain links (both also with ``--shaped``);
- ``gloo_gb_s``: the same all-reduce between two plain processes with gloo;
- ``allreduce_via_consumer_gb_s``: the same all-reduce when the second executor takes no
  peer links (``--no-peer-links``): the ranks read the tensor back, reduce it among
  themselves and write it again (the price of a host behind NAT);
- ``ddp_step_s``, ``ddp_param_max_diff`` and ``consumer_bytes_share``: the standard
  torchrun DDP script of the tests (``tests/scripts/ddp_train.py``) through the shim, its
  median step time (``ddp_local_gloo_step_s``: the same script on gloo in two local
  processes), its largest parameter difference against that local run, and the bytes a
  training step adds to a rank's link against the bytes it all-reduces;
- ``diloco_utilization``: ``tests/scripts/diloco_train.py`` (AdamW inside, H = 100; 10
  in ``--quick``) through the shim: the share of wall time its steps spend training
  rather than synchronizing (``cumulus_p2p.diloco``).

Prints JSON and writes ``benchmarks/results/collective.json`` (not with ``--quick``)::

    python benchmarks/collective_bench.py [--quick] [--megabytes N]
    sudo .venv/bin/python benchmarks/collective_bench.py --shaped [--quick]

``--shaped`` runs on real links (``netns.shaped_mesh``, root): the two executors in host
namespaces joined at 1 Gbit/s, the ranks in the consumer's namespace behind 100 Mbit/s.
It measures the DDP and DiLoCo arms, and adds ``ddp_step_via_consumer_floor_s``: the
least a step would take if its all-reduce crossed the consumer's link (each rank's
gradients up and the sum back down, at the link's rate), and ``ddp_step_via_consumer_s``
(with ``ddp_via_consumer_param_max_diff``): the DDP arm again with the second host
started ``--no-peer-links``, so that its all-reduces do cross it. It writes
``collective_shaped.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "ddp_train.py"
#: The ranks' environment for plain links between the hosts (gloo's own TCP).
PLAIN = {"CUMULUS_PEER_LINKS": "plain"}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def rank_main(backend: str, megabytes: int, rounds: int, out: str) -> None:
    """One rank of the all-reduce timing (run as a torchrun child)."""
    import torch.distributed as dist

    device = "cumulus" if backend == "cumulus" else "cpu"
    if backend == "cumulus":
        import cumulus_p2p.shim as shim

        shim.connect(os.environ)
    dist.init_process_group(backend)
    tensor = torch.ones(megabytes * 2**20 // 4, device=device)
    dist.all_reduce(tensor)  # warm: connections, buffers
    tensor.sum().item()
    dist.barrier()
    started = time.perf_counter()
    for _ in range(rounds):
        dist.all_reduce(tensor)
    tensor[:1].sum().item()  # the executor has run them all
    seconds = time.perf_counter() - started
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"gb_s": megabytes * 2**20 * rounds / seconds / 1e9}))
    dist.destroy_process_group()


def torchrun(*args: str, env: dict[str, str] | None = None, prefix: tuple = ()) -> str:
    done = subprocess.run(
        [*prefix, *TORCHRUN, *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
        cwd=ROOT,
    )
    if done.returncode != 0:
        raise SystemExit(f"torchrun failed:\n{done.stderr[-3000:]}")
    return done.stdout


def all_reduce_gb_s(backend: str, megabytes: int, rounds: int, work: Path, env=None) -> float:
    out = work / f"allreduce-{backend}.json"
    torchrun(__file__, "--rank-of", backend, str(megabytes), str(rounds), str(out), env=env)
    return json.loads(out.read_text())["gb_s"]


def ddp_figures(executors, steps: int, work: Path, run=torchrun, meter=None, env=None) -> dict:
    """DDP's figures; ``meter(executors)`` is a context yielding the addresses to attach to
    and a function reading the bytes on a rank's link so far (default: loopback taps);
    ``env``, more of the ranks' environment."""
    local_step_s = _step_s(run(str(SCRIPT), str(work / "local.pt"), str(steps)))
    link_bytes = {}
    # The first run's upload of the model may leave it in the host's blob store, which
    # spares the next runs that upload: measured runs all come after one.
    for run_steps in (1, 1, steps):
        with (meter or _taps)(executors) as (addresses, read):
            ranks_env = {**(env or {}), "CUMULUS_EXECUTOR": ",".join(addresses)}
            out = run(
                "-m",
                "cumulus_p2p.shim",
                str(SCRIPT),
                str(work / "remote.pt"),
                str(run_steps),
                env=ranks_env,
            )
            link_bytes[run_steps] = read()
    local, remote = torch.load(work / "local.pt"), torch.load(work / "remote.pt")
    param_bytes = sum(v.numel() * v.element_size() for v in local.values())
    (work / "params.json").write_text(json.dumps({"bytes": param_bytes}))
    return {
        "ddp_step_s": _step_s(out),
        "ddp_local_gloo_step_s": local_step_s,
        "ddp_param_max_diff": max((local[k] - remote[k]).abs().max().item() for k in local),
        # What a step adds to a rank's link, against the gradient bytes it all-reduces.
        "consumer_bytes_share": (link_bytes[steps] - link_bytes[1]) / (steps - 1) / param_bytes,
    }


@contextlib.contextmanager
def _taps(executors):
    """Each rank's link on loopback, metered by a forwarder: the mean of the two."""
    from cumulus_p2p.testing.tap import tap

    with tap(executors[0]) as first, tap(executors[1]) as second:
        yield [first.address, second.address], lambda: (first.bytes + second.bytes) / 2


def _interface(consumer):
    """The consumer namespace's link, read from the kernel: half of it is a rank's."""

    def read() -> float:
        cat = consumer.command(
            "cat", *(f"/sys/class/net/eth0/statistics/{n}_bytes" for n in ("rx", "tx"))
        )
        return (
            sum(int(n) for n in subprocess.run(cat, capture_output=True, text=True).stdout.split())
            / 2
        )

    @contextlib.contextmanager
    def meter(executors):
        start = read()
        yield list(executors), lambda: read() - start

    return meter


DILOCO = ROOT / "tests" / "scripts" / "diloco_train.py"


def diloco_utilization(executors, quick: bool, run=torchrun) -> dict:
    """DiLoCo through the shim: the share of wall time not spent synchronizing (what
    the synchronizing steps took beyond an average plain step)."""
    steps, every = (20, 10) if quick else (200, 100)
    env = {"CUMULUS_EXECUTOR": ",".join(executors)}
    out = run(
        "-m", "cumulus_p2p.shim", str(DILOCO), os.devnull, str(steps), str(every), "4096", env=env
    )
    shares = []
    for rank in (json.loads(line) for line in out.splitlines() if line.startswith("{")):
        times = rank["step_s"]
        plain = [t for i, t in enumerate(times) if (i + 1) % every]
        # What the synchronizing steps took beyond an average step, against all.
        syncing = sum(
            t - statistics.mean(plain) for i, t in enumerate(times) if not (i + 1) % every
        )
        shares.append(1 - syncing / sum(times))
    return {"diloco_utilization": min(shares), "diloco_sync_every": every, "diloco_steps": steps}


def _step_s(stdout: str) -> float:
    ranks = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return max(rank["step_s"] for rank in ranks)


def shaped(quick: bool, work: Path) -> dict:
    """The DDP arm on shaped links: hosts at 1 Gbit/s, the consumer at 100 Mbit/s."""
    import functools

    from cumulus_p2p.testing.executor import executor_in
    from cumulus_p2p.testing.netns import shaped_mesh

    steps = 3 if quick else 8
    with shaped_mesh(hosts=2, consumer_mbit=100, host_mbit=1000) as mesh:
        with contextlib.ExitStack() as stack:
            executors = tuple(
                stack.enter_context(executor_in(host, work / host.name))[0] for host in mesh.hosts
            )
            run = functools.partial(torchrun, prefix=tuple(mesh.consumer.command()))
            meter = _interface(mesh.consumer)
            result = ddp_figures(executors, steps, work, run, meter)
            plain = ddp_figures(executors, steps, work, run, meter, env=PLAIN)
            result["ddp_step_plain_s"] = plain["ddp_step_s"]
            result |= diloco_utilization(executors, quick, run)
        # The same job with the second host taking no peer links: through the consumer.
        with contextlib.ExitStack() as stack:
            shut = ("--no-peer-links",)
            executors = (
                stack.enter_context(executor_in(mesh.hosts[0], work / "open"))[0],
                stack.enter_context(executor_in(mesh.hosts[1], work / "shut", extra=shut))[0],
            )
            via = ddp_figures(executors, steps, work, run, _interface(mesh.consumer))
        result["ddp_step_via_consumer_s"] = via["ddp_step_s"]
        result["ddp_via_consumer_param_max_diff"] = via["ddp_param_max_diff"]
        param_bytes = json.loads((work / "params.json").read_text())["bytes"]
        result["ddp_step_via_consumer_floor_s"] = 2 * param_bytes * 8 / (mesh.consumer_mbit * 1e6)
        result |= {"ddp_steps": steps, "consumer_mbit": mesh.consumer_mbit}
        result["host_mbit"] = mesh.host_mbit
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller and fewer (< 1 minute)")
    parser.add_argument("--megabytes", type=int, default=None, help="all-reduced tensor size")
    parser.add_argument("--shaped", action="store_true", help="on shaped links (root)")
    parser.add_argument("--rank-of", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_of:
        backend, megabytes, rounds, out = args.rank_of
        rank_main(backend, int(megabytes), int(rounds), out)
        return
    from cumulus_p2p.testing.executor import executor_process

    megabytes = args.megabytes or (16 if args.quick else 64)
    rounds = 5 if args.quick else 20
    steps = 3 if args.quick else 8
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"collective-bench-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    if args.shaped:
        result = shaped(args.quick, work)
        print(json.dumps(result, indent=2))
        if not args.quick:
            out = ROOT / "benchmarks" / "results" / "collective_shaped.json"
            out.write_text(json.dumps(result, indent=2))
        return
    result = {"megabytes": megabytes, "rounds": rounds, "ddp_steps": steps, "quick": args.quick}
    result["gloo_gb_s"] = all_reduce_gb_s("gloo", megabytes, rounds, work)
    with executor_process() as (first, _), executor_process() as (second, _):
        env = {"CUMULUS_EXECUTOR": f"{first},{second}"}
        result["allreduce_gb_s"] = all_reduce_gb_s("cumulus", megabytes, rounds, work, env)
        plain = {**env, **PLAIN}
        result["allreduce_plain_gb_s"] = all_reduce_gb_s("cumulus", megabytes, rounds, work, plain)
        result.update(ddp_figures((first, second), steps, work))
        plain_ddp = ddp_figures((first, second), steps, work, env=PLAIN)
        result["ddp_step_plain_s"] = plain_ddp["ddp_step_s"]
        result.update(diloco_utilization((first, second), args.quick))
    cut_off = executor_process(extra=["--no-peer-links"])
    with executor_process() as (first, _), cut_off as (second, _):
        env = {"CUMULUS_EXECUTOR": f"{first},{second}"}
        via_consumer = all_reduce_gb_s("cumulus", megabytes, rounds, work, env)
        result["allreduce_via_consumer_gb_s"] = via_consumer
    result["allreduce_vs_gloo"] = result["allreduce_gb_s"] / result["gloo_gb_s"]
    result["allreduce_plain_vs_gloo"] = result["allreduce_plain_gb_s"] / result["gloo_gb_s"]
    print(json.dumps(result, indent=2))
    if not args.quick:
        (ROOT / "benchmarks" / "results" / "collective.json").write_text(
            json.dumps(result, indent=2)
        )


if __name__ == "__main__":
    main()
