"""Check a leased host's device against its offer before the script runs on it.

In the first seconds of a lease the shim reads the executor's device facts from the
session's welcome and measures the device through the session (``measure``); the
consumer node compares them with the offer the lease names (``judge``, sans-IO). A host
whose device is not the model it offered, or much slower than the performance units it
claimed, misrepresents: the consumer ends the lease, paying only for the probe, reports
the measurement (``PerformanceObservation``) and leases elsewhere.

The measurement is matrix multiplication in float32, the unit of the host's own
self-benchmark (``hardware.self_benchmark``), on matrices sized from the claim so that
one product takes about ``TARGET_OP_S`` on the claimed device: large enough that the
session's cost per op does not count, small enough that a host far slower than it
claims is found out within a second or two. Constant matrices keep the remote random
generator untouched, so the script's results do not depend on the probe.

One measurement through a shared machine is noisy, and a busy host is not lying: while
the device falls short of the claim, the shim measures again after a pause, up to
``ATTEMPTS`` times, and sends the best (``best_of``). A host that lies falls short every
time; a device that meets its claim is measured once, and so is one a hundredfold short
(a CPU offered as a GPU), which no load explains.

What the probe cannot check: the device memory (it would have to fill the lease's
share), and a host that lies about its device's name in the session's welcome.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the shim measures; only the node judges, and it has the market loaded
    from ..market import Offer

#: Hosts probed before giving up when each one misrepresents its device.
MAX_PROBED_HOSTS = 4
#: A measured performance below this fraction of the claim is a misrepresentation. The
#: margin is wide: tenants share the device, and a busy host (a CPU provider whose
#: machine runs other work, measured on a 2-core machine) can measure a quarter of its
#: quiet self-benchmark; a host that claims a GPU and has a CPU falls short a
#: hundredfold or more.
MIN_PERF_RATIO = 0.1
#: Seconds one probe product should take on the claimed device.
TARGET_OP_S = 0.002
#: Seconds of measurement (at least one product is always timed).
BUDGET_S = 0.5
#: Seconds of measurement after which a device already at its claim is measured no
#: longer: a device far faster than it claims would otherwise run ever larger batches
#: for the whole budget, each product an op record on the consumer's link (a claim of
#: 1 unit on this CPU: over 1 MiB of records).
ENOUGH_S = 0.05
#: Measurements taken before a device is found short of its claim. Five probes in a row
#: of one CPU executor on the 2-core test machine at a load average of 7 read 19 to 131
#: units against a claim of 25 (a sevenfold spread); at a load of 15, single probes found
#: all three honest providers of a run under a tenth of their claims and banned them, and
#: the best of three probes 0.5 s apart once read an honest host at 7 of its 77 units.
ATTEMPTS = 5
#: A measurement below this fraction of the claim is not a busy host's: the worst seen of
#: an honest CPU host under the test suite's load was 1 of 13 units (8%); a CPU offered as
#: a GPU measures a thousandth. It is judged at once, without measuring again.
HOPELESS_RATIO = 0.01
#: Seconds before the first measurement again, doubling before each next one (0.5 to 4 s,
#: 7.5 s in all): a burst of other work on the host has that long to pass, and a host
#: that lies has its lease ended that much later, paying for the probe only.
RETRY_PAUSE_S = 0.5


@dataclass(frozen=True, slots=True)
class ProbeFacts:
    """What the probe found on the leased device.

    Attributes:
        device: The executor's device (``"cuda:0"``, ``"cpu"``).
        device_name: Its model, as the executor names it.
        quota_bytes: The device memory the session may use.
        perf_units: Measured float32 matmul GFLOP/s through the session (the best
            measurement).
        seconds: How long the measurements took, all of them.
    """

    device: str
    device_name: str
    quota_bytes: int
    perf_units: int
    seconds: float

    def to_wire(self) -> dict:
        return {
            "device": self.device, "device_name": self.device_name,
            "quota_bytes": self.quota_bytes, "perf_units": self.perf_units,
            "seconds": self.seconds,
        }  # fmt: skip

    @classmethod
    def from_wire(cls, value: object) -> ProbeFacts:
        """Raises: ValueError: not probe facts."""
        if not isinstance(value, dict):
            raise ValueError("probe facts must be a map")
        facts = cls(
            value.get("device"), value.get("device_name"), value.get("quota_bytes"),
            value.get("perf_units"), value.get("seconds"),
        )  # fmt: skip
        if not (
            isinstance(facts.device, str) and isinstance(facts.device_name, str)
            and type(facts.quota_bytes) is int and type(facts.perf_units) is int
            and isinstance(facts.seconds, float) and facts.perf_units >= 0
        ):  # fmt: skip
            raise ValueError("probe facts have the wrong types")
        return facts


def probe_size(claimed_perf: int) -> int:
    """The matrix side whose product takes about ``TARGET_OP_S`` at ``claimed_perf``."""
    flops = max(1, claimed_perf) * 1e9 * TARGET_OP_S
    side = round((flops / 2) ** (1 / 3) / 64) * 64
    return min(8192, max(128, side))


def measure(
    session, claimed_perf: int, *, budget_s: float = BUDGET_S, attempts: int = ATTEMPTS
) -> ProbeFacts:
    """Measure the session's device (the ``cumulus`` device, attached to ``session``).

    Runs batches of products, doubling each time, until ``budget_s`` has passed, or
    ``ENOUGH_S`` has and the device is already at its claim; one value is read back
    after each batch, so the time includes the device's work. While
    the device falls short of ``claimed_perf``, measures again, up to ``attempts`` times
    in all (``best_of``).
    """
    import torch

    n = probe_size(claimed_perf)
    a = torch.full((n, n), 1.0 / n, device="cumulus")
    b = torch.full((n, n), 1.0 / n, device="cumulus")
    info = session.info

    def once() -> ProbeFacts:
        start = time.perf_counter()
        torch.mm(a, b)[0, 0].item()  # warm-up: kernels chosen, memory allocated
        products, elapsed = 1, time.perf_counter() - start
        if elapsed < budget_s:  # else the warm-up alone shows the device far below the claim
            batch, products, start = 1, 0, time.perf_counter()
            while elapsed < budget_s:
                for _ in range(batch):
                    c = torch.mm(a, b)
                c[0, 0].item()
                products += batch
                elapsed = time.perf_counter() - start
                if elapsed >= ENOUGH_S and _perf(n, products, elapsed) >= claimed_perf:
                    break
                batch *= 2
        perf = _perf(n, products, elapsed)
        device, name = str(info.get("device", "")), str(info.get("device_name", ""))
        return ProbeFacts(device, name, int(info.get("quota", 0)), perf, elapsed)

    return best_of(once, claimed_perf=claimed_perf, attempts=attempts)


def _perf(side: int, products: int, seconds: float) -> int:
    """Performance units (float32 GFLOP/s) of ``products`` matrix products of ``side``."""
    return int(2 * side**3 * products / seconds / 1e9)


def best_of(
    measure_once: Callable[[], ProbeFacts],
    *,
    claimed_perf: int,
    attempts: int = ATTEMPTS,
    pause_s: float = RETRY_PAUSE_S,
) -> ProbeFacts:
    """The best of up to ``attempts`` calls of ``measure_once``, the first ``pause_s``
    apart and each pause twice the last: it stops at the first that is not short of
    ``claimed_perf`` (``MIN_PERF_RATIO``, as ``judge`` counts short), and after one so far
    short (``HOPELESS_RATIO``) that no busy machine explains it. The facts' ``seconds``
    add up every measurement."""
    best = measure_once()
    seconds = best.seconds
    for retry in range(attempts - 1):
        if best.perf_units >= MIN_PERF_RATIO * claimed_perf:
            break
        # Units are whole: a measured 0 is anything under 1, which says nothing of a
        # claim under 100. Only a measurement short even rounded up is hopeless.
        if best.perf_units + 1 <= HOPELESS_RATIO * claimed_perf:
            break
        time.sleep(pause_s * 2**retry)
        facts = measure_once()
        seconds += facts.seconds
        best = max(best, facts, key=lambda f: f.perf_units)
    return dataclasses.replace(best, seconds=seconds)


def judge(
    offer: Offer,
    facts: ProbeFacts,
    *,
    on_demand: bool = True,
    min_ratio: float = MIN_PERF_RATIO,
) -> str | None:
    """Why ``facts`` show that ``offer`` misrepresents the device, or ``None`` if they fit.

    A lease below on-demand (``on_demand=False``: contending, interruptible) yields the
    device to on-demand tenants by design, so its measured speed is its share, not the
    device's: only the device's model is judged then.
    """
    if facts.device_name.strip().lower() != offer.gpu_model.strip().lower():
        return f"offered {offer.gpu_model!r}, the session runs on {facts.device_name!r}"
    if not on_demand:
        return None
    if facts.perf_units < min_ratio * offer.perf_units:
        return (
            f"offered {offer.perf_units} perf units, measured {facts.perf_units} "
            f"(below {min_ratio:.0%} of the claim)"
        )
    return None
