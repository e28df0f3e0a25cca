"""A checkpoint's manifest on the wire: which storages a session holds, as digests of pieces.

The executor answers a ``checkpoint`` query with one (``parse_manifest`` reads it on the
consumer's side); a failover's ``restore`` message names the same entries to the fresh host
(``parse_storage_entries`` reads them on the host's side). Neither side trusts the other to
send a sane one. Sans-IO.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .._errors import RemoteProtocolError
from ..blobs.names import is_digest, piece_count


@dataclass(frozen=True)
class StorageEntry:
    """One storage in a manifest: its handle, dtype, size and its pieces' digests."""

    handle: int
    dtype: torch.dtype
    nbytes: int
    digests: tuple[str, ...]


@dataclass(frozen=True)
class Manifest:
    """The executor's answer to a ``checkpoint`` query: what to read, and the RNG state."""

    device: str
    rng_state: memoryview
    storages: tuple[StorageEntry, ...]


def parse_manifest(result: Any, blobs: list[memoryview]) -> Manifest:
    """Validate a ``checkpoint`` reply. The host is not trusted to send a sane one.

    Raises:
        RemoteProtocolError: the reply is not a manifest.
    """
    if not (isinstance(result, dict) and isinstance(result.get("storages"), list)):
        raise RemoteProtocolError("checkpoint reply must be a map with a storage list")
    device = result.get("device")
    if not isinstance(device, str) or len(blobs) != 1:
        raise RemoteProtocolError("checkpoint reply needs a device name and one RNG blob")
    return Manifest(device, blobs[0], tuple(storage_entry(e) for e in result["storages"]))


def parse_storage_entries(options: Any) -> tuple[StorageEntry, ...]:
    """Validate the ``"storages": [[handle, dtype, nbytes, digests], ...]`` of a
    ``restore`` message (a manifest's, sent to a failover's fresh host).

    Raises:
        RemoteProtocolError: they are not that shape, or name a handle twice.
    """
    entries = options.get("storages") if isinstance(options, dict) else None
    if not isinstance(entries, list):
        raise RemoteProtocolError('a restore needs "storages": [[handle, dtype, nbytes, digests]]')
    parsed = tuple(storage_entry(e) for e in entries)
    if len({e.handle for e in parsed}) != len(parsed):
        raise RemoteProtocolError("a restore names a storage twice")
    return parsed


def storage_entry(entry: Any) -> StorageEntry:
    """Validate one ``[handle, dtype, nbytes, digests]`` manifest entry.

    Raises:
        RemoteProtocolError: it is not one.
    """
    ok = isinstance(entry, list) and len(entry) == 4
    if not ok or type(entry[0]) is not int or not isinstance(entry[1], torch.dtype):
        raise RemoteProtocolError(f"bad storage entry in a checkpoint reply: {entry!r}")
    handle, dtype, nbytes, digests = entry
    if type(nbytes) is not int or nbytes < 0:
        raise RemoteProtocolError(f"bad storage size in a checkpoint reply: {entry!r}")
    if not isinstance(digests, list) or len(digests) != piece_count(nbytes):
        raise RemoteProtocolError(f"storage {handle} needs one digest per piece")
    if not all(is_digest(d) for d in digests):
        raise RemoteProtocolError(f"storage {handle} has a malformed piece digest")
    return StorageEntry(handle, dtype, nbytes, tuple(digests))
