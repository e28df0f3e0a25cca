"""GPU utilization for a provider's status: one NVML session, however many reads.

NVML cannot exist on this machine (no GPU), so a stand-in ``pynvml`` module plays the
library and records what was asked of it.
"""

from __future__ import annotations

import sys
import types

from cumulus_p2p.node.hardware import DeviceFacts, GpuMeter, cpu_facts

GPUS = [DeviceFacts("cuda", index, "RTX 4090", 24564, 0, "550.54") for index in range(4)]


class _NvmlError(Exception):
    pass


def _stand_in_nvml(*, broken: set[int] = frozenset()) -> types.ModuleType:
    """A ``pynvml`` whose GPU ``i`` is ``10 + i`` percent busy; reads of ``broken``
    GPUs fail as NVML does (a GPU fallen off the bus)."""
    nvml = types.ModuleType("pynvml")
    nvml.calls = []

    def handle(index: int) -> int:
        if index in broken:
            raise _NvmlError("GPU is lost")
        return index

    nvml.nvmlInit = lambda: nvml.calls.append("init")
    nvml.nvmlShutdown = lambda: nvml.calls.append("shutdown")
    nvml.nvmlDeviceGetHandleByIndex = handle
    nvml.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=10 + h)
    return nvml


def test_a_meter_opens_nvml_once_for_every_read_of_every_gpu(monkeypatch):
    nvml = _stand_in_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    with GpuMeter() as meter:
        reads = [[meter.utilization(gpu) for gpu in GPUS] for _tick in range(10)]
    assert reads == [[10, 11, 12, 13]] * 10
    assert nvml.calls == ["init", "shutdown"]


def test_a_meter_reads_nothing_for_a_cpu_or_without_nvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # importing it raises ImportError
    with GpuMeter() as meter:
        assert meter.utilization(GPUS[0]) is None
        assert meter.utilization(cpu_facts()) is None


def test_a_meter_not_opened_reads_nothing(monkeypatch):
    nvml = _stand_in_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert GpuMeter().utilization(GPUS[0]) is None
    assert nvml.calls == []


def test_a_gpu_that_fails_its_read_shows_none_and_the_others_still_read(monkeypatch):
    nvml = _stand_in_nvml(broken={1})
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    with GpuMeter() as meter:
        assert [meter.utilization(gpu) for gpu in GPUS] == [10, None, 12, 13]
    assert nvml.calls == ["init", "shutdown"]
