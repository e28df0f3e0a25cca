"""A sharded (FSDP2) training script as people write them for a CUDA cluster, run by torchrun.

Nothing here knows about cumulus. The tests run it untouched: on the CPU with gloo
(``torchrun --standalone --nproc-per-node 2 fsdp_train.py out.pt``), and through the shim
with one executor per rank (``ddp_train.py`` says how). Each layer and the root are
sharded with ``fully_shard``, so a step all-gathers each layer's parameters before its
forward and backward and reduce-scatters its gradients after. Rank 0 saves the full
parameters, gathered from the shards, to ``out.pt``; every rank prints one JSON line with
its losses.

Usage: ``fsdp_train.py out.pt [steps] [hidden]``.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

out = sys.argv[1]
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
hidden = int(sys.argv[3]) if len(sys.argv) > 3 else 256

use_cuda = torch.cuda.is_available()
local_rank = int(os.environ["LOCAL_RANK"])
dist.init_process_group("nccl" if use_cuda else "gloo")
rank = dist.get_rank()
if use_cuda:
    torch.cuda.set_device(local_rank)
device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")

torch.manual_seed(0)
# Odd sizes, so a parameter's rows do not divide evenly between the ranks: FSDP2 pads.
model = nn.Sequential(
    nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 33), nn.ReLU(), nn.Linear(33, 64)
).to(device)
for layer in model:
    if isinstance(layer, nn.Linear):
        fully_shard(layer)
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

data = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard of the data
losses = []
for _ in range(steps):
    x = torch.randn(16, 64, generator=data).to(device)
    y = torch.randn(16, 64, generator=data).to(device)
    loss = nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())

# Every rank takes part in gathering the shards; rank 0 alone keeps them, on its CPU.
options = StateDictOptions(full_state_dict=True, cpu_offload=True)
full = get_model_state_dict(model, options=options)
if rank == 0:
    torch.save(full, out)
sys.stdout.write(json.dumps({"rank": rank, "losses": losses}) + "\n")
sys.stdout.flush()
dist.destroy_process_group()
