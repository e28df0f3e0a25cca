"""A model split across two devices, as a two-stage pipeline, trained with SGD.

Prints one JSON line: the devices it ran on and each step's loss. Under the shim with
two executors it runs on ``cumulus:0`` and ``cumulus:1``, its activations moving from
one host to the other; run plainly, on the CPU alone: the reference.

    python pipeline_train.py [steps]
"""

import json
import sys

import torch

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 10
cumulus = getattr(torch, "cumulus", None)
split = cumulus is not None and cumulus.is_available() and cumulus.device_count() >= 2
first_device, second_device = ("cumulus:0", "cumulus:1") if split else ("cpu", "cpu")

torch.manual_seed(0)
first = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU()).to(first_device)
second = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.GELU(), torch.nn.Linear(128, 4))
second.to(second_device)
optimizer = torch.optim.AdamW([*first.parameters(), *second.parameters()], lr=1e-3)
data = torch.Generator().manual_seed(1)

losses = []
for _ in range(steps):
    x = torch.randn(256, 32, generator=data)
    y = torch.randint(0, 4, (256,), generator=data)
    hidden = first(x.to(first_device)).to(second_device)
    loss = torch.nn.functional.cross_entropy(second(hidden), y.to(second_device))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())

print(json.dumps({"devices": [first_device, second_device], "losses": losses}), flush=True)
