"""A DiLoCo training script for torchrun, written for a CUDA cluster.

It runs unchanged on the CPU with gloo, and through the shim with one executor per rank
(``ddp_train.py`` says how). Each rank trains its own shard with AdamW and synchronizes
every ``sync_every`` steps (``cumulus_p2p.diloco``). Rank 0 saves the final parameters to
``out.pt``; every rank prints one JSON line: its losses, each step's seconds (a step
that synchronizes included) and the synchronizations.

Usage: ``diloco_train.py out.pt [steps] [sync_every] [hidden] [adamw|sgd]`` (the inner
optimizer: the paper's AdamW, or SGD, which passes last-bit differences between two
machines' kernels through without magnifying them).
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from cumulus_p2p.diloco import DiLoCo

out = sys.argv[1]
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 6
sync_every = int(sys.argv[3]) if len(sys.argv) > 3 else 3
hidden = int(sys.argv[4]) if len(sys.argv) > 4 else 1024
inner_name = sys.argv[5] if len(sys.argv) > 5 else "adamw"

use_cuda = torch.cuda.is_available()
local_rank = int(os.environ["LOCAL_RANK"])
dist.init_process_group("nccl" if use_cuda else "gloo")
rank = dist.get_rank()
device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")

torch.manual_seed(rank)  # replicas start apart: DiLoCo starts them all from rank 0's
model = nn.Sequential(nn.Linear(256, hidden), nn.ReLU(), nn.Linear(hidden, 256)).to(device)
if inner_name == "adamw":
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
else:
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
diloco = DiLoCo(model, inner, sync_every=sync_every)

data = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard
losses, seconds = [], []
for _ in range(steps):
    started = time.perf_counter()
    x = torch.randn(32, 256, generator=data).to(device)
    y = torch.randn(32, 256, generator=data).to(device)
    loss = nn.functional.mse_loss(model(x), y)
    inner.zero_grad()
    loss.backward()
    diloco.step()  # the inner step; every sync_every-th also synchronizes
    losses.append(loss.item())  # a sync point
    model[0].bias.sum().item()  # and the synchronization, if any, has run
    seconds.append(time.perf_counter() - started)

if rank == 0:
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, out)
report = {"rank": rank, "losses": losses, "step_s": seconds, "syncs": diloco.syncs}
# One write of the whole line: the ranks share one pipe, and an unbuffered print's two
# writes (text, then newline) could interleave with another rank's.
sys.stdout.write(json.dumps(report) + "\n")
sys.stdout.flush()
dist.destroy_process_group()
