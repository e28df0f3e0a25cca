"""Graph programs compiled for the executor's device with inductor, where asked for.

Theory of operation
-------------------
A ``GraphProgram`` (``graphs.py``) runs its validated nodes one by one, about 1 µs over
the ops themselves per node. With ``cumulus-executor --graph-compiler inductor`` a
``GraphRunner`` compiles each program for the executor's device instead: the program
becomes an FX graph of the same aten calls (``GraphProgram.graph_module``) and
``torch.compile`` turns it into fused kernels (Triton on CUDA, C++ on a CPU). The code is
generated here, from aten the executor has validated, so a compiled program may serve
every session that sends the same graph.

- **When.** A program's first run with a given input layout goes node by node: it
  measures the most memory the program holds at once. The second run compiles, then runs
  the compiled code; so do later runs, while the session's free quota covers that peak
  (inductor's own buffers are not counted one by one, so the node-by-node peak stands for
  them). A program larger than ``MAX_COMPILED_NODES`` or one that writes in place (an
  optimizer step: its functionalized copy would hold a second set of parameters) always
  runs node by node.
- **Random ops** keep torch's own random streams (inductor's ``fallback_random``), so a
  replay on another host draws what the first host drew.
- **Failures.** A compile or a compiled run that raises, or whose outputs are laid out
  otherwise than the node-by-node run's (the session builds views and shared handles
  from that layout), makes the program run node by node from then on, starting with that
  same call: the node-by-node run names the op that fails, or succeeds. A compiled
  program writes no input, so running it again is safe.

Results agree with the node-by-node run to rounding (inductor reorders float sums), not
bit for bit.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

import torch

from .graphs import GraphProgram
from .options import GraphCompiler

log = logging.getLogger(__name__)

#: The largest program handed to inductor: compile time grows with the graph.
MAX_COMPILED_NODES = 10_000
#: Compiled programs kept, per program and input layout; the oldest goes first.
MAX_COMPILED = 256


class GraphRunner:
    """Runs graph programs with the chosen ``GraphCompiler``; one per executor."""

    def __init__(self, compiler: GraphCompiler = GraphCompiler.LOOP) -> None:
        self.compiler = compiler
        # (program key, input layouts) -> the compiled code (None: node by node from now
        # on), the node-by-node run's peak bytes and its outputs' shape (``_shape``)
        self._compiled: OrderedDict[tuple, tuple[Callable | None, int, tuple]] = OrderedDict()
        if compiler is GraphCompiler.INDUCTOR:
            import torch._inductor.config as inductor_config

            inductor_config.fallback_random = True

    def run(
        self, key: bytes, program: GraphProgram, inputs: list[torch.Tensor], budget: int
    ) -> tuple[list[torch.Tensor | None], bool]:
        """Run ``program`` (content hash ``key``) on ``inputs`` as ``GraphProgram.run``
        does; return its outputs and whether compiled code ran.

        Raises:
            GraphError, NodeFailed: as ``GraphProgram.run``.
        """
        if not self.compiles(program):
            return program.run(inputs, budget), False
        layout = (key, *(_layout(t) for t in inputs))
        entry = self._compiled.get(layout)
        if entry is None:
            peak: list[int] = []
            outputs = program.run(inputs, budget, peak)
            compiled = torch.compile(
                program.graph_module(), backend="inductor", dynamic=False, fullgraph=True
            )  # compiled on its first call
            self._compiled[layout] = (compiled, peak[0], _shape(outputs, inputs))
            if len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)
            return outputs, False
        compiled, peak_bytes, shape = entry
        if compiled is None or peak_bytes > budget:
            return program.run(inputs, budget), False
        try:
            outputs = list(compiled(*inputs))
            if _shape(outputs, inputs) != shape:
                raise RuntimeError("compiled outputs are laid out otherwise than captured")
        except Exception:  # the node-by-node run says which op failed, or succeeds
            log.warning("a compiled graph failed; it runs node by node now", exc_info=True)
            self._compiled[layout] = (None, peak_bytes, shape)
            return program.run(inputs, budget), False
        program.write_back(inputs, outputs)
        return outputs, True

    def compiles(self, program: GraphProgram) -> bool:
        """Whether ``run`` hands ``program`` to the compiler (after its first run)."""
        return (
            self.compiler is GraphCompiler.INDUCTOR
            and not program.in_place
            and len(program.nodes) <= MAX_COMPILED_NODES
        )


def _layout(t: torch.Tensor) -> tuple:
    return (t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), t.requires_grad)


def _shape(outputs: list, inputs: list[torch.Tensor]) -> tuple:
    """What the session relies on in a graph's outputs: each one's layout, and which
    earlier output or which input it shares its storage with (the client builds views
    of inputs, and shared handles, from the captured graph)."""
    first: dict[int, tuple[str, int]] = {}
    for i, t in enumerate(inputs):
        first.setdefault(t.untyped_storage()._cdata, ("input", i))
    described = []
    for i, t in enumerate(outputs):
        if not isinstance(t, torch.Tensor):
            described.append(None)
            continue
        owner = first.setdefault(t.untyped_storage()._cdata, ("output", i))
        described.append((_layout(t), owner))
    return tuple(described)
