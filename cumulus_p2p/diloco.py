"""DiLoCo: data-parallel training that communicates once every ``sync_every`` steps.

Theory of operation
-------------------
Each replica trains on its own shard with its own *inner* optimizer (AdamW in the paper:
Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
2023), and talks to no one for ``sync_every`` steps (H, 100 to 500 there). Then every
replica computes its *pseudo-gradient*, the distance it travelled from the last
synchronized parameters (the anchor), the replicas average it with one all-reduce, and an
*outer* optimizer (SGD with Nesterov momentum) moves the anchor by it. Every replica
continues from the new anchor. At H = 100 that is a hundredth of data parallelism's
traffic, which is what makes training across the open internet possible (INTELLECT-1
trained 10B parameters across three continents this way).

Why here, and not torchft's: torchft's DiLoCo is built for fault tolerance, around a
coordinator (its Lighthouse) and process groups it reconfigures at every quorum. The
``cumulus`` group cannot be reconfigured yet (a lost host ends it), which is the part
torchft would add; the algorithm itself is the few lines below, on any
``torch.distributed`` group. On ``cumulus`` tensors the anchor, the outer optimizer's
momentum and the all-reduce all stay on the hosts: the consumer's link carries records.

Typical use, in each rank of a torchrun job::

    inner = torch.optim.AdamW(model.parameters(), lr=4e-4)
    diloco = DiLoCo(model, inner, sync_every=100)
    for x, y in shard:
        loss_fn(model(x), y).backward()
        diloco.step()        # the inner step; every 100th also synchronizes
        inner.zero_grad()
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class DiLoCo:
    """The outer loop of DiLoCo around ``inner``, over ``group`` (default: the world).

    Args:
        model: The replica's model. Its parameters start as rank 0's.
        inner: The optimizer of ``model``'s parameters, stepped every step.
        sync_every: Inner steps between synchronizations (H).
        outer_lr, outer_momentum: The outer SGD's (Nesterov); the paper's defaults.
        group: The process group the replicas average over.
    """

    def __init__(
        self,
        model: nn.Module,
        inner: torch.optim.Optimizer,
        *,
        sync_every: int,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if sync_every < 1:
            raise ValueError(f"sync_every is a number of steps, at least 1, not {sync_every}")
        self.inner = inner
        self.sync_every = sync_every
        self.group = group
        self.steps = 0
        #: Synchronizations so far.
        self.syncs = 0
        self._params = [p for p in model.parameters() if p.requires_grad]
        with torch.no_grad():
            for param in self._params:
                dist.broadcast(param, 0, group=group)
        self._anchor = [p.detach().clone() for p in self._params]
        self.outer = torch.optim.SGD(
            self._anchor, lr=outer_lr, momentum=outer_momentum, nesterov=True
        )

    def step(self) -> None:
        """One inner step; every ``sync_every``-th step also synchronizes."""
        self.inner.step()
        self.steps += 1
        if self.steps % self.sync_every == 0:
            self.sync()

    @torch.no_grad()
    def sync(self) -> None:
        """Average the replicas' pseudo-gradients, step the anchor, restart from it."""
        world = dist.get_world_size(self.group)
        for param, anchor in zip(self._params, self._anchor, strict=True):
            travelled = anchor - param
            # gloo has no AVG: a sum, then the division.
            dist.all_reduce(travelled, op=dist.ReduceOp.SUM, group=self.group)
            anchor.grad = travelled.div_(world)
        self.outer.step()
        for param, anchor in zip(self._params, self._anchor, strict=True):
            param.copy_(anchor)
        self.syncs += 1
