"""The simulated world: which GPUs hosts own, what consumers run, how far apart they are.

Every number here is an input of the simulations, stated once so that a report can name
it. Where a figure was measured in this repository it says where; the rest are
assumptions, marked as such, to be replaced by real traces when a network has them.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

#: Shares a GPU is split into (the provider's default, ``cumulus-node --shares``).
SHARES_PER_GPU = 8


@dataclass(frozen=True, slots=True)
class GpuModel:
    """One kind of GPU: memory, speed relative to an RTX 4090 (= 100), list price."""

    name: str
    vram_mib: int
    perf_units: int
    price_per_gpu_hour: float  # credits
    weight: float  # its share of the hosts


#: The host mix. ASSUMED, not measured: a community-cloud fleet dominated by consumer
#: cards, priced like the on-demand listings of public GPU marketplaces in 2024-25
#: (RTX 3090 ~0.2, 4090 ~0.4, A100 ~0.8-1.1, H100 ~2 credits per GPU-hour, one credit
#: standing for one US dollar). No listing data was downloaded; replace with a trace.
GPU_MIX: tuple[GpuModel, ...] = (
    GpuModel("RTX 3090", 24_576, 55, 0.22, 0.30),
    GpuModel("RTX 4090", 24_576, 100, 0.40, 0.30),
    GpuModel("RTX A6000", 49_152, 60, 0.45, 0.10),
    GpuModel("A100 40GB", 40_960, 140, 0.80, 0.15),
    GpuModel("A100 80GB", 81_920, 150, 1.10, 0.10),
    GpuModel("H100 80GB", 81_920, 300, 2.20, 0.05),
)

#: Hosts price around the list price: log-normal with this sigma (ASSUMED).
PRICE_SIGMA = 0.2

#: Regions and round trips between them, ms (ASSUMED: typical public-internet RTTs).
REGIONS = ("us-east", "us-west", "eu-west", "eu-central", "asia-east")
_RTT_MS = {
    ("us-east", "us-west"): 65,
    ("us-east", "eu-west"): 80,
    ("us-east", "eu-central"): 95,
    ("us-east", "asia-east"): 190,
    ("us-west", "eu-west"): 140,
    ("us-west", "eu-central"): 150,
    ("us-west", "asia-east"): 120,
    ("eu-west", "eu-central"): 20,
    ("eu-west", "asia-east"): 220,
    ("eu-central", "asia-east"): 200,
}
SAME_REGION_RTT_MS = 10

#: Gossip: MEASURED on this machine (``benchmarks/mesh_bench.py``, BENCHMARKS.md): a
#: message reached 20 loopback nodes in 75.8 ms at the median, 179 ms at p99. GossipSub
#: meshes have degree ~6, so 20 nodes are ~2 hops; a hop costs the measured half plus
#: the link's round trip half.
GOSSIP_P50_20_NODES_MS = 75.8
GOSSIP_DEGREE = 6

#: Failover and checkpoints: MEASURED (``benchmarks/failover_bench.py``): a session
#: moved to another executor and resumed in 1.98 s; a checkpoint of 51.1 MB took 35 ms.
FAILOVER_S = 1.98
CHECKPOINT_S_PER_MB = 0.0351 / 51.1


#: Paging a tenant's memory between GPU and host RAM: ASSUMED, not measured here (no GPU
#: was lent for it): pinned copies over PCIe 4.0 x16 reach about 25 GB/s one way; half
#: of that is assumed for the executor's page-out and page-in of many storages.
#: ``benchmarks/eviction_bench.py --device cuda`` measures it on a GPU.
PAGE_GB_S = 12.0


def page_s_per_share(model: GpuModel) -> float:
    """Seconds to copy one share of ``model``'s memory between device and host, one way."""
    return model.vram_mib * 2**20 / SHARES_PER_GPU / (PAGE_GB_S * 1e9)


def rtt_ms(a: str, b: str) -> float:
    """Round trip between two regions."""
    if a == b:
        return SAME_REGION_RTT_MS
    return _RTT_MS.get((a, b)) or _RTT_MS[(b, a)]


def gossip_delay_s(nodes: int, rng: random.Random) -> float:
    """How long a published offer takes to reach a typical node of a ``nodes`` mesh.

    Hops grow with the logarithm of the mesh size; each costs what the measured
    20-node figure spent per hop. The delay is exponential around that median.
    """
    hops_20 = math.log(20) / math.log(GOSSIP_DEGREE)
    per_hop_s = GOSSIP_P50_20_NODES_MS / 1000 / hops_20
    hops = max(1.0, math.log(max(nodes, 2)) / math.log(GOSSIP_DEGREE))
    median_s = per_hop_s * hops
    return rng.expovariate(math.log(2) / median_s)  # exponential with that median


@dataclass(frozen=True, slots=True)
class Workload:
    """A kind of job: how busy it keeps its GPU while it holds one, how much it needs.

    ``duty`` is the fraction of wall time the job computes when it has a GPU to itself:
    hosted.ai reports whole-GPU utilization of 15% for inference, 50% for fine-tuning
    and 70% for training, which is what these duty cycles reproduce under whole-GPU
    allocation. ``compute_s`` is the device time the job needs on an RTX 4090.
    """

    name: str
    duty: float
    shares: tuple[int, int]  # memory need, in shares of a GPU (inclusive range)
    compute_s: tuple[float, float]  # device seconds on the reference GPU (range)
    weight: float  # share of arriving jobs


#: The job mix (ASSUMED; duty cycles from hosted.ai's utilization figures).
WORKLOADS: tuple[Workload, ...] = (
    Workload("inference", 0.15, (1, 2), (300.0, 900.0), 0.5),
    Workload("fine-tuning", 0.50, (2, 4), (900.0, 2700.0), 0.3),
    Workload("training", 0.70, (3, 6), (1800.0, 5400.0), 0.2),
)


def pick(rng: random.Random, items, weight=lambda x: x.weight):
    """One of ``items``, chosen by weight."""
    return rng.choices(items, weights=[weight(x) for x in items])[0]
