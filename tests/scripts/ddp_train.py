"""A data-parallel training script as people write them for a CUDA cluster, run by torchrun.

Nothing here knows about cumulus. The tests run it untouched: on the CPU with gloo
(``torchrun --standalone --nproc-per-node 2 ddp_train.py out.pt``), and through the shim
with one executor per rank, where CUDA compatibility mode makes ``cuda:LOCAL_RANK`` the
rank's session and NCCL the cumulus backend. Rank 0 saves the final parameters to
``out.pt``; every rank prints one JSON line with its losses, its median and slowest step
times and the time all its steps took.

Usage: ``ddp_train.py out.pt [steps] [hidden]``.
"""

import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

out = sys.argv[1]
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 4
hidden = int(sys.argv[3]) if len(sys.argv) > 3 else 4096

use_cuda = torch.cuda.is_available()
local_rank = int(os.environ["LOCAL_RANK"])
dist.init_process_group("nccl" if use_cuda else "gloo")
rank = dist.get_rank()
if use_cuda:
    torch.cuda.set_device(local_rank)
device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, hidden), nn.ReLU(), nn.Linear(hidden, 256)).to(device)
ddp = DistributedDataParallel(model, device_ids=[local_rank] if use_cuda else None)
optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)

data = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard
losses, seconds = [], []
for _ in range(steps):
    started = time.perf_counter()
    x = torch.randn(32, 256, generator=data).to(device)
    y = torch.randn(32, 256, generator=data).to(device)
    loss = nn.functional.mse_loss(ddp(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())  # a sync point: the step has run
    seconds.append(time.perf_counter() - started)

if rank == 0:
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, out)
step_s = statistics.median(seconds[1:] or seconds)  # the first step sets up
# One write of the whole line: the ranks share one pipe, and an unbuffered print's two
# writes (text, then newline) could interleave with another rank's.
line = {"rank": rank, "losses": losses, "step_s": step_s, "train_s": sum(seconds)}
line["slowest_step_s"] = max(seconds[1:] or seconds)
sys.stdout.write(json.dumps(line) + "\n")
sys.stdout.flush()
dist.destroy_process_group()
