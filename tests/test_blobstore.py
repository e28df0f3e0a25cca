"""A host's blob store (``blobs/store.py``) on a real directory, and the eviction plan
it follows (``blobs/names.py``): verified, atomic, capped, least recently used first,
and pinned blobs kept."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cumulus_p2p._errors import BlobMismatchError
from cumulus_p2p.blobs.names import StoredBlob, digest, is_digest, plan_eviction
from cumulus_p2p.blobs.store import BlobStore

MiB = 2**20


def blob(number: int, size: int = MiB) -> tuple[str, memoryview]:
    data = memoryview(number.to_bytes(4, "little") * (size // 4))
    return digest(data), data


def names_in(root: Path) -> set[str]:
    return {p.name for p in root.iterdir() if is_digest(p.name)}


# --- the plan (sans-IO) ----------------------------------------------------------------------


def test_the_plan_frees_what_the_incoming_blob_needs_least_recently_used_first():
    blobs = [StoredBlob("b", 4, used_ns=20), StoredBlob("a", 4, used_ns=10), StoredBlob("c", 4, 30)]
    needed, order = plan_eviction(blobs, incoming=6, cap=12)
    assert needed == 6
    assert [b.name for b in order] == ["a", "b", "c"]
    assert plan_eviction(blobs, incoming=0, cap=12)[0] == 0


def test_a_name_is_64_lower_case_hex_digits():
    assert is_digest(digest(b"x"))
    assert not is_digest(digest(b"x").upper())
    assert not is_digest("ab" * 31)
    assert not is_digest(bytes(32))


# --- the store on disk -----------------------------------------------------------------------


def test_a_blob_put_is_pinned_and_read_back_exactly(tmp_path):
    store = BlobStore(tmp_path, cap=8 * MiB)
    name, data = blob(1)
    assert store.put(name, data)
    pinned = store.pin(name)
    assert pinned is not None and pinned.size == len(data)
    out = bytearray(pinned.size)
    pinned.read_into(memoryview(out))
    pinned.close()
    assert out == data
    assert store.pin(blob(2)[0]) is None


def test_bytes_that_do_not_match_their_name_are_refused_and_nothing_is_written(tmp_path):
    store = BlobStore(tmp_path, cap=8 * MiB)
    name, _ = blob(1)
    _, other = blob(2)
    with pytest.raises(BlobMismatchError, match="does not match its hash"):
        store.put(name, other)
    assert names_in(tmp_path) == set()
    assert list((tmp_path / ".tmp").iterdir()) == []


def test_the_cap_holds_under_pressure_and_the_most_recently_used_survive(tmp_path):
    store = BlobStore(tmp_path, cap=8 * MiB)
    favourite, data = blob(0)
    store.put(favourite, data)
    written = []
    for number in range(1, 25):
        name, data = blob(number)
        assert store.put(name, data)
        written.append(name)
        store.pin(favourite).close()  # used after every write
        assert store.statistics().nbytes <= 8 * MiB
    assert names_in(tmp_path) == {favourite, *written[-7:]}


def test_only_blobs_put_as_public_and_still_held_are_public(tmp_path):
    store = BlobStore(tmp_path, cap=2 * MiB)
    (uploaded, first), (checkpoint, second) = blob(1), blob(2)
    assert store.put(uploaded, first, public=True)
    assert store.put(checkpoint, second)
    assert store.public() == {uploaded} and not store.is_public(checkpoint)
    for number in range(3, 5):  # evicts both
        assert store.put(*blob(number))
    assert store.public() == set() and not store.is_public(uploaded)


def test_a_pinned_blob_is_not_evicted(tmp_path):
    store = BlobStore(tmp_path, cap=4 * MiB)
    held_name, held_data = blob(0)
    store.put(held_name, held_data)
    held = store.pin(held_name)
    for number in range(1, 10):
        store.put(*blob(number))
    assert held_name in names_in(tmp_path)
    assert store.statistics().nbytes <= 4 * MiB
    held.close()
    for number in range(10, 15):
        store.put(*blob(number))
    assert held_name not in names_in(tmp_path)  # unpinned, it ages out like any other


def test_a_blob_that_cannot_fit_is_not_kept(tmp_path):
    store = BlobStore(tmp_path, cap=2 * MiB)
    assert not store.put(*blob(1, size=3 * MiB))
    held = store.pin(blob(2)[0]) if store.put(*blob(2)) else None
    assert held is not None
    assert store.put(*blob(3))  # fits beside the pinned one
    assert not store.put(*blob(4, size=2 * MiB))  # would need the pinned one's room
    assert names_in(tmp_path) == {blob(2)[0], blob(3)[0]}
    held.close()


def test_a_full_disk_leaves_no_blob_under_its_name_and_no_temporary_file(tmp_path):
    """A real process whose writes fail past 1 MiB (``RLIMIT_FSIZE``), as on a full disk."""
    script = textwrap.dedent(
        f"""
        import resource, signal
        from cumulus_p2p.blobs.store import BlobStore
        from cumulus_p2p.blobs.names import digest
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, ({MiB}, {MiB}))
        data = bytes(range(256)) * ({4 * MiB} // 256)
        print(BlobStore({str(tmp_path)!r}, cap={64 * MiB}).put(digest(data), memoryview(data)))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "False"
    assert names_in(tmp_path) == set()
    assert list((tmp_path / ".tmp").iterdir()) == []


def test_temporary_files_of_dead_processes_are_removed_when_a_store_opens(tmp_path):
    BlobStore(tmp_path, cap=MiB)
    pid = [sys.executable, "-c", "import os; print(os.getpid())"]
    dead = subprocess.run(pid, text=True, capture_output=True, check=True).stdout.strip()
    orphan = tmp_path / ".tmp" / f"{'ab' * 32}.{dead}.0"
    mine = tmp_path / ".tmp" / f"{'cd' * 32}.{os.getpid()}.0"
    orphan.write_bytes(b"half a blob")
    mine.write_bytes(b"being written")
    BlobStore(tmp_path, cap=MiB)
    assert not orphan.exists() and mine.exists()
