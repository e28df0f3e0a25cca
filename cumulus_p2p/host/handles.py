"""A session's handle table: the storages its client named, and what it knows of each.

Theory of operation
-------------------
A client names every remote storage by a handle it chooses. The table maps each live handle
to one ``HandleEntry``: the *anchor* (a 1-d tensor over the whole storage), the storage's
size in bytes as it was registered (its *capacity*, what the quota counts), the checked
views of it built so far, and, while a ``@restore`` fills it piece by piece, where the next
piece starts. An entry is added and dropped whole, so nothing about a freed handle outlives
it, and the session's ``bytes_in_use`` is the sum of the live capacities.

A handle with no entry may be *poisoned*: the op meant to produce it failed, and an op that
reads it reports why rather than "no such handle". Registering the handle again, or freeing
it, clears the poison; a live handle is never poisoned.

Views are cached per reference, because parameters, gradients and optimizer state are named
the same way every step: a view built and bounds-checked once is reused until its storage is
freed or moved (``move_to``). Looking one up is the executor's hot path, one per tensor
argument, so ``view`` does two dict lookups when the view is known and nothing else.

Every check raises ``OpFailed`` with an ``ErrorKind``: the error vocabulary the table shares
with the session (``session.py``), which reports it as that op's error.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..blobs.names import PIECE, digest
from ..blobs.store import BlobStore, PinnedBlob
from ..wire.protocol import TensorRef, storage_extent
from .eviction import enough

if TYPE_CHECKING:
    from .session import SessionStats

MAX_HANDLE = 2**62
#: Distinct views of one storage the executor keeps built (a bound on what a client's
#: references can make it hold).
MAX_VIEWS_PER_STORAGE = 64


class ErrorKind:
    """The error kinds a session reports (the first field of a reply's error). The client
    raises each as a ``RemoteExecutionError`` that is also the builtin of that name, where
    there is one (``errors.py``). Plain strings: they go on the wire as they are."""

    PROTOCOL_ERROR = "RemoteProtocolError"  # the client broke the op-stream protocol
    INVALID_HANDLE = "InvalidHandleError"  # a handle this session does not hold, or reuses
    INVALID_GRAPH = "InvalidGraphError"  # a compiled graph that cannot be defined or run
    OUT_OF_MEMORY = "OutOfMemoryError"  # over the session's quota, or the device is full
    UNKNOWN_OP = "UnknownOpError"  # not an aten op, or one the executor refuses
    INTERNAL = "InternalError"  # an executor bug; it cost one op, not the session
    INDEX = "IndexError"  # a view or a piece outside its storage
    BLOB_MISMATCH = "BlobMismatchError"  # a blob's bytes are not what its digest names
    VALUE = "ValueError"
    TYPE = "TypeError"
    RUNTIME = "RuntimeError"
    #: A collective's group broke (a peer lost): the client's group goes back to its last
    #: checkpoint together (``remote/regroup.py``), or raises it.
    GROUP = "CollectiveGroupError"


class OpFailed(Exception):  # noqa: N818 - internal carrier, never leaves the executor
    """An op could not run; carries the error to report (type name, message), and the op
    to name when it is not the record's own (a node inside a compiled graph)."""

    def __init__(self, kind: str, message: str, op: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.op = op


@dataclass(slots=True)
class HandleEntry:
    """One live storage. Read its fields; change them only through the ``HandleTable``."""

    anchor: torch.Tensor
    #: The storage's bytes when it was registered: what the quota counts and what views
    #: and reads are checked against.
    capacity: int
    views: dict[TensorRef, torch.Tensor] = field(default_factory=dict)
    #: Where the next ``@restore`` piece starts, while a restore of this storage is open.
    restore_next: int | None = None
    #: The table's ``clock`` when an op last named it: the coldest leave the device first.
    used: int = 0


class HandleTable:
    """The live storages of one session by handle, their views, and the quota they count
    against.

    Args:
        device: Where views of a dtype other than their anchor's are made.
        stats: The session's statistics, whose ``bytes_in_use``, ``peak_bytes`` and
            ``storages`` only the table writes.
        quota_bytes: Most bytes the live storages may hold together.
    """

    def __init__(self, device: torch.device, stats: SessionStats, *, quota_bytes: int) -> None:
        self.device = device
        self.stats = stats
        self.quota_bytes = quota_bytes
        self._entries: dict[int, HandleEntry] = {}
        self._poisoned: dict[int, str] = {}  # handle -> why it has no value
        #: Advanced by the session once per batch; entries named since carry its value.
        self.clock = 0

    def __contains__(self, handle: object) -> bool:
        return handle in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, handle: int) -> HandleEntry | None:
        """The live entry under ``handle``, or None."""
        return self._entries.get(handle)

    def items(self) -> Iterator[tuple[int, HandleEntry]]:
        """Every live ``(handle, entry)``, in the order they were registered."""
        return iter(self._entries.items())

    @property
    def bytes_in_use(self) -> int:
        """The live storages' capacities, summed."""
        return self.stats.bytes_in_use

    # --- registering and releasing ------------------------------------------------------

    def add(self, handle: object, tensor: torch.Tensor) -> None:
        """Register ``tensor`` (its whole storage) under a new handle; clears any poison.

        The quota is not checked here: an op's outputs are registered first and the quota
        checked once for them all (``check_quota``), so the op can be undone whole.

        Raises:
            OpFailed: INVALID_HANDLE, when ``handle`` is not one a client may choose or is
                already in use.
        """
        if type(handle) is not int or not 0 < handle < MAX_HANDLE:
            raise OpFailed(ErrorKind.INVALID_HANDLE, f"bad output handle {handle!r}")
        if handle in self._entries:
            raise OpFailed(ErrorKind.INVALID_HANDLE, f"handle {handle} is already in use")
        nbytes = tensor.untyped_storage().nbytes()
        self._entries[handle] = HandleEntry(tensor, nbytes, used=self.clock)
        self._poisoned.pop(handle, None)
        stats = self.stats
        stats.bytes_in_use += nbytes
        stats.storages += 1
        stats.peak_bytes = max(stats.peak_bytes, stats.bytes_in_use)

    def release(self, handle: object) -> None:
        """Forget ``handle`` whole (storage, views, restore, poison); unknown ones are
        ignored, as a client's frees of handles whose op failed must be."""
        if type(handle) is not int:
            return
        self._poisoned.pop(handle, None)
        entry = self._entries.pop(handle, None)
        if entry is not None:
            self.stats.bytes_in_use -= entry.capacity
            self.stats.storages -= 1

    def resize(self, handle: int, nbytes: int) -> None:
        """Give ``handle`` a storage of ``nbytes`` bytes, as ``UntypedStorage.resize_`` does
        on a GPU: the first bytes, as many as both sizes hold, are kept, the rest are
        uninitialised, and 0 lets go of the memory (FSDP2 frees a layer's gathered
        parameters that way between uses, and gives them memory again before the next).

        The handle and its views' references stay valid; each view is checked against the
        new size when next named.

        Raises:
            OpFailed: INVALID_HANDLE for a handle the session does not hold, VALUE for a
                negative size, OUT_OF_MEMORY when the growth does not fit the quota.
        """
        entry = self._entries.get(handle)
        if entry is None:
            raise OpFailed(ErrorKind.INVALID_HANDLE, f"no tensor with handle {handle} here")
        if nbytes < 0:
            raise OpFailed(ErrorKind.VALUE, f"cannot resize a storage to {nbytes} bytes")
        growth = nbytes - entry.capacity
        if growth > 0:
            self.check_quota(growth)
        old = entry.anchor
        # A new storage rather than the old one resized: an uploaded storage may sit on
        # memory torch cannot resize (a blob's), and the old bytes are copied either way.
        storage = torch.UntypedStorage(nbytes, device=old.device)
        entry.anchor = anchor_over(storage, old.dtype, old.device)
        kept = min(nbytes, entry.capacity)
        if kept:
            raw_bytes(entry.anchor, 0, kept).copy_(raw_bytes(old, 0, kept))
        entry.capacity = nbytes
        entry.views.clear()
        stats = self.stats
        stats.bytes_in_use += growth
        stats.peak_bytes = max(stats.peak_bytes, stats.bytes_in_use)

    def clear(self) -> None:
        """Release every handle."""
        self._entries.clear()
        self._poisoned.clear()
        self.stats.bytes_in_use = 0
        self.stats.storages = 0

    def check_quota(self, extra: int) -> None:
        """Raise unless ``extra`` more bytes fit the quota beside those in use.

        Raises:
            OpFailed: OUT_OF_MEMORY, naming the bytes needed and the quota.
        """
        if self.stats.bytes_in_use + extra > self.quota_bytes:
            raise OpFailed(
                ErrorKind.OUT_OF_MEMORY,
                f"session memory quota exceeded: {self.stats.bytes_in_use + extra} bytes "
                f"needed, quota is {self.quota_bytes} bytes",
            )

    # --- poisoning ----------------------------------------------------------------------

    def poison(self, handle: int, why: str) -> None:
        """Record why ``handle`` has no value, unless it has one (then the record could
        never be read: a live handle's views come from its storage)."""
        if handle not in self._entries:
            self._poisoned[handle] = why

    def poisoned(self, handle: int) -> str | None:
        """Why ``handle`` has no value, if an op meant to produce it failed."""
        return self._poisoned.get(handle)

    # --- views --------------------------------------------------------------------------

    def view(self, ref: TensorRef) -> torch.Tensor:
        """The tensor ``ref`` names, checked to stay inside its storage (cached per ref).

        Raises:
            OpFailed: RUNTIME for a poisoned handle, INVALID_HANDLE for one the session
                does not hold, INDEX for a view outside its storage.
        """
        entry = self._entries.get(ref.handle)
        if entry is not None:
            entry.used = self.clock
            view = entry.views.get(ref)
            if view is not None:
                return view
        return self._cache_view(ref, entry)

    def _cache_view(self, ref: TensorRef, entry: HandleEntry | None) -> torch.Tensor:
        if entry is None:
            why = self._poisoned.get(ref.handle)
            if why is not None:
                raise OpFailed(ErrorKind.RUNTIME, f"input is unavailable: {why}")
            raise OpFailed(ErrorKind.INVALID_HANDLE, f"no tensor with handle {ref.handle} here")
        if len(entry.views) >= MAX_VIEWS_PER_STORAGE:
            entry.views.clear()
        view = entry.views[ref] = self._checked_view(ref, entry)
        return view

    def _checked_view(self, ref: TensorRef, entry: HandleEntry) -> torch.Tensor:
        if ref.offset < 0 or min(ref.sizes, default=0) < 0 or min(ref.strides, default=0) < 0:
            raise OpFailed(ErrorKind.INDEX, "negative size, stride or offset in a tensor reference")
        needed = storage_extent(ref.sizes, ref.strides, ref.offset) * ref.dtype.itemsize
        if needed > entry.capacity:
            raise OpFailed(
                ErrorKind.INDEX,
                f"view of {needed} bytes is out of bounds for a storage of {entry.capacity} bytes",
            )
        anchor = entry.anchor
        if ref.dtype == anchor.dtype:
            return anchor.as_strided(ref.sizes, ref.strides, ref.offset)
        # A view under another dtype (view(dtype), view_as_real): same bytes, new element type.
        return torch.empty(0, dtype=ref.dtype, device=self.device).set_(
            anchor.untyped_storage(), ref.offset, ref.sizes, ref.strides
        )

    def forget_views(self) -> None:
        """Drop every cached view (they are rebuilt, and checked again, when next named)."""
        for entry in self._entries.values():
            entry.views.clear()

    def coldest(self, handles: Iterable[int], need: int | None) -> list[int]:
        """Of ``handles``, those no op named for longest, taken until their storages add
        up to ``need`` bytes (all of them for None, or when together they fall short)."""
        if need is None:
            return list(handles)
        coldest = sorted(handles, key=lambda h: self._entries[h].used)
        return enough(((h, self._entries[h].capacity) for h in coldest), need)

    def capacity(self, handles: Iterable[int]) -> int:
        """The bytes the storages of ``handles`` hold together."""
        return sum(self._entries[handle].capacity for handle in handles)

    def move_to(self, device: torch.device, handles: Iterable[int] | None = None) -> None:
        """Copy the storages of ``handles`` (None: every one) to ``device`` (pinned when
        that is host memory, for a fast way back) and forget the views of the old copies.
        Either every one moves or, when a copy fails, none does."""
        entries = [self._entries[handle] for handle in self._chosen(handles)]
        moved = [_moved(entry.anchor, device) for entry in entries]
        for entry, anchor in zip(entries, moved, strict=True):
            entry.anchor = anchor
            entry.views.clear()

    def page_out(
        self, store: BlobStore, handles: Iterable[int] | None = None
    ) -> dict[int, list[PinnedBlob]]:
        """Write the storages of ``handles`` (None: every one) to ``store`` as named
        pieces, pinned, then let go of their memory: each anchor becomes an empty
        placeholder of its dtype until ``page_in``. Either every one is paged out or,
        when the store cannot keep a piece, none is (and no piece stays pinned).

        Raises:
            OSError: the store could not keep a piece (full, or the disk refused it).
        """
        chosen = self._chosen(handles)
        paged: dict[int, list[PinnedBlob]] = {}
        try:
            for handle in chosen:
                paged[handle] = write_pieces(self._entries[handle].anchor, store)
        except BaseException:
            unpin(paged)
            raise
        for handle in chosen:
            entry = self._entries[handle]
            entry.anchor = torch.empty(0, dtype=entry.anchor.dtype)
            entry.views.clear()
        return paged

    def _chosen(self, handles: Iterable[int] | None) -> list[int]:
        """``handles``, or every live one for None."""
        return list(self._entries if handles is None else handles)

    def page_in(self, paged: dict[int, list[PinnedBlob]], device: torch.device) -> None:
        """Bring the storages ``page_out`` wrote back onto ``device``, each piece checked
        against its name; the pins are closed either way.

        Raises:
            BlobMismatchError: a piece was damaged on disk (no anchor changed then).
        """
        try:
            anchors = {
                h: _paged_in(pins, self._entries[h].anchor.dtype, device)
                for h, pins in paged.items()
            }
        finally:
            unpin(paged)
        for handle, anchor in anchors.items():
            self._entries[handle].anchor = anchor

    # --- restoring ----------------------------------------------------------------------

    def restore_target(
        self, handle: int, dtype: torch.dtype, nbytes: int, start: int
    ) -> torch.Tensor:
        """The anchor a ``@restore`` piece at byte ``start`` goes into. A piece must fit the
        storage its first piece made, right after the last piece: pieces come in order,
        with no gap or overlap, and only while a restore is open (``restored``).

        Raises:
            OpFailed: INVALID_HANDLE when no first piece made the storage, VALUE when it
                was made otherwise, PROTOCOL_ERROR for a piece out of order.
        """
        entry = self._entries.get(handle)
        if entry is None:
            raise OpFailed(
                ErrorKind.INVALID_HANDLE, f"@restore: storage {handle} must start at byte 0"
            )
        if entry.anchor.dtype != dtype or entry.capacity != nbytes:
            raise OpFailed(
                ErrorKind.VALUE,
                f"@restore: storage {handle} holds {entry.capacity} bytes of "
                f"{entry.anchor.dtype}, not {nbytes} bytes of {dtype}",
            )
        if start == 0:
            return entry.anchor
        expected = entry.restore_next
        if expected is None:
            raise OpFailed(
                ErrorKind.PROTOCOL_ERROR, f"@restore: storage {handle} is not being restored"
            )
        if start != expected:
            raise OpFailed(
                ErrorKind.PROTOCOL_ERROR,
                f"@restore: the next piece of storage {handle} starts at byte {expected}, "
                f"not {start} (pieces come in order, without gaps or overlaps)",
            )
        return entry.anchor

    def restored(self, handle: int, end: int) -> None:
        """A piece of live storage ``handle`` ending at byte ``end`` was written: the
        restore stays open for the next piece, or closes when the storage is full."""
        entry = self._entries[handle]
        entry.restore_next = end if end < entry.capacity else None


def anchor_over(storage: torch.UntypedStorage, dtype: torch.dtype, device) -> torch.Tensor:
    """A 1-d anchor of ``dtype`` over a whole storage; views never depend on its shape."""
    count = storage.nbytes() // dtype.itemsize
    return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, (count,), (1,))


def raw_bytes(anchor: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """Bytes ``[start, start + length)`` of an anchor's storage, as a uint8 view."""
    raw = torch.empty(0, dtype=torch.uint8, device=anchor.device)
    return raw.set_(anchor.untyped_storage(), start, (length,), (1,))


def unpin(paged: dict[int, list[PinnedBlob]]) -> None:
    """Let go of every piece ``page_out`` pinned."""
    for pins in paged.values():
        for pin in pins:
            pin.close()


def write_pieces(anchor: torch.Tensor, store: BlobStore) -> list[PinnedBlob]:
    """An anchor's whole storage written to ``store`` in ``PIECE``s, each pinned (the
    disk tier of either device's sessions).

    Raises:
        OSError: the store could not keep a piece (none stays pinned then).
    """
    nbytes = anchor.untyped_storage().nbytes()
    data = raw_bytes(anchor, 0, nbytes).cpu().numpy()
    pins: list[PinnedBlob] = []
    try:
        for start in range(0, nbytes, PIECE):
            piece = memoryview(data[start : start + PIECE])
            name = digest(piece)
            pin = store.keep(name, piece)
            if pin is None:
                raise OSError(f"the blob store {store.root} could not keep an evicted piece")
            pins.append(pin)
    except BaseException:
        for pin in pins:
            pin.close()
        raise
    return pins


def _paged_in(pins: list[PinnedBlob], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A new anchor on ``device`` holding the pieces ``pins`` name, checked."""
    host = torch.empty(sum(pin.size for pin in pins), dtype=torch.uint8)
    view, start = memoryview(host.numpy()), 0
    for pin in pins:
        pin.read_into(view[start : start + pin.size])
        start += pin.size
    copy = host.to(device) if device.type != "cpu" else host
    return anchor_over(copy.untyped_storage(), dtype, device)


def _moved(anchor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The anchor's whole storage copied to ``device`` (pinned when it is host memory)."""
    nbytes = anchor.untyped_storage().nbytes()
    pin = device.type == "cpu" and torch.cuda.is_available()
    copy = torch.empty(nbytes, dtype=torch.uint8, device=device, pin_memory=pin)
    copy.copy_(raw_bytes(anchor, 0, nbytes))
    return anchor_over(copy.untyped_storage(), anchor.dtype, device)
