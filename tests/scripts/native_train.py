"""A few Adam steps of a tiny transformer, written for the native ``cumulus`` device.

``python native_train.py DEVICE [steps] [gate]``: trains on DEVICE (``cumulus`` under
``python -m cumulus_p2p.shim --native``, or ``cpu``) and prints one JSON line with the
losses. With ``gate``, after the second step it takes a checkpoint (when its session
can move: one the standby holds, if it has one), prints ``holding`` and waits until that
file exists, then trains on (a test kills the host meanwhile).
Attention is pinned to the math path, as a user's script may pin it: the device honours
``sdpa_kernel``.
"""

import contextlib
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cumulus_p2p.testing.models import tiny_transformer_job

device = sys.argv[1]
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 4
gate = Path(sys.argv[3]) if len(sys.argv) > 3 else None
torch.set_num_threads(1)
model, x, y, opt = tiny_transformer_job(device)
losses = []
with sdpa_kernel(SDPBackend.MATH):
    for step in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(model(x).reshape(-1, 16), y.reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if gate is not None and step == 1:
            session = getattr(sys.modules.get("cumulus_p2p.native.session"), "current", None)
            with contextlib.suppress(ValueError):  # a session that cannot move takes none
                if session is not None and session() is not None:
                    session().checkpoint()
            print("holding", flush=True)
            while not gate.exists():
                time.sleep(0.05)
print(json.dumps({"device": str(x.device), "losses": losses}), flush=True)
