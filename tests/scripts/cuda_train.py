"""A training script written for CUDA the way people write them, falling back to the CPU.

Nothing here knows about cumulus. The tests run it untouched: on the CPU with CUDA
compatibility mode off, and with the mode on against a CPU executor, and expect the same
losses to the bit. Usage: ``python cuda_train.py [epochs] [pause]``, ``pause`` seconds of
sleep after each step (to make a run outlast a short lease); prints one JSON line.
"""

import json
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

use_cuda = torch.cuda.is_available()
device = "cuda" if use_cuda else "cpu"
epochs = int(sys.argv[1]) if len(sys.argv) > 1 else 2
pause = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc1 = nn.Linear(8 * 4 * 4, 32)
        self.drop = nn.Dropout(0.2)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2)
        return self.fc2(self.drop(F.gelu(self.fc1(x.flatten(1)))))


torch.manual_seed(0)
model = Net()
if use_cuda:
    model.cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
if use_cuda:
    model = torch.compile(model)  # as nanoGPT's train.py does by default on CUDA
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

data_gen = torch.Generator().manual_seed(1)
images = torch.randn(64, 3, 8, 8, generator=data_gen)
labels = torch.randint(0, 10, (64,), generator=data_gen)
loader = DataLoader(
    TensorDataset(images, labels),
    batch_size=16,
    shuffle=True,
    generator=data_gen,
    pin_memory=use_cuda,
)

# Reseeded after the model is built, so dropout and the noise below draw one stream.
torch.manual_seed(2)
if use_cuda:
    torch.cuda.manual_seed_all(2)
noise_scale = torch.full((1,), 0.01, device=device)

losses = []
model.train()
for _epoch in range(epochs):
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        x = x + noise_scale * torch.randn(x.shape, device=device)
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        time.sleep(pause)
    scheduler.step()

peak_memory = 0
if use_cuda:
    torch.cuda.synchronize()
    peak_memory = torch.cuda.max_memory_allocated()

model.eval()
with torch.no_grad():
    eval_loss = F.cross_entropy(model(images.to(device)), labels.to(device)).item()
param_device = str(next(model.parameters()).device)
print(
    json.dumps(
        {"device": param_device, "losses": losses, "eval_loss": eval_loss, "peak": peak_memory}
    )
)
