"""A process's resident memory and its peak, from ``/proc`` (Linux), for tests that bound
what a transfer holds in memory."""

from __future__ import annotations

from pathlib import Path


def _status(pid: int | str, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def rss(pid: int | str = "self") -> int:
    """Bytes resident now."""
    return _status(pid, "VmRSS")


def peak_since_reset(pid: int | str = "self") -> int:
    """The most bytes resident since the last ``reset_peak``."""
    return _status(pid, "VmHWM")


def reset_peak(pid: int | str = "self") -> int:
    """Make the process's peak RSS its current RSS (``clear_refs``); returns it."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return rss(pid)
