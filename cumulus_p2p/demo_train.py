"""The demo's training script: ordinary CUDA-style PyTorch, nothing about cumulus in it.

A small causal transformer learns a synthetic next-token task. Run directly it trains on
the CPU (no CUDA here); under ``cumulus-node --consume`` its ``.cuda()`` calls land on a
rented remote device. Prints a progress line every ``--log-every`` steps and a final JSON
line with the last loss and a checksum of the parameters, so runs can be compared.

    python -m cumulus_p2p.demo_train [--steps 60] [--log-every 5]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, CONTEXT, DIM = 64, 32, 64


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.position = nn.Parameter(torch.zeros(CONTEXT, DIM))
        layer = nn.TransformerEncoderLayer(DIM, 4, 4 * DIM, dropout=0.1, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied, as in GPT-2

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        return self.head(self.blocks(x, mask=mask, is_causal=True))


def batches(steps: int, batch: int = 16) -> list[torch.Tensor]:
    """Sequences that count up modulo VOCAB from random starts: learnable, deterministic."""
    g = torch.Generator().manual_seed(1234)
    starts = torch.randint(0, VOCAB, (steps, batch, 1), generator=g)
    return [(s + torch.arange(CONTEXT + 1)) % VOCAB for s in starts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--log-every", type=int, default=5)
    args = parser.parse_args()
    train(args.steps, args.log_every)


def train(steps: int, log_every: int, after_step: Callable[[int], None] | None = None) -> None:
    """Train for ``steps`` steps, printing progress and the final JSON line;
    ``after_step(step)`` runs after each step's log line (tests use it to hold a run)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = TinyGPT().to(device)
    # Reseeded after the model is built: dropout then draws the same stream whether the
    # device's generator is the CPU's or a GPU's own, so runs compare across devices.
    torch.manual_seed(1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    started = time.perf_counter()
    for step, data in enumerate(batches(steps), start=1):
        data = data.to(device)
        logits = model(data[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), data[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % log_every == 0 or step == steps:
            print(
                f"step {step:4d}  loss {loss.item():.4f}  "
                f"{time.perf_counter() - started:.1f}s on {device}",
                flush=True,
            )
        if after_step is not None:
            after_step(step)
    checksum = sum(float(p.detach().double().sum().cpu()) for p in model.parameters())
    print(
        json.dumps({"final_loss": loss.item(), "checksum": checksum, "device": device}), flush=True
    )


if __name__ == "__main__":
    main()
