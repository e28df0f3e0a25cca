"""The op-stream wire codec: versioned msgpack headers plus raw tensor payloads.

Theory of operation
-------------------
One transport frame carries one message::

    u32 header_length | msgpack header | blob area (raw bytes)

The header is a msgpack array whose first element names the message. Tensor bytes never
pass through msgpack: they sit in the blob area and the header names them by index, so
an upload leaves the client straight from the tensor's memory (scatter-gather send) and
lands in the executor as a ``memoryview`` slice of the received frame.

Client → executor::

    ["hello", version, {options}]
    ["resume", version, {"token": token}]   (take back a session the executor kept)
    ["batch", seq, ops, frees, query, blob_lengths, grows?]
    ["resend", seq]                         (after a resume: the reply to batch seq again)
    ["bye"]

Executor → client::

    ["welcome", version, {info}]  (info carries the session "token"; after a resume also
                                   "resumed": true and "last_seq", the last batch it ran)
    ["refused", reason]           (no session under that token; hello may follow)
    ["reply", seq, error_or_nil, result, blob_lengths]
    ["fatal", message]            (protocol violation; the executor closes the session)
    ["lost", message, fault]      (the session's state on this host is gone; fault
                                   "host": the client fails over if it can; "session":
                                   its own op caused it (it poisoned the device context),
                                   so replaying elsewhere would fail the same way)

A batch's ``query`` is ``["sync"]``, ``["fetch", tensor]``, ``["call"]`` (describe the
outputs of the last ``dyn`` op), ``["stats"]``, ``["checkpoint"]`` (every storage's
``[handle, dtype, nbytes]`` and, as a blob, the RNG state) or ``["read", [[handle, start,
length], ...]]`` (storage bytes, as blobs). Besides aten ops, a batch may carry the records
``@seed [seed]``, ``@restore [handle, dtype, nbytes, start, bytes]`` (one piece of a
storage from a checkpoint) and ``@rng [bytes]`` (the generator state), ``bytes`` being an
inline uint8 tensor; failover (``failover.py``) is built from these. Compiled steps add
``@graph [graph_id, definition]`` (an aten graph as data, defined once per session) and
``@run [graph_id, inputs]`` (one call of it; the record's ``outs`` name its outputs'
handles), described in ``graphs.py``.

A batch's optional ``grows`` counts the bytes of the storages its ops create, as the client
sized them: a host that bounds its device's memory makes that room before the ops run
(evicting other tenants) rather than after.

An *op* is ``[name, args, kwargs, outs]``: ``name`` an aten overload such as
``"aten.add.Tensor"``; ``args``/``kwargs`` plain msgpack values in which tensors, dtypes
and devices appear as msgpack ext types (below); ``outs`` lists the storage handle the
client assigned to each output that needs new memory (``None`` where the output aliases an
input), with the layout the client inferred for it, or ``["dyn", first_handle]`` for an op
whose output shapes only the executor can know (the client then waits for the reply).

Handles name *storages*, not tensors: a tensor on the wire is ``(handle, dtype, offset,
sizes, strides)``, so views cost nothing to send and the executor bounds-checks every one
against the storage it names. Batches carry a sequence number so a stream can be resumed
and replayed from a checkpoint (see ``DESIGN.md``).

This module is sans-IO: bytes in, typed values out. It imports torch only for the dtype
tables.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgpack
import torch

from .._errors import RemoteProtocolError

PROTOCOL_VERSION = 1

EXT_TENSOR = 1  # a remote tensor: handle, dtype, offset, sizes, strides
EXT_DTYPE = 2
EXT_DEVICE = 3  # "the session's device"; the executor substitutes its own
EXT_LAYOUT = 4
EXT_MEMORY_FORMAT = 5
EXT_COMPLEX = 6
EXT_CPU_TENSOR = 7  # a consumer-side tensor shipped by value: dtype, sizes, blob index
EXT_GRAPH_VALUE = 8  # inside a compiled graph: a graph input or a node's result (graphs.py)

DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.complex32,
)
DTYPE_CODE = {dt: i for i, dt in enumerate(DTYPES)}
LAYOUTS: tuple[torch.layout, ...] = (torch.strided,)
MEMORY_FORMATS: tuple[torch.memory_format, ...] = (
    torch.contiguous_format,
    torch.preserve_format,
    torch.channels_last,
    torch.channels_last_3d,
)

_TENSOR_HEAD = struct.Struct("<qBBq")  # handle, dtype code, ndim, storage offset
_CPU_HEAD = struct.Struct("<BBI")  # dtype code, ndim, blob index
_COMPLEX = struct.Struct("<dd")
_GRAPH_VALUE = struct.Struct("<Bqq")  # kind, index, item
_U32 = struct.Struct("<I")
MAX_NDIM = 64
BLOB_ALIGN = 16


class TensorRef(NamedTuple):
    """A remote tensor as the wire names it: a view onto one storage handle.

    A NamedTuple rather than a dataclass: the executor decodes one per tensor argument,
    and tuple construction is several times cheaper.
    """

    handle: int
    dtype: torch.dtype
    offset: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]

    def to_ext(self) -> msgpack.ExtType:
        return msgpack.ExtType(EXT_TENSOR, pack_tensor_ref(self))


@dataclass(frozen=True, slots=True)
class CpuTensorRef:
    """A consumer-side tensor sent by value; its bytes are blob ``blob`` of the frame."""

    dtype: torch.dtype
    sizes: tuple[int, ...]
    blob: int


class GraphValue(NamedTuple):
    """A value inside a compiled graph: graph input ``index`` (``kind`` INPUT) or the
    result of node ``index`` (``kind`` NODE), its element ``item`` when ``item >= 0``."""

    kind: int
    index: int
    item: int

    INPUT = 0
    NODE = 1


class DeviceToken:
    """Stands for "the session's device" in decoded arguments."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<session device>"


SESSION_DEVICE = DeviceToken()


def storage_extent(sizes, strides, offset: int) -> int:
    """How many elements of storage a strided view needs (0 for an empty view)."""
    if 0 in sizes:
        return 0
    return offset + 1 + sum((n - 1) * s for n, s in zip(sizes, strides, strict=True))


def pack_tensor_ref(ref: TensorRef) -> bytes:
    ndim = len(ref.sizes)
    dims = _DIMS[ndim] if ndim < len(_DIMS) else struct.Struct(f"<{2 * ndim}q")
    head = _TENSOR_HEAD.pack(ref.handle, DTYPE_CODE[ref.dtype], ndim, ref.offset)
    return head + dims.pack(*ref.sizes, *ref.strides)


_DIMS = [struct.Struct(f"<{2 * n}q") for n in range(9)]
_HANDLE = struct.Struct("<q")


def tensor_layout(dtype: torch.dtype, offset: int, sizes, strides) -> bytes:
    """The bytes of a tensor reference after its handle: packed once for a layout that
    recurs every step, then joined to each step's handle by ``tensor_ext``."""
    return pack_tensor_ref(TensorRef(0, dtype, offset, tuple(sizes), tuple(strides)))[
        _HANDLE.size :
    ]


def tensor_ext(handle: int, layout: bytes) -> msgpack.ExtType:
    """The wire reference to ``handle`` with a ``tensor_layout``."""
    return msgpack.ExtType(EXT_TENSOR, _HANDLE.pack(handle) + layout)


@functools.lru_cache(maxsize=16384)  # a training loop names the same views step after step
def _unpack_tensor_ref(data: bytes) -> TensorRef:
    if len(data) < _TENSOR_HEAD.size:
        raise RemoteProtocolError("truncated tensor reference")
    handle, code, ndim, offset = _TENSOR_HEAD.unpack_from(data)
    if len(data) != _TENSOR_HEAD.size + 16 * ndim:
        raise RemoteProtocolError("tensor reference length does not match its rank")
    dims = struct.unpack_from(f"<{2 * ndim}q", data, _TENSOR_HEAD.size)
    return TensorRef(handle, _dtype(code), offset, dims[:ndim], dims[ndim:])


def _dtype(code: int) -> torch.dtype:
    if code >= len(DTYPES):
        raise RemoteProtocolError(f"unknown dtype code {code}")
    return DTYPES[code]


def _indexed(table: tuple, data: bytes, what: str) -> Any:
    if len(data) != 1 or data[0] >= len(table):
        raise RemoteProtocolError(f"unknown {what} code")
    return table[data[0]]


def encode_value(obj: Any) -> msgpack.ExtType:
    """msgpack ``default`` hook: the non-msgpack values an aten call can take."""
    if isinstance(obj, torch.dtype):
        return msgpack.ExtType(EXT_DTYPE, bytes((DTYPE_CODE[obj],)))
    if isinstance(obj, (torch.device, DeviceToken)):
        return msgpack.ExtType(EXT_DEVICE, b"")
    if isinstance(obj, torch.layout):
        return msgpack.ExtType(EXT_LAYOUT, bytes((LAYOUTS.index(obj),)))
    if isinstance(obj, torch.memory_format):
        return msgpack.ExtType(EXT_MEMORY_FORMAT, bytes((MEMORY_FORMATS.index(obj),)))
    if isinstance(obj, complex):
        return msgpack.ExtType(EXT_COMPLEX, _COMPLEX.pack(obj.real, obj.imag))
    if isinstance(obj, CpuTensorRef):
        head = _CPU_HEAD.pack(DTYPE_CODE[obj.dtype], len(obj.sizes), obj.blob)
        dims = struct.pack(f"<{len(obj.sizes)}q", *obj.sizes)
        return msgpack.ExtType(EXT_CPU_TENSOR, head + dims)
    if type(obj) is TensorRef:
        return obj.to_ext()
    if type(obj) is GraphValue:
        return msgpack.ExtType(EXT_GRAPH_VALUE, _GRAPH_VALUE.pack(*obj))
    if isinstance(obj, tuple):  # strict packing sends every tuple here: torch.Size, ...
        return list(obj)
    wire = getattr(obj, "_wire", None)  # a RemoteTensor builds its own reference
    if wire is not None:
        return wire()
    raise TypeError(f"cannot send a value of type {type(obj).__name__} to the executor")


def decode_ext(code: int, data: bytes) -> Any:
    """msgpack ``ext_hook``: the inverse of ``encode_value``. Raises on malformed input."""
    if code == EXT_TENSOR:
        return _unpack_tensor_ref(data)
    if code == EXT_DTYPE:
        return _indexed(DTYPES, data, "dtype")
    if code == EXT_DEVICE:
        return SESSION_DEVICE
    if code == EXT_LAYOUT:
        return _indexed(LAYOUTS, data, "layout")
    if code == EXT_MEMORY_FORMAT:
        return _indexed(MEMORY_FORMATS, data, "memory format")
    if code == EXT_COMPLEX:
        if len(data) != _COMPLEX.size:
            raise RemoteProtocolError("malformed complex number")
        return complex(*_COMPLEX.unpack(data))
    if code == EXT_CPU_TENSOR:
        if len(data) < _CPU_HEAD.size:
            raise RemoteProtocolError("truncated inline tensor")
        dcode, ndim, blob = _CPU_HEAD.unpack_from(data)
        if len(data) != _CPU_HEAD.size + 8 * ndim:
            raise RemoteProtocolError("inline tensor length does not match its rank")
        sizes = struct.unpack_from(f"<{ndim}q", data, _CPU_HEAD.size)
        return CpuTensorRef(_dtype(dcode), sizes, blob)
    if code == EXT_GRAPH_VALUE:
        if len(data) != _GRAPH_VALUE.size:
            raise RemoteProtocolError("malformed graph value")
        return GraphValue(*_GRAPH_VALUE.unpack(data))
    raise RemoteProtocolError(f"unknown ext type {code}")


# --- frames --------------------------------------------------------------------------


def _pad(n: int) -> int:
    return -n % BLOB_ALIGN


def encode_frame(header: list, blobs: list[memoryview] = ()) -> list:
    """Return the parts of one frame: length-prefixed header, then the blobs unjoined.

    Every blob starts at a ``BLOB_ALIGN`` offset in the frame, so the receiver can view
    it as float64/complex128 data in place (vectorised kernels fault on misaligned data).
    """
    # strict_types: a TensorRef is a tuple and must reach encode_value, not become an array.
    packed = msgpack.packb(header, default=encode_value, use_bin_type=True, strict_types=True)
    parts = [_U32.pack(len(packed)) + packed + bytes(_pad(_U32.size + len(packed)))]
    for blob in blobs:
        parts.append(blob)
        if _pad(len(blob)):
            parts.append(bytes(_pad(len(blob))))
    return parts


def aligned_bytes(blob: memoryview) -> torch.Tensor:
    """A uint8 tensor over ``blob``, copied only if the peer left it misaligned.

    Never trust a peer's alignment: a misaligned view could crash a SIMD kernel.
    """
    tensor = torch.frombuffer(blob, dtype=torch.uint8)
    return tensor.clone() if tensor.data_ptr() % BLOB_ALIGN else tensor


def lost_reason(frame: bytearray) -> tuple[str, str] | None:
    """``(reason, fault)`` from a ``["lost", reason, fault]`` frame; None for any other.

    Checked on every reply, so it looks at the header's first bytes before decoding.
    """
    if frame[_U32.size : _U32.size + len(_LOST_START)] != _LOST_START:
        return None
    header, _ = decode_frame(frame)
    reason, fault = header[1], header[2]
    if not (isinstance(reason, str) and fault in ("host", "session")):
        raise RemoteProtocolError("a malformed lost message")
    return reason, fault


_LOST_START = b"\x93\xa4lost"  # msgpack: a 3-element array whose first element is "lost"


def decode_frame(frame: bytearray | bytes, *, max_header: int = 64 * 1024 * 1024):
    """Split a frame into its decoded header list and the blob area (a memoryview).

    Raises:
        RemoteProtocolError: the frame is truncated, its header is not msgpack, or
            the header is not a non-empty array.
    """
    view = memoryview(frame)
    if len(view) < _U32.size:
        raise RemoteProtocolError("frame shorter than its header length field")
    (hlen,) = _U32.unpack_from(view)
    if hlen > len(view) - _U32.size or hlen > max_header:
        raise RemoteProtocolError(f"header length {hlen} exceeds the frame")
    try:
        header = msgpack.unpackb(
            view[_U32.size : _U32.size + hlen],
            ext_hook=decode_ext,
            raw=False,
            strict_map_key=True,
            max_bin_len=0,  # bulk bytes travel as blobs, never inside the header
        )
    except RemoteProtocolError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise RemoteProtocolError(f"malformed header: {exc}") from exc
    if not isinstance(header, list) or not header or not isinstance(header[0], str):
        raise RemoteProtocolError("header must be a non-empty array starting with a kind")
    start = _U32.size + hlen + _pad(_U32.size + hlen)
    return header, view[min(start, len(view)) :]


def split_blobs(area: memoryview, lengths: Any) -> list[memoryview]:
    """Cut the blob area into the blobs the header announced, checking the lengths add up."""
    if not isinstance(lengths, list) or not all(type(n) is int and n >= 0 for n in lengths):
        raise RemoteProtocolError("blob lengths must be a list of non-negative integers")
    padded = sum(n + _pad(n) for n in lengths)
    if padded != len(area):
        raise RemoteProtocolError(
            f"blob lengths add up to {padded} padded bytes but the frame carries {len(area)}"
        )
    out, pos = [], 0
    for n in lengths:
        out.append(area[pos : pos + n])
        pos += n + _pad(n)
    return out
