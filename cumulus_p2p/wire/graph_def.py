"""A captured aten graph as plain data: the definition both devices send a host.

``encode_graph(gm)`` turns an FX graph of aten ops (what AOTAutograd captures) into the
definition ``host/graphs.py`` validates and runs: ``[n_inputs, nodes, outputs]``, each
node ``[op_name, args, kwargs]`` whose tensor arguments are ``GraphValue`` references to
a graph input or an earlier node's result. The Python device sends it inside its
msgpack frames (``@graph``); the native device sends it as bytes in a GRAPH record,
packed here (``pack_definition``) and unpacked on the host (``unpack_definition``) with
the same value codec as the Python device's frames. No I/O, no device.
"""

from __future__ import annotations

import operator
from typing import Any

import msgpack
import torch

from .._errors import RemoteProtocolError
from .ops import op_name
from .protocol import GraphValue, decode_ext, encode_value


class GraphEncodingError(Exception):
    """The graph cannot travel as data: a node that is not an aten op, or a value a
    definition cannot carry (a tensor constant, a symbolic size)."""


def encode_graph(gm: torch.fx.GraphModule) -> tuple[list, list, list]:
    """``gm`` as a wire definition ``[n_inputs, nodes, outputs]``, with the captured
    values (``meta["val"]``) of its inputs and outputs.

    Raises:
        GraphEncodingError: a node is not an aten op, or holds a value a graph cannot
            carry.
    """
    values: dict[torch.fx.Node, GraphValue] = {}
    nodes: list[list] = []
    inputs: list = []
    outputs: list = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            values[node] = GraphValue(GraphValue.INPUT, len(inputs), -1)
            inputs.append(node.meta.get("val"))
        elif node.op == "call_function" and node.target is operator.getitem:
            base = values[node.args[0]]
            values[node] = GraphValue(base.kind, base.index, node.args[1])
        elif node.op == "call_function" and _is_aten(node.target):
            values[node] = GraphValue(GraphValue.NODE, len(nodes), -1)
            args, kwargs = _encode_value(node.args, values), _encode_value(node.kwargs, values)
            nodes.append([op_name(node.target), args, kwargs])
        elif node.op == "output":
            outputs = list(node.args[0])
        else:
            raise GraphEncodingError(f"the graph holds {node.op} {node.target}, not an aten op")
    wire_outputs = [None if v is None else values[v] for v in outputs]
    vals = [None if v is None else v.meta.get("val") for v in outputs]
    return [len(inputs), nodes, wire_outputs], inputs, vals


def pack_definition(definition: list) -> bytes:
    """A definition as the bytes a GRAPH record carries (msgpack, the frames' codec)."""
    return msgpack.packb(definition, default=encode_value, strict_types=True, use_bin_type=True)


def unpack_definition(data: bytes | memoryview) -> Any:
    """The definition a GRAPH record carries; ``host/graphs.py`` validates the rest.

    Raises:
        RemoteProtocolError: the bytes are not one msgpack value of the frames' codec.
    """
    try:
        return msgpack.unpackb(
            data, ext_hook=decode_ext, raw=False, strict_map_key=True, max_bin_len=0
        )
    except RemoteProtocolError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise RemoteProtocolError(f"a graph definition that is not msgpack: {exc}") from exc


def _is_aten(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target.namespace == "aten"


def _encode_value(value: Any, values: dict) -> Any:
    if isinstance(value, torch.fx.Node):
        return values[value]
    if isinstance(value, (list, tuple)):
        return [_encode_value(v, values) for v in value]
    if isinstance(value, dict):
        return {k: _encode_value(v, values) for k, v in value.items()}
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool, torch.Tensor)):
        raise GraphEncodingError(f"the graph holds a {type(value).__name__} constant")
    return value
