"""Compiled graphs on the executor: an aten graph sent once as data, then run by id.

Theory of operation
-------------------
A compiled step (``compiled.py``) sends each graph it captured once per session, as the
record ``@graph [graph_id, definition]``, and then calls it with one record per call,
``@run [graph_id, inputs]``, whose ``outs`` name the handles of its outputs. A definition
is plain data, never code::

    [n_inputs, nodes, outputs(, writes)]
    node    = [op_name, args, kwargs]
    outputs = [value or nil, ...]
    writes  = [[output, input], ...]   (copy an output into an input after the run)

Node arguments are the values a single op's arguments may be (numbers, strings, lists,
dtypes, devices...) plus ``GraphValue`` references to a graph input or to an *earlier*
node's result. A node can only look back, so a graph cannot be cyclic; a stored tensor
(a handle) cannot appear inside a graph at all, only among a call's inputs, where the
session checks it like any other reference.

``build_program`` validates a definition with the rules single ops follow (``resolve_op``:
aten only, the blocklist) plus what graphs need: a bounded size, references in range, and
writes only in place. An in-place op (a compiled optimizer step is made of them) may write
to a graph input or an earlier node's result, as it would eagerly; an ``out=`` argument,
which can be resized and so hold memory the quota never saw, is refused. The result, a
``GraphProgram``, runs the nodes in a tight loop: ops resolved and argument templates
built once, nothing decoded per call. Programs are pure functions of their definition, so
executors share them between sessions through a bounded cache keyed by content hash
(``ProgramCache``).

This module does no I/O and keeps no session state: ``session.py`` owns the handles.
"""

from __future__ import annotations

import dataclasses
import hashlib
import operator
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from ..wire.ops import UnknownOpError, resolve_op, written_arguments
from ..wire.protocol import DeviceToken, GraphValue, encode_value

#: Most nodes one graph may have: a 12-layer GPT's backward has a few thousand.
MAX_GRAPH_NODES = 50_000
#: Most graphs one session may define, and programs an executor keeps built.
MAX_SESSION_GRAPHS = 256
MAX_CACHED_PROGRAMS = 512
#: Factory ops whose constant sizes a program adds up, to check against the quota first.
_FACTORIES = {
    "aten::empty",
    "aten::empty_strided",
    "aten::zeros",
    "aten::ones",
    "aten::full",
    "aten::new_empty",
    "aten::new_zeros",
    "aten::new_ones",
    "aten::new_full",
    "aten::new_empty_strided",
}
_PLAIN = (
    bool,
    int,
    float,
    str,
    complex,
    type(None),
    torch.dtype,
    torch.layout,
    torch.memory_format,
)


class GraphError(Exception):
    """A definition or a call that breaks the rules; the message says which rule."""


class NodeFailed(Exception):
    """A node raised while running; carries its op name and position for the error."""

    def __init__(self, op: str, index: int, error: Exception) -> None:
        super().__init__(str(error))
        self.op = op
        self.index = index
        self.error = error


@dataclass(frozen=True, slots=True)
class _Node:
    op: torch._ops.OpOverload
    name: str
    args: tuple
    kwargs: dict
    #: Whether any argument is a reference (otherwise the templates are passed as is).
    fills: bool
    #: Whether its results are new memory (no result aliases an argument, by its schema).
    fresh: bool
    #: Earlier results no node reads after this one: dropped here, as generated code would.
    release: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class GraphProgram:
    """A validated graph, ready to run on the device it was built for."""

    n_inputs: int
    nodes: tuple[_Node, ...]
    outputs: tuple[GraphValue | None, ...]
    #: Bytes the graph's constant-size factory ops allocate (checked against the quota).
    factory_bytes: int
    #: ``(output, input)`` pairs: after a run, the output's value is copied into the input
    #: (the graph mutates that input, as BatchNorm does its running statistics).
    writes: tuple[tuple[int, int], ...] = ()
    #: Whether a node writes in place (an optimizer step): such a program is never
    #: handed to a compiler, whose functionalized copy would hold a second set of values.
    in_place: bool = False

    def run(
        self, inputs: list[torch.Tensor], budget: int, peak: list[int] | None = None
    ) -> list[torch.Tensor | None]:
        """Run every node in order; return the graph's outputs.

        Intermediate values are dropped after their last use, and those held at once may
        take at most ``budget`` bytes (the session's free quota): a graph can hold many
        values alive, where eager ops are counted one by one. With ``peak``, the most
        bytes held at once is appended to it.

        Raises:
            GraphError: the call passed the wrong number of inputs.
            NodeFailed: a node raised, or went over the budget (its op name and index
                say which).
        """
        if len(inputs) != self.n_inputs:
            raise GraphError(f"the graph takes {self.n_inputs} inputs, not {len(inputs)}")
        results: list[Any] = []
        held = [0] * len(self.nodes)
        live = most = 0
        for index, node in enumerate(self.nodes):
            try:
                if node.fills:
                    args = _fill(node.args, inputs, results)
                    kwargs = {k: _fill(v, inputs, results) for k, v in node.kwargs.items()}
                    results.append(node.op(*args, **kwargs))
                else:
                    results.append(node.op(*node.args, **node.kwargs))
            except Exception as exc:  # any torch failure is this node's, reported as such
                raise NodeFailed(node.name, index, exc) from None
            if node.fresh:
                held[index] = _nbytes(results[index])
                live += held[index]
                if live > budget:
                    why = f"intermediate values of {live} bytes exceed the free quota ({budget})"
                    raise NodeFailed(node.name, index, torch.OutOfMemoryError(why))
                most = max(most, live)
            for done in node.release:
                results[done] = None
                live -= held[done]
        outputs = [None if v is None else _lookup(v, inputs, results) for v in self.outputs]
        if peak is not None:
            peak.append(most)
        self.write_back(inputs, outputs)
        return outputs

    def write_back(self, inputs: list[torch.Tensor], outputs: list) -> None:
        """Copy each written output into the input it replaces.

        Raises:
            GraphError: an output's shape differs from its input's.
        """
        for output, target in self.writes:
            value, into = outputs[output], inputs[target]
            if not (isinstance(value, torch.Tensor) and value.shape == into.shape):
                raise GraphError(f"output {output} cannot replace input {target}: shapes differ")
            into.copy_(value)

    def graph_module(self) -> torch.fx.GraphModule:
        """The program as an FX graph of the same aten calls, for a compiler: inputs, then
        the nodes in order, then the outputs (write-backs are left to ``write_back``)."""
        graph = torch.fx.Graph()
        inputs = [graph.placeholder(f"input_{i}") for i in range(self.n_inputs)]
        values: list[torch.fx.Node] = []

        def value(ref: GraphValue) -> torch.fx.Node:
            base = inputs[ref.index] if ref.kind == GraphValue.INPUT else values[ref.index]
            return base if ref.item < 0 else graph.call_function(operator.getitem, (base, ref.item))

        def fill(template: Any) -> Any:
            if type(template) is GraphValue:
                return value(template)
            if type(template) is tuple:
                return [fill(v) for v in template]
            return template

        for node in self.nodes:
            kwargs = {k: fill(v) for k, v in node.kwargs.items()}
            values.append(graph.call_function(node.op, tuple(fill(a) for a in node.args), kwargs))
        graph.output([None if ref is None else value(ref) for ref in self.outputs])
        return torch.fx.GraphModule(torch.nn.Module(), graph)


def _nbytes(result: Any) -> int:
    if isinstance(result, torch.Tensor):
        return result.numel() * result.element_size()
    if isinstance(result, (tuple, list)):
        return sum(_nbytes(r) for r in result)
    return 0


def _lookup(ref: GraphValue, inputs: list, results: list) -> Any:
    value = inputs[ref.index] if ref.kind == GraphValue.INPUT else results[ref.index]
    if ref.item < 0:
        return value
    if type(value) not in (tuple, list) or ref.item >= len(value):
        raise GraphError(f"value {ref.index} has no element {ref.item}")
    return value[ref.item]


def _fill(value: Any, inputs: list, results: list) -> Any:
    if type(value) is GraphValue:
        return _lookup(value, inputs, results)
    if type(value) is tuple:  # templates hold lists as tuples: only those need a walk
        return [_fill(v, inputs, results) for v in value]
    return value


def definition_key(definition: Any, device: torch.device) -> bytes:
    """The content hash a program is cached under (the device is part of it)."""
    packed = msgpack.packb(definition, default=encode_value, use_bin_type=True, strict_types=True)
    return hashlib.sha256(str(device).encode() + b"\0" + packed).digest()


def build_program(definition: Any, device: torch.device) -> GraphProgram:
    """Validate ``definition`` and prepare it to run on ``device``.

    Raises:
        GraphError: the definition is malformed, too big, names an op that is unknown,
            blocked or writes to its arguments, or references a value out of range.
    """
    if not (isinstance(definition, list) and len(definition) in (3, 4)):
        raise GraphError("a graph definition is [n_inputs, nodes, outputs(, writes)]")
    n_inputs, nodes, outputs = definition[:3]
    if type(n_inputs) is not int or not 0 <= n_inputs <= MAX_GRAPH_NODES:
        raise GraphError("n_inputs must be a small non-negative integer")
    if not isinstance(nodes, list) or not isinstance(outputs, list):
        raise GraphError("nodes and outputs must be arrays")
    if len(nodes) > MAX_GRAPH_NODES:
        raise GraphError(f"a graph may have at most {MAX_GRAPH_NODES} nodes, not {len(nodes)}")
    checker = _Checker(n_inputs, device)
    built = [checker.node(i, node) for i, node in enumerate(nodes)]
    checker.available = len(built)
    outs = tuple(None if v is None else checker.reference(v, "output") for v in outputs)
    writes = _writes(definition[3] if len(definition) == 4 else [], len(outs), n_inputs)
    in_place = any(node.op._schema.is_mutable for node in built)
    return GraphProgram(
        n_inputs, _with_releases(built, outs), outs, checker.factory_bytes, writes, in_place
    )


def _writes(pairs: Any, n_outputs: int, n_inputs: int) -> tuple[tuple[int, int], ...]:
    """Validated ``[output, input]`` write-backs: in range, each input written once."""
    if not isinstance(pairs, list):
        raise GraphError("writes must be an array of [output, input] pairs")
    checked: list[tuple[int, int]] = []
    for pair in pairs:
        ok = isinstance(pair, list) and len(pair) == 2 and all(type(v) is int for v in pair)
        if not ok or not (0 <= pair[0] < n_outputs and 0 <= pair[1] < n_inputs):
            raise GraphError(f"write {pair!r} names no output or no input of the graph")
        checked.append((pair[0], pair[1]))
    if len({target for _, target in checked}) != len(checked):
        raise GraphError("a graph may write each input once")
    return tuple(checked)


def _with_releases(nodes: list[_Node], outputs: tuple) -> tuple[_Node, ...]:
    """Each node, told which earlier results it reads last (outputs are never dropped)."""
    last: dict[int, int] = {}
    for index, node in enumerate(nodes):
        for ref in _references((node.args, tuple(node.kwargs.values()))):
            if ref.kind == GraphValue.NODE:
                last[ref.index] = index
    for ref in outputs:
        if ref is not None and ref.kind == GraphValue.NODE:
            last[ref.index] = len(nodes)
    releases: dict[int, list[int]] = {}
    for value, reader in last.items():
        releases.setdefault(reader, []).append(value)
    return tuple(
        dataclasses.replace(node, release=tuple(releases.get(i, ())))
        for i, node in enumerate(nodes)
    )


def _references(template: tuple):
    for value in template:
        if type(value) is GraphValue:
            yield value
        elif type(value) is tuple:
            yield from _references(value)


class _Checker:
    """Validates nodes in order; ``available`` is how many node results exist so far."""

    def __init__(self, n_inputs: int, device: torch.device) -> None:
        self.n_inputs = n_inputs
        self.device = device
        self.available = 0
        self.factory_bytes = 0

    def node(self, index: int, node: Any) -> _Node:
        if not (isinstance(node, list) and len(node) == 3):
            raise GraphError(f"node {index} is not [op_name, args, kwargs]")
        name, args, kwargs = node
        try:
            op = resolve_op(name)
        except UnknownOpError as exc:
            raise GraphError(f"node {index}: {exc}") from None
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            raise GraphError(f"node {index}: arguments must be an array and a map")
        self.available = index
        where = f"node {index} ({name})"
        template = tuple(self.value(a, where) for a in args)
        kw_template = {str(k): self.value(v, where) for k, v in kwargs.items()}
        if op._schema.is_mutable:
            _check_in_place(op, template, where)
        if op._schema.name in _FACTORIES:
            self.factory_bytes += _factory_bytes(op, template, kw_template)
        fills = any(True for _ in _references((template, tuple(kw_template.values()))))
        fresh = all(r.alias_info is None for r in op._schema.returns)
        return _Node(op, name, template, kw_template, fills, fresh)

    def value(self, value: Any, where: str) -> Any:
        if type(value) is GraphValue:
            return self.reference(value, where)
        if type(value) is list:
            return tuple(self.value(v, where) for v in value)
        if isinstance(value, DeviceToken):
            return self.device
        if isinstance(value, _PLAIN):
            return value
        raise GraphError(
            f"{where}: a graph may not hold a {type(value).__name__}; stored tensors are "
            "passed to a graph as its inputs"
        )

    def reference(self, ref: Any, where: str) -> GraphValue:
        if type(ref) is not GraphValue:
            raise GraphError(f"{where}: outputs must be graph values")
        if ref.kind == GraphValue.INPUT:
            limit, what = self.n_inputs, "input"
        elif ref.kind == GraphValue.NODE:
            limit, what = self.available, "earlier node"
        else:
            raise GraphError(f"{where}: unknown graph value kind {ref.kind}")
        if not 0 <= ref.index < limit:
            raise GraphError(
                f"{where}: references {what} {ref.index}, but only {limit} exist there "
                "(a graph can only use its inputs and earlier nodes)"
            )
        if ref.item < -1:
            raise GraphError(f"{where}: negative item index")
        return ref


def _check_in_place(op: torch._ops.OpOverload, args: tuple, where: str) -> None:
    """An op that writes may write only positional arguments that are graph values."""
    for position, argument in written_arguments(op):
        if argument.kwarg_only:
            raise GraphError(
                f"{where}: writes to its {argument.name}= argument; a graph writes only in "
                "place, to its inputs and earlier results"
            )
        value = args[position] if position < len(args) else None
        values = value if type(value) is tuple else (value,)  # a tensor list may be empty
        if not all(type(v) is GraphValue for v in values):
            raise GraphError(f"{where}: writes to {argument.name}, which is not a graph value")


def _factory_bytes(op, args: tuple, kwargs: dict) -> int:
    """Bytes a factory node allocates when its size is constant (0 when it is not)."""
    sizes = args[1] if op._schema.name.startswith("aten::new_") else args[0] if args else None
    if not (type(sizes) is tuple and all(type(s) is int for s in sizes)):
        return 0
    if any(s < 0 for s in sizes):
        raise GraphError(f"{op._schema.name}: negative dimension in a size")
    dtype = kwargs.get("dtype")
    itemsize = dtype.itemsize if isinstance(dtype, torch.dtype) else 8
    count = 1
    for s in sizes:
        count *= s
    return count * itemsize


class ProgramCache:
    """Built programs by content hash, least recently used first out."""

    def __init__(self, capacity: int = MAX_CACHED_PROGRAMS) -> None:
        self.capacity = capacity
        self._programs: OrderedDict[bytes, GraphProgram] = OrderedDict()
        self.builds = 0

    def get(self, definition: Any, device: torch.device) -> tuple[bytes, GraphProgram]:
        """The content hash of ``definition`` and its program, built (and validated) only
        on first sight.

        Raises:
            GraphError: as ``build_program``.
        """
        try:
            key = definition_key(definition, device)
        except (TypeError, ValueError, OverflowError) as exc:
            raise GraphError(f"a graph definition holds an unencodable value: {exc}") from None
        program = self._programs.get(key)
        if program is None:
            program = build_program(definition, device)
            self.builds += 1
            self._programs[key] = program
            if len(self._programs) > self.capacity:
                self._programs.popitem(last=False)
        else:
            self._programs.move_to_end(key)
        return key, program


#: One cache per executor process: programs are shared by its sessions (and workers).
PROGRAMS = ProgramCache()


def define(
    graphs: dict[int, tuple[bytes, GraphProgram]], graph_id: int, definition: Any, device
) -> GraphProgram:
    """Validate ``definition`` and keep it in a session's ``graphs`` under ``graph_id``
    (as ``(content hash, program)``). Defining an id again with the same graph is allowed
    (a session that moves sends its graphs again).

    Raises:
        GraphError: the definition breaks a rule, the id holds another graph, or the
            session has ``MAX_SESSION_GRAPHS`` already.
    """
    known = graphs.get(graph_id)
    if known is None and len(graphs) >= MAX_SESSION_GRAPHS:
        raise GraphError(f"a session may define at most {MAX_SESSION_GRAPHS} graphs")
    try:
        key, program = PROGRAMS.get(definition, device)
    except GraphError as exc:
        raise GraphError(f"graph {graph_id}: {exc}") from None
    if known is not None and known[0] != key:
        raise GraphError(f"graph {graph_id} is already defined otherwise")
    graphs[graph_id] = (key, program)
    return program
