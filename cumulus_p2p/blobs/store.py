"""A host's blob store: a size-capped, least-recently-used directory of verified blobs.

Theory of operation
-------------------
One directory holds every blob under its digest's hex name (``blobs/names.py``); it is shared by
all sessions of all executor and worker processes of a host, so every rule holds across
processes, with the file system as the only shared state:

- **Atomic writes.** A blob is written to ``.tmp/`` and renamed into place after an
  ``fsync``, so a crash, a full disk or a killed process never leaves a partial blob under
  a blob's name. Temporary files of processes that died are removed when a store opens.
- **Verified.** ``put`` hashes the bytes first and refuses (``BlobMismatchError``) bytes
  that are not what their name says; nothing is written then. ``pin`` hands out a blob
  that ``PinnedBlob.read`` checks again, so a blob damaged on disk is dropped, never used.
- **Recency** is a blob's modification time: using it (``pin``, or a ``put`` of bytes the
  store holds) sets it to now, to the nanosecond (the kernel's own stamps are as coarse as
  a clock tick, which would tie blobs written in one burst).
- **Pins** are shared ``flock`` locks on an open descriptor. Eviction takes an exclusive
  lock without waiting before it unlinks a blob, and skips a blob it cannot lock: a blob
  pinned for a session's upload stays until the session lets go of it. (A descriptor keeps
  its bytes readable even after an unlink, so a pin's reader never sees a blob vanish.)
- **The cap** holds for the blobs in place: ``put`` evicts and renames under an exclusive
  lock on ``.lock``, so two processes never both spend the same room. A blob that cannot
  fit (larger than the cap, or the rest pinned) is not kept; the upload that brought it
  still succeeds.
- **Public** blobs came from uploads of sessions that are not private: ``put(...,
  public=True)`` leaves a marker under ``.public/``, and only those are announced and
  served to other hosts (``node/blobshare.py``). A checkpoint's pieces a standby pulled
  are the consumer's state, never public. A marker whose blob was evicted is ignored.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from .._errors import BlobMismatchError
from .names import StoredBlob, digest, is_digest, plan_eviction

log = logging.getLogger(__name__)

_TMP = ".tmp"
_LOCK = ".lock"
_PUBLIC = ".public"


@dataclass(frozen=True)
class BlobStoreStatistics:
    """What a store holds now."""

    blobs: int
    nbytes: int
    cap: int


class PinnedBlob:
    """A blob held for a session: it is not evicted until ``close``."""

    def __init__(self, value: str, fd: int, size: int) -> None:
        self.digest = value
        self.size = size
        self._fd = fd

    def read_into(self, buffer: memoryview) -> None:
        """Fill ``buffer`` (exactly ``size`` bytes) with the blob, checked against its name.

        Raises:
            BlobMismatchError: the file's bytes are not the blob's (damaged on disk).
        """
        got = os.preadv(self._fd, [buffer], 0)
        if got != self.size or len(buffer) != self.size or digest(buffer) != self.digest:
            raise BlobMismatchError(f"blob {self.digest[:16]} is damaged on disk")

    def read(self) -> memoryview:
        """The blob's bytes in a buffer of their own, checked as ``read_into`` does."""
        buffer = memoryview(bytearray(self.size))
        self.read_into(buffer)
        return buffer

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # releases the shared lock
            self._fd = -1


class BlobStore:
    """The blobs under ``root``, at most ``cap`` bytes of them. Thread-safe, and safe to
    share with other processes that open the same directory.

    Args:
        root: the store's directory (created if missing). A worker whose sandbox hides the
            node's data directory gets ``/proc/self/fd/N``, a descriptor its supervisor
            opened on the directory before the sandbox closed over it.
        cap: the most bytes its blobs may take together.
    """

    def __init__(self, root: str | Path, cap: int) -> None:
        if cap < 0:
            raise ValueError("a blob store's cap must not be negative")
        self.root = Path(root)
        self.cap = cap
        (self.root / _TMP).mkdir(parents=True, exist_ok=True)
        (self.root / _PUBLIC).mkdir(exist_ok=True)
        self._names = itertools.count()
        self._lock = threading.Lock()  # this process's threads, before the file lock
        self._remove_dead_temporaries()

    # --- reading ------------------------------------------------------------------------

    def pin(self, value: str) -> PinnedBlob | None:
        """The blob named ``value``, pinned and marked used now; None if not held."""
        path = self.root / value
        fd = _open_locked(path, fcntl.LOCK_SH)
        if fd is None:  # not held, or being evicted right now
            return None
        try:
            if os.stat(path).st_ino != os.fstat(fd).st_ino:
                raise FileNotFoundError(path)  # evicted and written again meanwhile
            _touch(fd)
            return PinnedBlob(value, fd, os.fstat(fd).st_size)
        except FileNotFoundError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise

    def __contains__(self, value: str) -> bool:
        return (self.root / value).exists()

    def public(self) -> set[str]:
        """The blobs held that uploads made public (``put(..., public=True)``)."""
        with os.scandir(self.root / _PUBLIC) as entries:
            marked = {e.name for e in entries if is_digest(e.name)}
        return {name for name in marked if name in self}

    def is_public(self, value: str) -> bool:
        return (self.root / _PUBLIC / value).exists() and value in self

    def statistics(self) -> BlobStoreStatistics:
        """The blobs in place and their bytes (a read: it changes nothing)."""
        blobs = self._scan()
        return BlobStoreStatistics(len(blobs), sum(b.size for b in blobs), self.cap)

    # --- writing ------------------------------------------------------------------------

    def put(self, value: str, data: memoryview, *, public: bool = False) -> bool:
        """Check ``data`` against ``value`` and keep it under that name; ``public``: it
        came from an upload that other hosts may fetch.

        Returns:
            True when the store holds the blob afterwards; False when it did not fit (larger
            than the cap, or what would have to go is pinned) or the disk refused it (full,
            read-only: logged). The caller has the bytes either way.

        Raises:
            BlobMismatchError: ``data`` is not what ``value`` names; nothing is written.
        """
        if digest(data) != value:
            raise BlobMismatchError(
                f"a blob sent as {value[:16]} does not match its hash; nothing "
                "was stored (the bytes changed after they were named, or were damaged)"
            )
        if public:
            self._mark_public(value)
        final = self.root / value
        if final.exists():
            with contextlib.suppress(FileNotFoundError):
                _touch(final)
                return True
        if len(data) > self.cap:
            return False
        try:
            temporary = self._write_temporary(value, data)
        except OSError as exc:
            log.warning("blob store %s: could not write a blob: %s", self.root, exc)
            return False
        try:
            with self._locked():
                if not self._make_room(len(data), keep=final.name):
                    return False
                os.rename(temporary, final)
                temporary = None
                _fsync_directory(self.root)
            return True
        except OSError as exc:
            log.warning("blob store %s: could not keep a blob: %s", self.root, exc)
            return False
        finally:
            if temporary is not None:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)

    def keep(self, value: str, data: memoryview) -> PinnedBlob | None:
        """``put`` the blob, then pin it for the caller; None when the store could not
        keep it (as ``put`` returns False).

        Raises:
            BlobMismatchError: ``data`` is not what ``value`` names; nothing is written.
        """
        return self.pin(value) if self.put(value, data) else None

    def _mark_public(self, value: str) -> None:
        with contextlib.suppress(OSError):  # a marker lost costs an announcement, no more
            (self.root / _PUBLIC / value).touch()

    def _write_temporary(self, value: str, data: memoryview) -> Path:
        name = f"{value}.{os.getpid()}.{next(self._names)}"
        path = self.root / _TMP / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            view = memoryview(data).cast("B")
            while view:
                view = view[os.write(fd, view) :]
            _touch(fd)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        os.close(fd)
        return path

    def _make_room(self, incoming: int, *, keep: str) -> bool:
        """Evict least recently used, unpinned blobs until ``incoming`` fits (under the
        store lock). When it cannot fit, nothing is evicted: victims are locked first and
        unlinked only once they free enough."""
        blobs = [b for b in self._scan() if b.name != keep]
        needed, order = plan_eviction(blobs, incoming=incoming, cap=self.cap)
        victims: list[tuple[int, Path]] = []
        try:
            for blob in order:
                if needed <= 0:
                    break
                locked = self._lock_victim(self.root / blob.name)
                if locked is not None:
                    victims.append(locked)
                    needed -= blob.size
            if needed > 0:
                return False
            for _, path in victims:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            return True
        finally:
            for fd, _ in victims:
                os.close(fd)

    @staticmethod
    def _lock_victim(path: Path) -> tuple[int, Path] | None:
        """An exclusive lock on a blob nobody pins, or None (pinned, or gone already)."""
        fd = _open_locked(path, fcntl.LOCK_EX)
        return None if fd is None else (fd, path)

    # --- the directory ------------------------------------------------------------------

    def _scan(self) -> list[StoredBlob]:
        blobs = []
        with os.scandir(self.root) as entries:
            for entry in entries:
                if not is_digest(entry.name):
                    continue
                try:
                    stat = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                blobs.append(StoredBlob(entry.name, stat.st_size, stat.st_mtime_ns))
        return blobs

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock:
            fd = os.open(self.root / _LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)

    def _remove_dead_temporaries(self) -> None:
        """Temporary files of processes that are gone (a crash mid-write) are garbage."""
        with os.scandir(self.root / _TMP) as entries:
            for entry in entries:
                pid = entry.name.split(".")[1] if entry.name.count(".") == 2 else ""
                if pid.isdigit() and not _alive(int(pid)):
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)


def pin_held(store: BlobStore | None, names: Iterable[str]) -> dict[str, PinnedBlob]:
    """Pins of those of ``names`` that ``store`` holds, each once (none without a store):
    they stay in the store, never evicted, until closed (``close_pins``)."""
    pins: dict[str, PinnedBlob] = {}
    for name in names:
        pinned = None if store is None or name in pins else store.pin(name)
        if pinned is not None:
            pins[name] = pinned
    return pins


def close_pins(pins: dict[str, PinnedBlob]) -> None:
    """Let go of every pin of ``pins`` (``pin_held``'s); the dict is emptied."""
    for pinned in pins.values():
        pinned.close()
    pins.clear()


def _open_locked(path: Path, kind: int) -> int | None:
    """``path`` opened for reading and flocked (``kind``: ``fcntl.LOCK_SH`` or
    ``LOCK_EX``) without waiting; None if it is gone or another holds a lock in the way."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _touch(file: int | Path) -> None:
    now = time.time_ns()
    os.utime(file, ns=(now, now))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as exc:  # some file systems cannot sync a directory; the rename stands
        if exc.errno not in (errno.EINVAL, errno.EBADF):
            raise
    finally:
        os.close(fd)
