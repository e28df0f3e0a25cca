"""Content-addressed bytes: how a blob is named, and which blobs a full store lets go.

Theory of operation
-------------------
An upload of a CPU tensor of ``BLOB_MIN`` bytes or more travels as ``@blob`` records, one
per piece (``transfer.py``), each naming the piece's bytes by their BLAKE3 digest. Before
such records leave, the client asks the host which digests it already holds (a ``have``
message, one per batch of records, never one per tensor); the host *pins* those it holds
until the session's next ``have`` and answers; the client attaches bytes only to the
records whose digests the host lacks. The host checks every attached piece against its
digest before it uses or keeps it, so a blob is always the bytes its name says.

Each host keeps its blobs in one directory shared by all its sessions and worker
processes (``blobs/store.py``), capped in size. When a new blob does not fit, the least
recently used blobs go first (``plan_eviction``); a pinned blob stays.

Smaller tensors keep the inline path (their bytes ride in the batch): for them a digest
and a question would cost more than the bytes.

This module does no I/O and reads no clock; hashing is the only work it does.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import blake3

#: Bytes of a blob's digest (BLAKE3); its name, on the wire and on disk, is their hex.
DIGEST_SIZE = 32
#: Data this large or larger is hashed on several threads (``digest``).
THREADED_MIN = 4 * 1024 * 1024
#: CPU tensors this large or larger upload by digest; smaller ones ride inline in a batch
#: (a 1 MiB piece costs 80 ms on a 100 Mbit/s uplink; a question, one round trip).
BLOB_MIN = 1024 * 1024
#: Most digests one ``have`` may ask about (and so, blobs a session holds pinned).
MAX_HAVE = 1024
#: Bytes per named piece of a checkpointed storage: a checkpoint names each storage as the
#: digests of its pieces, so a piece unchanged since the last one is never read again.
PIECE = 16 * 1024 * 1024
#: Blob bytes queued before a batch of ``@blob`` records leaves: each such batch costs one
#: question, and the pieces whose bytes must go stay within a frame's limit.
NAMED_WINDOW = 64 * 1024 * 1024


def digest(data) -> str:
    """The name of ``data`` (any buffer): the hex of its 32-byte BLAKE3 digest.

    BLAKE3 hashes at several GB/s on one core (``hashlib.blake2b`` at about 0.6), so naming
    an upload costs far less than sending it. A piece of ``THREADED_MIN`` bytes or more is
    hashed on every core (BLAKE3 is a tree: the digest is the same), which halves a
    checkpoint's pause for naming its pieces on two cores and does better on more.
    """
    view = memoryview(data).cast("B")
    threads = blake3.blake3.AUTO if len(view) >= THREADED_MIN else 1
    return blake3.blake3(view, max_threads=threads).hexdigest()


def piece_count(nbytes: int) -> int:
    """How many ``PIECE``-sized pieces name a storage of ``nbytes`` (an empty one: none)."""
    return -(-nbytes // PIECE)


_HEX = frozenset("0123456789abcdef")


def is_digest(value: object) -> bool:
    """Whether a value (from the wire, or a file name) is a blob's name: ``2 * DIGEST_SIZE``
    lower-case hex digits."""
    return type(value) is str and len(value) == 2 * DIGEST_SIZE and _HEX.issuperset(value)


@dataclass(frozen=True)
class StoredBlob:
    """One blob in a store: its name, size, and when it was last used (any clock's
    nanoseconds; only their order matters)."""

    name: str
    size: int
    used_ns: int


def plan_eviction(
    blobs: Iterable[StoredBlob], *, incoming: int, cap: int
) -> tuple[int, list[StoredBlob]]:
    """What must go so that ``incoming`` more bytes fit under ``cap``.

    Returns:
        The bytes to free (0 when it fits already, more than the store holds when it never
        can), and every blob in the order to try them: least recently used first. The
        caller skips the pinned ones and stops once it freed enough.
    """
    order = sorted(blobs, key=lambda b: (b.used_ns, b.name))
    total = sum(b.size for b in order)
    return max(0, total + incoming - cap), order
