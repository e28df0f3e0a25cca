"""Specs for the simulated GPU's memory (``simulation/gpu.py``): an overcommitted GPU pages
its tenants' memory with the executor's eviction policy, and the copies cost device time."""

from __future__ import annotations

import simpy

from cumulus_p2p.simulation.gpu import SimGpu

ON_DEMAND = (0, -100)
PAGE_S = 0.5  # per share, one way


def burst(env: simpy.Environment, gpu: SimGpu, tenant: str, shares: int, at: float):
    """``tenant`` computes 1 s at ``at``; returns the process (its value: when it ended)."""

    def go():
        yield env.timeout(at - env.now)
        yield from gpu.compute(tenant, ON_DEMAND, 1.0, shares)
        return env.now

    return env.process(go())


def run(gpu_shares: int | None, plan: list[tuple[str, int, float]]) -> tuple[SimGpu, list]:
    env = simpy.Environment()
    gpu = SimGpu(env, 100, memory_shares=gpu_shares, page_s_per_share=PAGE_S)
    ends = [burst(env, gpu, *step) for step in plan]
    env.run()
    return gpu, [p.value for p in ends]


def test_tenants_that_fit_in_memory_are_never_paged():
    gpu, ends = run(8, [("a", 4, 0.0), ("b", 4, 2.0), ("a", 4, 4.0), ("b", 4, 6.0)])
    assert ends == [1.0, 3.0, 5.0, 7.0]
    assert (gpu.paging_s, gpu.page_ins) == (0.0, 0)


def test_a_newcomer_pages_out_the_least_recently_used_and_it_pays_to_come_back():
    gpu, ends = run(8, [("a", 4, 0.0), ("b", 4, 2.0), ("c", 4, 4.0), ("a", 4, 10.0)])
    # c evicts a (4 shares out); a comes back: b out (4), a in (4).
    assert ends == [1.0, 3.0, 4.0 + 4 * PAGE_S + 1.0, 10.0 + 8 * PAGE_S + 1.0]
    assert gpu.page_ins == 1
    assert gpu.busy_s == 4.0  # the copies are not compute


def test_a_gpu_that_is_not_overcommitted_keeps_everyone_resident():
    gpu, ends = run(None, [("a", 6, 0.0), ("b", 6, 2.0), ("a", 6, 4.0)])
    assert ends == [1.0, 3.0, 5.0] and gpu.paging_s == 0.0


def test_a_tenant_whose_lease_ended_frees_its_memory():
    env = simpy.Environment()
    gpu = SimGpu(env, 100, memory_shares=8, page_s_per_share=PAGE_S)
    burst(env, gpu, "a", 8, 0.0)
    env.run()
    gpu.forget("a")
    burst(env, gpu, "b", 8, 2.0)
    env.run()
    assert gpu.paging_s == 0.0
