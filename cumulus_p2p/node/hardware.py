"""What this machine can offer: its GPUs through NVML, or its CPU, and how fast it is.

``detect()`` asks NVML (``pynvml``, from nvidia-ml-py) for each GPU's model, memory,
utilization and driver. Without a usable NVML (no NVIDIA driver, a container without
the device) it describes the CPU instead, and says why, so a provider knows it is
offering a CPU executor. ``self_benchmark`` times square matrix products on the device
the executor will use and turns them into performance units (GFLOP/s, rounded down):
the number offers carry and consumers filter on with ``--min-perf``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DeviceFacts:
    """One device a provider can offer.

    Attributes:
        kind: ``"cuda"`` or ``"cpu"``.
        index: The CUDA ordinal (0 for the CPU).
        model: e.g. ``"NVIDIA GeForce RTX 4090"`` or ``"cpu"``.
        memory_mib: Device memory (for a CPU: half the machine's RAM, as the offer's VRAM).
        utilization: Percent busy now (GPU only; ``None`` for a CPU).
        driver: The NVIDIA driver version, or ``""``.
    """

    kind: str
    index: int
    model: str
    memory_mib: int
    utilization: int | None
    driver: str

    @property
    def target(self) -> str:
        """The torch device an executor runs this device's sessions on."""
        return f"cuda:{self.index}" if self.kind == "cuda" else "cpu"


@dataclass(frozen=True, slots=True)
class Detection:
    """What ``detect`` found: the devices, and why there is no GPU when there is none."""

    devices: tuple[DeviceFacts, ...]
    notice: str = ""


def detect() -> Detection:
    """The GPUs NVML sees, else the CPU with a notice saying why."""
    try:
        gpus = _nvml_devices()
    except Exception as exc:  # noqa: BLE001 - pynvml raises NVMLError subclasses or OSError
        return Detection(
            (cpu_facts(),), f"no NVIDIA GPU usable through NVML ({exc}); offering a CPU executor"
        )
    if not gpus:
        return Detection((cpu_facts(),), "NVML reports no GPU; offering a CPU executor")
    return Detection(tuple(gpus))


def offered_devices(choice: str, found: Detection) -> tuple[DeviceFacts, ...]:
    """The devices ``--device`` names: ``auto`` every GPU NVML found (else the CPU),
    ``cpu``, or a comma-separated list of ``cuda`` (GPU 0) and ``cuda:N``.

    Raises:
        ValueError: a GPU named is not usable here (the message lists those that are),
            or one is named twice.
    """
    if choice == "auto":
        return found.devices
    if choice == "cpu":
        return (cpu_facts(),)
    gpus = tuple(offered_gpu(part, found) for part in choice.split(","))
    if len({g.index for g in gpus}) != len(gpus):
        raise ValueError(f"--device {choice}: a GPU is named twice")
    return gpus


def gpu_index(name: str) -> int | None:
    """The ordinal ``cuda`` (0) or ``cuda:N`` names; None when ``name`` is neither."""
    kind, colon, index = name.partition(":")
    if name == "cuda":
        return 0
    return int(index) if kind == "cuda" and colon and index.isdigit() else None


def offered_gpu(choice: str, found: Detection) -> DeviceFacts:
    """The GPU ``cuda[:N]`` names, from what NVML found.

    Raises:
        ValueError: ``choice`` names no GPU, no GPU is usable, or none has that index (the
            message lists them).
    """
    index = gpu_index(choice)
    if index is None:
        raise ValueError(f"--device {choice}: use cuda or cuda:N")
    gpus = [d for d in found.devices if d.kind == "cuda"]
    if not gpus:
        raise ValueError(f"--device {choice}, but no NVIDIA GPU is usable here (try --device auto)")
    for gpu in gpus:
        if gpu.index == index:
            return gpu
    listed = ", ".join(f"cuda:{g.index} ({g.model})" for g in gpus)
    raise ValueError(f"--device {choice}: this machine has {listed}")


def _nvml_devices() -> list[DeviceFacts]:
    import pynvml

    pynvml.nvmlInit()
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        found = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            busy = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu
            name = _text(pynvml.nvmlDeviceGetName(handle))
            found.append(DeviceFacts("cuda", index, name, memory.total // 2**20, busy, driver))
        return found
    finally:
        pynvml.nvmlShutdown()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def cpu_facts() -> DeviceFacts:
    pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    return DeviceFacts("cpu", 0, "cpu", pages * page_size // 2**20 // 2, None, "")


class GpuMeter:
    """Reads GPUs' utilization through one NVML session, open while the meter is entered.

    A provider's status reads every GPU every second on the node's event loop; opening
    and closing NVML for each read would make the driver set up its state for every GPU
    each time. Outside ``with`` (or without a usable NVML) every read is ``None``.
    """

    def __init__(self) -> None:
        self._nvml = None

    def __enter__(self) -> GpuMeter:
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception:  # noqa: BLE001 - no NVML: a status column shows nothing
            return self
        self._nvml = pynvml
        return self

    def __exit__(self, *exc_info) -> None:
        nvml, self._nvml = self._nvml, None
        if nvml is not None:
            nvml.nvmlShutdown()

    def utilization(self, device: DeviceFacts) -> int | None:
        """The device's utilization percent now (``None`` for a CPU or if NVML fails)."""
        if device.kind != "cuda" or self._nvml is None:
            return None
        try:
            handle = self._nvml.nvmlDeviceGetHandleByIndex(device.index)
            return int(self._nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        except Exception:  # noqa: BLE001 - a status column must never stop the node
            return None


def self_benchmark(device: str, *, seconds: float = 0.5, size: int = 512) -> int:
    """Performance units of ``device`` (``"cpu"`` or ``"cuda:N"``): measured GFLOP/s.

    Multiplies ``size``-square float32 matrices for about ``seconds`` after a warm-up.
    """
    import torch  # only a provider benchmarks: boot and consumer nodes never load torch

    dev = torch.device(device)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    a = torch.randn(size, size, device=dev)
    b = torch.randn(size, size, device=dev)
    torch.mm(a, b)
    sync()
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds or runs < 3:
        torch.mm(a, b)
        runs += 1
        if runs % 8 == 0:
            sync()
    sync()
    elapsed = time.perf_counter() - start
    return int(2 * size**3 * runs / elapsed / 1e9)
