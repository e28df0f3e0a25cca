"""nanoGPT's training loop in miniature, written for CUDA the way its train.py is.

Nothing here knows about cumulus: a GPT with tied embeddings and causal
``scaled_dot_product_attention``, fused AdamW, a learning rate set every step (warm-up,
then cosine decay), gradient clipping, ``torch.compile(model)`` and, for a lower-precision
dtype on CUDA, an autocast context, as train.py sets them up. With ``compile-step`` the
optimizer step is compiled too (PyTorch's compiled-optimizer recipe); with ``eager`` the
model is not compiled (nanoGPT's ``compile = False``).
Usage: ``python nanogpt_train.py [steps] [float32|bfloat16] [compile-step|eager]``; prints
one JSON line: the device, every step's loss, and the median step time after two warm-ups.
"""

import json
import math
import statistics
import sys
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 4
dtype = sys.argv[2] if len(sys.argv) > 2 else "float32"
device = "cuda" if torch.cuda.is_available() else "cpu"
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
compile_step = "compile-step" in sys.argv[3:]
eager = "eager" in sys.argv[3:]
ctx = (
    nullcontext()
    if device == "cpu" or dtype == "float32"
    else torch.amp.autocast(device_type=device, dtype=ptdtype)
)
vocab, block, dim, heads, layers = 65, 32, 48, 4, 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.c_attn, self.c_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = self.c_attn(self.ln_1(x)).split(dim, dim=2)
        q, k, v = (z.view(b, t, heads, c // heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(block, dim)
        self.h = nn.ModuleList(Block() for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT does

    def forward(self, idx, targets=None):
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for b in self.h:
            x = b(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


torch.manual_seed(1337)
model = GPT().to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
model = model if eager else torch.compile(model)
optimizer_step = torch.compile(optimizer.step) if compile_step else optimizer.step


def get_lr(it, warmup=2, max_lr=1e-3, min_lr=1e-4, decay=20):
    if it < warmup:
        return max_lr * (it + 1) / warmup
    ratio = (it - warmup) / (decay - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (max_lr - min_lr)


data = torch.randint(0, vocab, (2000,), generator=torch.Generator().manual_seed(0))
losses, times = [], []
for step in range(steps):
    started = time.perf_counter()
    for param_group in optimizer.param_groups:
        param_group["lr"] = get_lr(step)
    ix = torch.randint(len(data) - block, (8,), generator=torch.Generator().manual_seed(step))
    x = torch.stack([data[i : i + block] for i in ix]).to(device)
    y = torch.stack([data[i + 1 : i + 1 + block] for i in ix]).to(device)
    with ctx:
        logits, loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer_step()
    optimizer.zero_grad(set_to_none=True)
    losses.append(loss.item())  # a sync point every step, as nanoGPT's logging is
    times.append(time.perf_counter() - started)
step_ms = statistics.median(times[2:] or times) * 1e3
device_used = str(next(model.parameters()).device)
print(json.dumps({"device": device_used, "losses": losses, "step_ms": round(step_ms, 3)}))
