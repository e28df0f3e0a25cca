"""The sizes each rank of a group shows the others before a collective, and whether they
fit together.

gloo does not check: a rank sending more bytes than another expects aborts the receiving
process. So before each collective every rank all-gathers one ``row`` (what it sends and
what it receives into: elements and dtype), and every rank judges the same table alike
(``disagreement``): all of them fail together, and the group stays in step. The
executors' groups (``host/collectives.py``) and the ranks' own group, when the
collectives go through the consumer (``remote/distributed.py``), check alike.
"""

from __future__ import annotations

from fractions import Fraction

import torch

from .protocol import DTYPE_CODE


def row(sent: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
    """This rank's row: ``sent``'s elements and dtype, then ``received``'s."""
    return torch.tensor(
        [sent.numel(), _code(sent), received.numel(), _code(received)], dtype=torch.int64
    )


def disagreement(rows: list[list[int]], out_per_in: Fraction, *, into: bool) -> str | None:
    """Why the ranks' ``rows`` cannot make one collective, or None if they can.

    Every rank must send alike; what a rank receives into must hold ``out_per_in`` times
    what it sends, of the same dtype. ``into``: the collective writes elsewhere than its
    input (name the outputs' sizes too).
    """
    if any(r != rows[0] for r in rows):
        shown = " into {}" if into else ""
        seen = ", ".join(
            f"rank {i}: {r[0]} elements{shown.format(r[2])}" for i, r in enumerate(rows)
        )
        return f"the ranks brought different tensors to one collective ({seen})"
    sent, sent_dtype, got, got_dtype = rows[0]
    needed = sent * out_per_in
    if needed.denominator != 1:
        return f"{sent} elements do not split into {len(rows)} equal parts"
    if got != needed or got_dtype != sent_dtype:
        return f"it writes {needed} elements of the input's dtype, not {got}"
    return None


def _code(tensor: torch.Tensor) -> int:
    return DTYPE_CODE.get(tensor.dtype, -1)
