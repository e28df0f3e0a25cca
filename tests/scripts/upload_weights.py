"""Upload the same "pretrained weights" every run: 48 MiB, three 16 MiB pieces, made from
a fixed seed; read them back and print one JSON line with their sum and what the host
fetched from other hosts instead of this machine (``fetched_elsewhere_bytes``). On the
Python device or the native one (``--native``), whichever the shim loaded."""

import json
import sys

import torch

weights = torch.randn(3 * 4 * 1024 * 1024, generator=torch.Generator().manual_seed(7))
on_device = weights.to("cuda")
if "cumulus_p2p.remote" in sys.modules:
    session = sys.modules["cumulus_p2p.remote"].current_session()
else:
    session = sys.modules["cumulus_p2p.native.session"].current()
print(
    json.dumps(
        {
            "sum": on_device.sum().item(),
            "expected": weights.sum().item(),
            "fetched": session.fetched_elsewhere_bytes,
        }
    ),
    flush=True,
)
