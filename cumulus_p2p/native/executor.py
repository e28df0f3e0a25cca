"""The executor side of the native device: one session's replay loop, loaded from C++.

``Replayer(device, quota_bytes)`` (``csrc/replay.cpp``) holds a session's storages,
its op name table and its resolved operator handles; ``replay(batch, new_names)`` runs
one batch of wire records and returns the readbacks' bytes, raising ``ReplayError``
(``errors.py``) for a record that cannot run. Unlike the device library, the replay
library registers nothing with the dispatcher, so any process may load it: the host's
executor (``cumulus_p2p.host.executor``) serves native sessions with it beside the
Python device's, a ``ReplaySession`` each. A session's checkpoint can stay on the host
side: KEEP copies its pieces for a standby host to pull (``kept``), and a failover's fresh
host makes the storages and fills them from the standby (``open_restore``; the executor
does the pulling). Like a Python session, a native one can leave the device between two
batches (``evict``: to host memory, or to the blob store on disk), so an overcommitted
host pages it as it pages the others. Its storages come back one by one as a batch names
them (the loop calls back for each, ``_fault``), or all at once (``bring_back``).
Compiled graphs (GRAPH and RUN records): ``ReplaySession`` validates each definition as
a Python session's (``host/graphs.py``) and hands the prepared program to the loop
(``csrc/program.h``), whose calls then run without Python; a graph the host compiles
(``--graph-compiler inductor``) is run by Python, the loop calling back for it.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import msgpack
import torch

from .._errors import BlobMismatchError, MalformedMessageError, RemoteProtocolError
from ..blobs.names import PIECE, digest, is_digest
from ..blobs.store import BlobStore, PinnedBlob, close_pins, pin_held
from ..host.eviction import Tier, enough
from ..host.graph_compiler import GraphRunner
from ..host.graphs import GraphError, GraphProgram, NodeFailed, define
from ..host.handles import unpin, write_pieces
from ..host.kept import KeptPieces
from ..host.restoring import PieceTargets
from ..host.scheduler import DEFAULT_RANK
from ..host.session import SessionStats
from ..host.waits import WaitWindow
from ..wire import native as wire
from ..wire.graph_def import unpack_definition
from ..wire.manifest import StorageEntry
from ..wire.protocol import GraphValue
from . import named, records
from .errors import ReplayError as ReplayError

log = logging.getLogger(__name__)

#: The most bytes of a HAVE request: some thousands of digests.
MAX_HAVE_BYTES = 1 << 20
#: Per-session memory quota when none is given: as the Python executor's default.
DEFAULT_QUOTA = 8 * 1024**3

_LIBRARY: ModuleType | None = None
#: Requests that touch no storage: they do not bring an evicted session back.
STORAGELESS = frozenset({wire.BYE, wire.HAVE, wire.RESEND})


def library(verbose: bool = False) -> ModuleType:
    """Build (if sources changed) and load the replay library, once per process."""
    global _LIBRARY
    if _LIBRARY is None:
        from ._build import build_replay

        _LIBRARY = build_replay(verbose=verbose)
    return _LIBRARY


def new_replayer(device: str = "cpu", quota_bytes: int = DEFAULT_QUOTA):
    """A session's replay loop on ``device`` (``"cpu"``, ``"cuda"``...), its live storages
    capped at ``quota_bytes``."""
    return library().Replayer(device, quota_bytes)


@dataclass
class _Away:
    """One storage off its device: its copy in host memory, or its pieces on disk
    (pinned in the blob store)."""

    nbytes: int
    copy: torch.Tensor | None = None
    pins: list[PinnedBlob] = field(default_factory=list)

    def close(self) -> None:
        for pin in self.pins:
            pin.close()
        self.pins.clear()
        self.copy = None


class ReplaySession:
    """One native session on its executor: its replay loop and its first failure.

    A failed record ends the session's usefulness (``wire.native`` says why): later
    batches do not run, and every later reply repeats the failure. The caller owns the
    I/O: it hands each request frame to ``run`` (a thread may: ``run`` holds the GIL
    only to parse) and sends back what ``run`` returns.
    """

    def __init__(
        self, replayer, store: BlobStore | None = None, graphs: GraphRunner | None = None
    ) -> None:
        """``store``: the host's blob store, where NAMED requests' pieces are read and
        their large uploads kept (None: named uploads are refused, none are kept).
        ``graphs``: the executor's runner of compiled graphs (a plain one by default)."""
        self._replayer = replayer
        self._store = store
        self._runner = graphs or GraphRunner()
        self._device = torch.device(replayer.device)
        self._graphs: dict[int, tuple[bytes, GraphProgram]] = {}  # id -> (key, program)
        # Weakly: the loop's callbacks must not keep the session (and its storages) alive.
        replayer.set_graphs(_weakly(self._define_graph), _weakly(self._run_graph))
        #: Graph calls that ran code compiled for the device (``graph_compiler.py``).
        self.compiled_graph_runs = 0
        #: The pieces the last HAVE found, pinned until the next (the NAMED that follows
        #: it must find them).
        self._pins: dict[str, PinnedBlob] = {}
        self.failure: ReplayError | None = None
        self.batches = 0
        #: BATCH requests received, run or not: a resumed client resends those after.
        self.received = 0
        #: The reply to the last BATCH that asked for one (RESEND sends it again).
        self._last_reply: list[bytes] | None = None
        #: Its waits for device turns (``waits.py``), as status shows them.
        self.waits = WaitWindow()
        #: Checkpoint pieces kept for a standby to pull (KEEP), under the session's grant.
        self.kept = KeptPieces()
        #: Where its storages are (``evict``), and what the eviction policy weighs: its
        #: lease's rank and when a batch last ran.
        self.tier = Tier.DEVICE
        self._away: dict[int, _Away] = {}  # its storages off the device, by handle
        self._moving = threading.RLock()  # one move between tiers at a time
        replayer.set_fault(_weakly(self._fault))
        self.rank: tuple = DEFAULT_RANK
        self.last_op_at = time.monotonic()
        self.evictions = 0

    def run(self, frame: bytes | bytearray) -> tuple[bool, list[bytes] | None]:
        """Run one request: (whether the session goes on, the reply's parts or None when
        the client asked for none).

        Raises:
            MalformedMessageError: the frame is not a request; the session cannot go on.
        """
        kind, reply, names, batch = wire.parse_request(frame)
        if kind == wire.BYE:
            return False, None
        if kind == wire.RESTORE:  # it pulls from other hosts: the executor's I/O
            raise MalformedMessageError("a restore is the executor's to run, not run's")
        if kind == wire.RESEND:
            if self._last_reply is None:
                raise MalformedMessageError("RESEND, but no batch asked for a reply")
            return True, self._last_reply
        if kind == wire.HAVE:
            return True, wire.ok([msgpack.packb(self._have(batch))])
        if kind in wire.BATCHES:
            self.received += 1
            self._last_reply = None
            self.last_op_at = time.monotonic()
        if kind not in wire.BATCHES:  # a checkpoint names every storage: all come back
            try:
                self.bring_back()
            except BlobMismatchError as exc:
                self.failure = ReplayError(str(exc), -1, "evicted")
        readbacks = self._answer(kind, names, batch) if self.failure is None else []
        if not reply:
            return True, None
        if self.failure is not None:
            answer = wire.failed(self.failure.record, self.failure.kind, str(self.failure))
        else:
            answer = wire.ok(readbacks)
        if kind in wire.BATCHES:
            self._last_reply = answer
        return True, answer

    def runs_inline(self, frame: bytes | bytearray) -> bool:
        """Whether the executor may run this request on its event loop: a light one
        (``wire.native.runs_inline``) of a session on its device, that calls no compiled
        graph (a whole step's compute in one record)."""
        if not wire.runs_inline(frame) or self.tier is not Tier.DEVICE:
            return False
        try:
            kind, _, _, batch = wire.parse_request(frame)
        except MalformedMessageError:
            return True  # refused at once by ``run``
        return kind != wire.BATCH or not library().calls_graph(batch)

    def _answer(self, kind: int, names: list[str], batch: memoryview) -> list[bytes]:
        """Run a BATCH or NAMED (its readbacks), or name the storages (DIGESTS, KEEP)."""
        if kind in (wire.DIGESTS, wire.KEEP):
            return [self._manifest(keep=kind == wire.KEEP)]
        data = named.resolve(batch, self._piece, self._keep) if kind == wire.NAMED else batch
        try:
            readbacks = self._replayer.replay(bytes(data), names)
        except ReplayError as exc:
            self.failure = exc
            return []
        finally:
            self._forget_freed()
        self.batches += 1
        return readbacks

    # --- compiled graphs (called by the replay loop, ``csrc/replay.cpp``) ---------------

    def _define_graph(self, graph: int, definition: bytes) -> None:
        """A GRAPH record: validate the definition and keep it. The same one again is
        fine (a session that moves sends its graphs to the new host again).

        Raises:
            ReplayError: (invalid_graph) the definition breaks a rule, or the session
                has its most graphs.
        """
        try:
            program = define(self._graphs, graph, unpack_definition(definition), self._device)
        except RemoteProtocolError as exc:
            raise _graph_error(f"graph {graph}: {exc}") from None
        except GraphError as exc:
            raise _graph_error(str(exc)) from None
        if not self._runner.compiles(program) and not program.writes:
            try:
                self._replayer.set_program(graph, *_native_program(program))
            except ValueError:  # a constant the loop cannot type: Python runs this one
                log.warning("graph %d runs in Python", graph, exc_info=True)

    def _run_graph(
        self, graph: int, inputs: list[torch.Tensor | None], budget: int
    ) -> list[torch.Tensor | None]:
        """A RUN record: graph ``graph`` on ``inputs``, its intermediates within
        ``budget`` bytes; its outputs, which the loop binds to the client's handles.

        Raises:
            ReplayError: invalid_graph (no such graph, a missing input), out_of_memory,
                or op_failed naming the node that raised.
        """
        known = self._graphs.get(graph)
        if known is None:
            raise _graph_error(f"no graph {graph} in this session (a GRAPH record defines it)")
        key, program = known
        tensors = [t for t in inputs if t is not None]
        if len(tensors) != len(inputs):
            raise _graph_error(f"graph {graph} was called without one of its inputs")
        if program.factory_bytes > budget:
            why = f"graph {graph} allocates {program.factory_bytes} bytes; {budget} are free"
            raise ReplayError(why, -1, "out_of_memory")
        try:
            results, compiled = self._runner.run(key, program, tensors, budget)
        except GraphError as exc:
            raise _graph_error(f"graph {graph}: {exc}") from None
        except NodeFailed as exc:
            out_of_memory = isinstance(exc.error, torch.OutOfMemoryError)
            where = f"{exc.op} (node {exc.index} of compiled graph {graph})"
            kind = "out_of_memory" if out_of_memory else "op_failed"
            raise ReplayError(f"{where}: {exc.error}", -1, kind) from None
        self.compiled_graph_runs += compiled
        return results

    def _manifest(self, keep: bool) -> bytes:
        """Every live storage's pieces, named: the DIGESTS answer a checkpoint reads. With
        ``keep``, the pieces are copied into ``kept`` too (those unchanged since the last
        KEEP are not copied again)."""
        entries, kept = [], []
        for handle in self._replayer.handles():
            # A GPU's storage comes to the host once; a CPU's is hashed where it lies.
            data = memoryview(self._replayer.storage_view(handle).cpu().numpy())
            spans = [data[at : at + PIECE] for at in range(0, len(data), PIECE)]
            names = [digest(span) for span in spans]
            entries.append((handle, len(data), names))
            kept += zip(names, spans, strict=True)
        if keep:
            self.kept.snapshot(kept)
        return wire.encode_manifest(entries)

    def open_restore(self, entries: Sequence[tuple[int, int, Sequence[str]]]) -> PieceTargets:
        """Make a RESTORE's storages, empty, and say where each of their pieces goes.

        Raises:
            ReplayError: a storage could not be made (over the quota, a handle in use);
                none of the restore's is left.
        """
        before = set(self._replayer.handles())
        allocs = [records.Alloc(handle, nbytes) for handle, nbytes, _ in entries]
        try:
            self._replayer.replay(records.encode(allocs, []), [])
        except ReplayError:
            self.drop(set(self._replayer.handles()) - before)
            raise
        anchors = {handle: self._replayer.storage_view(handle) for handle, _, _ in entries}
        storages = tuple(StorageEntry(h, torch.uint8, n, tuple(d)) for h, n, d in entries)
        return PieceTargets(storages, anchors)

    def drop(self, handles: Iterable[int]) -> None:
        """Free ``handles``' storages (a restore that could not be filled)."""
        frees = [records.Free(handle) for handle in handles]
        if frees:
            self._replayer.replay(records.encode(frees, []), [])

    def _have(self, batch: memoryview) -> list[bool]:
        """Which pieces of a HAVE request the host's store holds; those stay pinned."""
        wanted = msgpack.unpackb(batch) if len(batch) <= MAX_HAVE_BYTES else None
        if not isinstance(wanted, list) or not all(is_digest(n) for n in wanted):
            raise MalformedMessageError("HAVE takes a msgpack list of digests")
        close_pins(self._pins)
        self._pins = pin_held(self._store, wanted)
        return [name in self._pins for name in wanted]

    def _piece(self, name: str) -> memoryview | None:
        pinned = self._pins.get(name)
        return None if pinned is None else pinned.read()

    def _keep(self, name: str, data: memoryview) -> None:
        # Public, as a Python session's uploads are: other hosts may fetch it from here.
        if self._store is not None and name not in self._pins:
            self._store.put(name, data, public=True)

    # --- tiers (``host/eviction.py``) ----------------------------------------------------

    def evict(self, tier: Tier, need: int | None = None) -> int:
        """Move the session's storages off the device between two batches: copied to the
        host's memory (``RAM``) or written to the blob store as named pieces, pinned
        (``DISK``); then their device memory is let go. All of them, or with ``need``,
        storage by storage, those no batch named for longest until ``need`` bytes are
        off. Storages in host memory already go on to disk with the rest when ``tier``
        is the disk (a demotion: from host memory, not through the device). (On a CPU,
        host memory is the device's: to ``RAM`` nothing moves, and the session counts as
        off the device whole.) Handles, the op table, the graphs and the generator stay,
        and every storage still counts against the quota. Returns the bytes moved.

        Raises:
            ValueError: ``tier`` is the device, or the disk tier without a blob store.
            OSError: the blob store could not keep a piece (nothing moved then).
        """
        if tier is Tier.DEVICE:
            raise ValueError("the device is not a tier to evict to")
        if tier is Tier.DISK and self._store is None:
            raise ValueError("this executor has no blob store (--blob-dir) to evict to disk")
        with self._moving:
            if tier is Tier.RAM and self.tier is Tier.DISK:
                self.bring_back()  # off the device, its storages are in one tier at a time
            moved = self._demote() if tier is Tier.DISK else 0
            if tier is Tier.RAM and self._replayer.device == "cpu":
                self.tier = tier
                self.evictions += 1
                return self._replayer.live_bytes
            handles = self._chosen(need)
            away = self._written(handles) if tier is Tier.DISK else self._copied(handles)
            self._replayer.set_aside(handles)
            self._away.update(away)
            self.tier = tier if self._away else Tier.DEVICE
            self.evictions += 1 if handles else 0
            return moved + sum(a.nbytes for a in away.values())

    def _demote(self) -> int:
        """Write the storages in host memory to disk; returns their bytes."""
        if self.tier is Tier.RAM and self._replayer.device == "cpu":
            self.tier = Tier.DEVICE  # its "host memory" is the device: written from there
        copies = {h: a for h, a in self._away.items() if a.copy is not None}
        written: dict[int, list[PinnedBlob]] = {}
        try:
            for handle, away in copies.items():
                written[handle] = write_pieces(away.copy, self._store)
        except BaseException:
            unpin(written)
            raise
        for handle, pins in written.items():
            self._away[handle] = _Away(copies[handle].nbytes, pins=pins)
        return sum(a.nbytes for a in copies.values())

    def _chosen(self, need: int | None) -> list[int]:
        """The storages to move: all, or the longest unused until ``need`` bytes."""
        coldest = self._replayer.coldest()
        return enough(((h, self._replayer.storage_view(h).numel()) for h in coldest), need)

    def _written(self, handles: list[int]) -> dict[int, _Away]:
        away: dict[int, _Away] = {}
        try:
            for handle in handles:
                view = self._replayer.storage_view(handle)
                away[handle] = _Away(view.numel(), pins=write_pieces(view, self._store))
        except BaseException:
            for each in away.values():
                each.close()
            raise
        return away

    def _copied(self, handles: list[int]) -> dict[int, _Away]:
        away = {}
        for handle in handles:
            view = self._replayer.storage_view(handle)
            copy = torch.empty(view.numel(), dtype=torch.uint8, pin_memory=True)
            away[handle] = _Away(view.numel(), copy=copy.copy_(view))
        return away

    def _fault(self, handle: int) -> torch.Tensor:
        """A batch named ``handle``, which is off the device: its bytes, checked when
        read from disk (called by the replay loop, which makes the storage again).

        Raises:
            ReplayError: (evicted) a piece on disk was damaged or lost.
        """
        with self._moving:  # the tier is set after: ``_forget_freed`` or ``bring_back``
            away = self._away.pop(handle)
            try:
                return away.copy if away.copy is not None else self._read(handle, away)
            finally:
                away.close()

    def _read(self, handle: int, away: _Away) -> torch.Tensor:
        data = torch.empty(away.nbytes, dtype=torch.uint8)
        entry = StorageEntry(handle, torch.uint8, away.nbytes, tuple(p.digest for p in away.pins))
        targets = PieceTargets((entry,), {handle: data})
        targets.fill_from(self._store)
        if targets.missing():
            raise ReplayError(
                f"this session's memory evicted to disk is damaged ({len(targets.missing())} "
                "pieces unreadable); it cannot run on",
                -1,
                "evicted",
            )
        return data

    def _forget_freed(self) -> None:
        """After a batch: let go of the copies and pins of storages it freed while off
        the device; with none left off it, the session is on its device again."""
        with self._moving:
            if self._away:
                for handle in set(self._away) - set(self._replayer.away()):
                    self._away.pop(handle).close()
            if not self._away:
                self.tier = Tier.DEVICE

    def bring_back(self) -> None:
        """Put all of an evicted session's storages back on its device (nothing if they
        are), ahead of the batches that would bring them back one by one.

        Raises:
            BlobMismatchError: a piece on disk was damaged or lost; the session's storages
                off the device are let go, and it can no longer run (``run`` says so in
                every reply).
        """
        with self._moving:
            try:
                for handle in list(self._away):
                    self._replayer.put_back(handle, self._fault(handle))
            except ReplayError as exc:
                self.drop(self._replayer.away())
                self._forget_freed()
                raise BlobMismatchError(str(exc)) from None
            self.tier = Tier.DEVICE

    @property
    def bytes_on_device(self) -> int:
        """What the session's storages hold on the device: all but the evicted ones
        (none, for a CPU session evicted to host memory, which is its device's)."""
        if self.tier is Tier.RAM and self._replayer.device == "cpu":
            return 0
        return self._replayer.live_bytes

    def park(self, tier: Tier = Tier.RAM) -> int:
        """Set the session aside while its client is away, off the device (``evict``).
        Returns the bytes it holds in host memory (none on disk).

        Raises:
            OSError: the disk tier could not keep the pieces (it stays as it was).
        """
        if self.tier is not tier or self.bytes_on_device:
            self.evict(tier)  # whole, and all on one tier (from host memory to disk too)
        return 0 if self.tier is Tier.DISK else self.stats.bytes_in_use

    def unpark(self) -> None:
        """Bring a parked session's storages back to its device."""
        self.bring_back()

    @property
    def quota_bytes(self) -> int:
        """The most bytes the session's storages may hold."""
        return self._replayer.quota_bytes

    @property
    def live_bytes(self) -> int:
        """Bytes of the session's live storages."""
        return self._replayer.live_bytes

    @property
    def stats(self) -> SessionStats:
        """Its ops run and memory in use, as a Python session's ``stats`` (a copy)."""
        replayer = self._replayer
        live = replayer.live_bytes + replayer.away_bytes
        return SessionStats(
            ops=replayer.ops_run,
            bytes_in_use=live,
            peak_bytes=live,
            compiled_graph_runs=self.compiled_graph_runs,
        )

    def close(self) -> None:
        """Let go of the pieces kept for a standby, the pins, and the storages."""
        self.kept.close()
        close_pins(self._pins)
        for away in self._away.values():
            away.close()
        self._away.clear()
        self._graphs.clear()
        self._replayer = None


def _native_program(program: GraphProgram) -> tuple[list, list, int, int]:
    """``program`` as the loop's ``set_program`` takes it (``csrc/program.h``): a slot
    per schema argument of each node.

    Raises:
        ReplayError: (invalid_graph) a node's arguments do not fit its op's schema.
    """
    nodes = []
    for node in program.nodes:
        schema = node.op._schema
        positional = [a for a in schema.arguments if not a.kwarg_only]
        names = {a.name for a in schema.arguments}
        if len(node.args) > len(positional) or not set(node.kwargs) <= names:
            raise _graph_error(f"{node.name}: arguments that are not its schema's")
        slots = []
        for position, argument in enumerate(schema.arguments):
            if not argument.kwarg_only and position < len(node.args):
                slots.append(_slot(node.args[position]))
            elif argument.name in node.kwargs:
                slots.append(_slot(node.kwargs[argument.name]))
            elif argument.has_default_value():
                slots.append((3,))
            else:
                raise _graph_error(f"{node.name}: no value for its {argument.name} argument")
        nodes.append((schema.name, schema.overload_name, slots, node.fresh, list(node.release)))
    outputs = [None if ref is None else _reference(ref) for ref in program.outputs]
    return nodes, outputs, program.n_inputs, program.factory_bytes


def _slot(value: Any) -> tuple:
    if type(value) is GraphValue:
        return (1, *_reference(value))
    if type(value) is tuple:
        if _holds_reference(value):
            return (2, [_slot(v) for v in value])
        return (0, _as_lists(value))
    return (0, value)


def _reference(ref: GraphValue) -> tuple[bool, int, int]:
    return ref.kind == GraphValue.INPUT, ref.index, ref.item


def _holds_reference(value: tuple) -> bool:
    return any(type(v) is GraphValue or (type(v) is tuple and _holds_reference(v)) for v in value)


def _as_lists(value: Any) -> Any:
    return [_as_lists(v) for v in value] if type(value) is tuple else value


def _graph_error(message: str) -> ReplayError:
    return ReplayError(message, -1, "invalid_graph")


def _weakly(method: Callable) -> Callable:
    """``method``, called through a weak reference to its object."""
    ref = weakref.WeakMethod(method)  # type: ignore[arg-type]

    def call(*args: Any) -> Any:
        bound = ref()
        if bound is None:
            raise ReplayError("the session is closed", -1, "op_failed")
        return bound(*args)

    return call
