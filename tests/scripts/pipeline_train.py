"""A model split across two GPUs, as a two-stage pipeline, trained with AdamW: written for
CUDA, as such a script is.

Prints one JSON line: where its two stages' weights are, and each step's loss. Under the
shim with two executors, ``cuda:0`` and ``cuda:1`` are ``cumulus:0`` and ``cumulus:1``,
and its activations move from one host to the other; run plainly on a machine with
fewer than two GPUs, it runs on the CPU alone: the reference.

    python pipeline_train.py [steps]
"""

import json
import sys

import torch

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 10
split = torch.cuda.is_available() and torch.cuda.device_count() >= 2
first_device, second_device = ("cuda:0", "cuda:1") if split else ("cpu", "cpu")

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

placed = [str(first[0].weight.device), str(second[0].weight.device)]
print(json.dumps({"placed": placed, "losses": losses}), flush=True)
