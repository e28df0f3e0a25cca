"""Hosts fetch an upload from hosts (issue 28): a model's first run on a new host, shaped links.

A consumer and three hosts are network namespaces on one switch (``netns.shaped_mesh``: the
consumer's link shaped to 100 Mbit/s each way, the hosts' to 1 Gbit/s). Real
``cumulus-node`` processes: the bootstrap node on host 0, provider *first* on host 1, and
later provider *second* on host 2; the consumer node in the consumer's namespace.

1. Job one runs on *first*, the only provider: its upload of the model (a few tensors over
   256 MiB, 1 GiB in all) crosses the consumer's link, as any first upload does.
2. *first* announces the model's pieces in the DHT; then *second* joins, cheaper, and job
   two (a consumer with a data directory of its own) leases it. *second* lacks every
   piece: the consumer's node has it fetch them from *first*, host to host, and the
   consumer sends digests.

Each job's script (``upload_job``, run by the shim in the consumer's namespace) times its
upload to the first result read back, and counts its link's bytes from the kernel's
interface counters. Prints one JSON object and writes ``benchmarks/results/blobshare.json``
(``blobshare_quick.json`` with ``--quick``: 48 MiB)::

    sudo .venv/bin/python benchmarks/blobshare_bench.py [--quick]

Keys:

- ``fetched_bytes``: what *second* fetched from *first* for job two (all of the model).
- ``fetch_consumer_bytes_share``: job two's link bytes over the model's bytes (job one's,
  the consumer's own upload, is about 1.05).
- ``fetch_upload_over_host_floor``: job two's upload over the model's time at the hosts'
  nominal rate (host to host is the link it crossed); ``upload_over_consumer_floor``: job
  one's over the consumer's nominal rate.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch

from cumulus_p2p.testing.linkrate import measure_mbit
from cumulus_p2p.testing.netns import interface_bytes, shaped_mesh
from cumulus_p2p.testing.nodes import NodeProcess, node_command, start_process, stop_all

RESULTS = Path(__file__).parent / "results"
MiB = 2**20
#: (tensor sizes in MiB): 1 GiB with tensors over 256 MiB, and the quick run's 48 MiB.
FULL = (300, 300, 300, 124)
QUICK = (16, 16, 16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="48 MiB instead of 1 GiB")
    parser.add_argument("--job", help=argparse.SUPPRESS)  # a job's script: tensor sizes
    args = parser.parse_args()
    if args.job:
        print(json.dumps(upload_job([int(n) for n in args.job.split(",")])), flush=True)
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: nodes stop, netns go
    result = run(QUICK if args.quick else FULL) | {"quick": args.quick}
    text = json.dumps(result, indent=2)
    print(text)
    (RESULTS / f"blobshare{'_quick' if args.quick else ''}.json").write_text(text + "\n")


def run(sizes: tuple[int, ...]) -> dict:
    with shaped_mesh(hosts=3, consumer_mbit=100, host_mbit=1000) as mesh:
        c, (_, h1, h2) = mesh.consumer, mesh.hosts
        progress("checking the shaping with one TCP stream per link")
        result = {
            "model_bytes": sum(sizes) * MiB,
            "consumer_link_mbit_measured": round(measure_mbit(c, h1, seconds=2.0), 1),
            "host_link_mbit_measured": round(measure_mbit(h1, h2, seconds=2.0), 1),
        }
        with tempfile.TemporaryDirectory() as work:
            result |= jobs(Path(work), mesh, sizes)
    model = result["model_bytes"] * 8 / 1e6
    one, two = result.pop("job_one"), result.pop("job_two")
    result |= {
        "upload_s": one["upload_s"],
        "upload_over_consumer_floor": round(one["upload_s"] / (model / mesh.consumer_mbit), 3),
        "upload_consumer_bytes_share": round(one["link_bytes"] / result["model_bytes"], 4),
        "fetch_upload_s": two["upload_s"],
        "fetch_upload_over_host_floor": round(two["upload_s"] / (model / mesh.host_mbit), 3),
        "fetch_consumer_bytes_share": round(two["link_bytes"] / result["model_bytes"], 4),
        "fetched_bytes": two["fetched"],
        "same_bytes": int(one["sum"] == two["sum"] == one["expected"]),
    }
    return result


def jobs(work: Path, mesh, sizes: tuple[int, ...]) -> dict:
    c, (h0, h1, h2) = mesh.consumer, mesh.hosts
    nodes: list[NodeProcess] = []
    try:
        boot = node_in(h0, work / "boot", listen=h0.address)
        nodes.append(boot)
        first = provider_in(h1, work / "first", boot.addr, "0.7")
        nodes.append(first)
        first.wait_for("providing", timeout=120)
        progress(f"job one: {sum(sizes)} MiB uploaded by the consumer to host 1")
        one = job_in(c, work / "one", boot.addr, sizes)
        pieces = sum(-(-n // 16) for n in sizes)
        first.wait_for_state(lambda s: s.get("blobs_announced", 0) >= pieces, timeout=120)
        second = provider_in(h2, work / "second", boot.addr, "0.3")
        nodes.append(second)
        second.wait_for("providing", timeout=120)
        progress("job two: on host 2, which fetches the model from host 1")
        two = job_in(c, work / "two", boot.addr, sizes)
        log = (work / "second" / "node.log").read_text().splitlines()
        for line in [x for x in log if "blob" in x or "fetch" in x][-10:]:
            progress(f"host 2: {line}")  # what its fetch did, or why it did not
    finally:
        stop_all(nodes)
    return {"job_one": one, "job_two": two}


def node_in(host, data_dir: Path, *args: str, listen: str) -> NodeProcess:
    flags = ["--data-dir", str(data_dir), "--listen", f"/ip4/{listen}/tcp/0", *args]
    return start_process(host.command(*node_command(*flags)), data_dir, listens=True)


def provider_in(host, data_dir: Path, boot: str, price: str) -> NodeProcess:
    flags = ["--provide", "--bootstrap", boot, "--price", price, "--no-live"]
    flags += ["--bench-seconds", "0.1", "--announce-interval", "1"]
    return node_in(host, data_dir, *flags, listen=host.address)


def job_in(consumer, data_dir: Path, boot: str, sizes: tuple[int, ...]) -> dict:
    """Run one job's script through a consumer node in ``consumer``'s namespace."""
    script = [__file__, "--job", ",".join(map(str, sizes))]
    flags = ["--data-dir", str(data_dir), "--consume", "--bootstrap", boot]
    flags += ["--listen", f"/ip4/{consumer.address}/tcp/0", "--announce-interval", "1"]
    # The Python device: the job reads its session's count of bytes fetched elsewhere.
    flags += ["--python-device", "--checkpoint-to", "consumer", "--", "python", *script]
    job = start_process(consumer.command(*node_command(*flags)), data_dir, listens=False)
    try:
        if job.proc.wait(timeout=1800) != 0:
            raise RuntimeError(f"the job failed:\n{job.output()}")
    finally:
        job.stop()
    for line in job.lines:
        if line.startswith("cumulus:") and "leased" not in line:
            progress(line.strip())  # what the shim said: a fetch refused, a failover
    return json.loads(next(x for x in reversed(job.lines) if x.startswith("{")))


def upload_job(sizes: list[int]) -> dict:
    """A job's script: upload "pretrained weights" made from a fixed seed and read a sum
    back; the time that took, and the link's bytes meanwhile."""
    import cumulus_p2p.remote as remote

    generator = torch.Generator().manual_seed(7)
    weights = [torch.randn(n * MiB // 4, generator=generator) for n in sizes]
    expected = sum(w.sum().item() for w in weights)
    rx, tx = interface_bytes()
    started = time.perf_counter()
    on_device = [w.to("cuda") for w in weights]
    total = sum(t.sum().item() for t in on_device)
    upload_s = time.perf_counter() - started
    rx2, tx2 = interface_bytes()
    session = remote.current_session()
    return {
        "upload_s": round(upload_s, 2),
        "link_bytes": (rx2 - rx) + (tx2 - tx),
        "fetched": session.fetched_elsewhere_bytes,
        "sum": total,
        "expected": expected,
    }


def progress(message: str) -> None:
    print(f"blobshare: {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
