"""A training script written for CUDA, as users write them: ``device = "cuda"`` when
``torch.cuda.is_available()``, ``.cuda()``, ``torch.cuda.synchronize()`` and the memory
counters. Run plainly here (no GPU) it trains on the CPU; under the shim's CUDA
compatibility mode the same lines run on ``cumulus``. Prints one JSON line.
"""

import json

import torch
import torch.nn.functional as F

from cumulus_p2p.testing.models import TinyTransformer

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.set_num_threads(1)
torch.manual_seed(0)
model = TinyTransformer(vocab=16, dim=16, heads=2, layers=2, ctx=4, dropout=0.0).to(device)
x = torch.randint(0, 16, (2, 4))
y = torch.roll(x, -1, dims=1)
if device == "cuda":
    x, y = x.cuda(), y.cuda()
opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
losses = []
for _ in range(4):
    opt.zero_grad()
    loss = F.cross_entropy(model(x).reshape(-1, 16), y.reshape(-1))
    loss.backward()
    opt.step()
    losses.append(loss.item())
report = {"device": str(x.device), "losses": losses}
if device == "cuda":
    torch.cuda.synchronize()
    report |= {
        "name": torch.cuda.get_device_name(),
        "allocated": torch.cuda.memory_allocated(),
        "peak": torch.cuda.max_memory_allocated(),
        "params": sum(p.nbytes for p in model.parameters()),
    }
print(json.dumps(report), flush=True)
