"""Is the device fit to rent? A small kernel run in a fresh process says.

After a worker fails, the supervisor cannot tell from the failure alone whether the
tenant broke its own context (a device-side assert: the device is fine) or the device
itself is sick (an Xid error, a fallen-off-the-bus GPU). A fresh process has a fresh
context: if it computes a small matmul correctly, the device is healthy.

``python -m cumulus_p2p.host.health --device cuda:0`` exits 0 when the device works and
prints why not otherwise.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

#: How long the check may take (importing torch and creating a CUDA context included).
CHECK_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class DeviceHealth:
    """The device's state as the provider advertises it: fit to rent, or why not."""

    healthy: bool = True
    reason: str = ""


def check_device(device: str) -> str | None:
    """Run a small kernel on ``device``; None when it computed the right answer."""
    import torch

    try:
        a = torch.arange(64.0).reshape(8, 8)
        expected = a @ a
        got = (a.to(device) @ a.to(device)).cpu()
    except Exception as exc:  # any failure at all is the answer
        return f"{type(exc).__name__}: {exc}"
    if not torch.allclose(got, expected):
        return "a matmul on the device returned a wrong result"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cumulus-health", description=__doc__.splitlines()[0])
    parser.add_argument("--device", required=True, help="cpu, cuda or cuda:N")
    args = parser.parse_args(argv)
    problem = check_device(args.device)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
