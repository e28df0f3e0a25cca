"""Small models and a deterministic training loop, the same on any device.

Parity tests and benchmarks train these locally and on ``cumulus`` and compare.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, width: int = 64, depth: int = 3, classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(32, width), nn.ReLU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.GELU()]
        layers.append(nn.Linear(width, classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


class SmallCNN(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 4 * 4, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.conv1(x))), 2)
        x = F.avg_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyTransformer(nn.Module):
    """A GPT-style decoder with the output layer tied to the embedding."""

    def __init__(
        self,
        vocab: int = 64,
        dim: int = 32,
        heads: int = 4,
        layers: int = 2,
        ctx: int = 16,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(ctx, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


@dataclass
class Task:
    """A model and a synthetic batch generator: what one training step needs."""

    make_model: Callable[[], nn.Module]
    make_batch: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _classify(shape):
    def batch(gen):
        return torch.randn(*shape, generator=gen), torch.randint(0, 10, (shape[0],), generator=gen)

    return batch


def _tokens(gen):
    idx = torch.randint(0, 64, (8, 16), generator=gen)
    target = torch.roll(idx, -1, dims=1)
    target[:, -1] = -100  # exercises cross_entropy's ignore_index
    return idx, target


def _lm_loss(logits, target):
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100
    )


TASKS: dict[str, Task] = {
    "mlp": Task(MLP, _classify((64, 32)), F.cross_entropy),
    "cnn": Task(SmallCNN, _classify((16, 3, 16, 16)), F.cross_entropy),
    "transformer": Task(TinyTransformer, _tokens, _lm_loss),
}


def _lm_batches(vocab: int, batch: int, ctx: int):
    def make(gen):
        idx = torch.randint(0, vocab, (batch, ctx), generator=gen)
        return idx, torch.roll(idx, -1, dims=1)

    return make


#: Workloads the benchmarks time, from the test models up to a compute-bound GPT.
#: ``gpt`` is nanoGPT's character-level Shakespeare shape (6 layers, 6 heads, dim 384,
#: ctx 256) at batch 8; ``gpt_large`` is GPT-2 small's shape (12 layers, dim 768, GPT-2's
#: vocabulary) at ctx 512, batch 16: too slow for a CPU, there to be compute-bound on a GPU.
WORKLOADS: dict[str, Task] = {
    "mlp_tiny": TASKS["mlp"],
    "transformer_tiny": TASKS["transformer"],
    "mlp_bench": Task(lambda: MLP(width=1024, depth=4), _classify((256, 32)), F.cross_entropy),
    "transformer_bench": Task(
        lambda: TinyTransformer(vocab=512, dim=256, heads=8, layers=4, ctx=128),
        _lm_batches(512, 16, 128),
        _lm_loss,
    ),
    "gpt": Task(
        lambda: TinyTransformer(vocab=65, dim=384, heads=6, layers=6, ctx=256),
        _lm_batches(65, 8, 256),
        _lm_loss,
    ),
    "gpt_large": Task(
        lambda: TinyTransformer(vocab=50304, dim=768, heads=12, layers=12, ctx=512),
        _lm_batches(50304, 16, 512),
        _lm_loss,
    ),
}


def train(
    task: str,
    device: str,
    *,
    steps: int = 5,
    foreach: bool | None = None,
    clip: float = 1.0,
    on_step: Callable[[int], None] = lambda i: None,
    autocast: torch.dtype | None = None,
    compiled: bool = False,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train ``task`` on ``device`` deterministically; return losses and final CPU params.

    Seeds are set after the model moves, so dropout draws the same stream on every device
    whose generator matches the CPU's (a CPU executor does). ``on_step(i)`` runs after
    step ``i``. With ``autocast``, the forward pass and the loss run in
    ``torch.autocast(<device type>, dtype=autocast)``; with ``compiled``, the forward pass
    runs through ``torch.compile(model)``.
    """
    mixed = torch.autocast(
        torch.device(device).type, dtype=autocast or torch.bfloat16, enabled=autocast is not None
    )
    spec = TASKS[task]
    torch.manual_seed(0)
    model = spec.make_model().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=foreach)
    forward = torch.compile(model) if compiled else model
    gen = torch.Generator().manual_seed(2)
    torch.manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = spec.make_batch(gen)
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        with mixed:
            loss = spec.loss(forward(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=foreach)
        opt.step()
        losses.append(loss.item())
        on_step(len(losses) - 1)
    params = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return losses, params


def tiny_transformer_job(
    device: str,
) -> tuple[TinyTransformer, torch.Tensor, torch.Tensor, torch.optim.Adam]:
    """The seeded tiny transformer that ``train_tiny_transformer`` and
    ``tests/scripts/native_train.py`` train, its one batch of tokens ``x`` with their next
    tokens ``y``, and its Adam: made on the CPU, then moved to ``device``."""
    torch.manual_seed(0)
    model = TinyTransformer(vocab=16, dim=8, heads=2, layers=2, ctx=4, dropout=0.0)
    x = torch.randint(0, 16, (2, 4))
    y = torch.roll(x, -1, dims=1)
    model, x, y = model.to(device), x.to(device), y.to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    return model, x, y, opt


def train_tiny_transformer(
    device: str, steps: int, *, kill_after: int = -1, kill=None, compiled: bool = False
) -> tuple[list[float], list[torch.Tensor]]:
    """A few seeded Adam steps of a tiny transformer on ``device``, weights and data made
    on the CPU: the losses and the weights after. Before step ``kill_after``, ``kill()``
    (a host, to move the session). With ``compiled``, the forward pass runs through
    ``torch.compile(model)``."""
    model, x, y, opt = tiny_transformer_job(device)
    forward = torch.compile(model) if compiled else model
    losses = []
    for step in range(steps):
        if step == kill_after:
            kill()
        opt.zero_grad()
        loss = F.cross_entropy(forward(x).reshape(-1, 16), y.reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().cpu() for p in model.parameters()]


def assert_trains_as_on_the_cpu(losses: list[float], params: list[torch.Tensor]) -> None:
    """Assert that a ``train_tiny_transformer`` run elsewhere, its ``losses`` and the
    weights after (``params``), is a CPU run of as many steps, bit for bit."""
    local_losses, local_params = train_tiny_transformer("cpu", steps=len(losses))
    assert losses == local_losses
    for remote, here in zip(params, local_params, strict=True):
        assert torch.equal(remote, here)
