"""Where a running node's log records go: its own warnings to the console, all to a file.

A user reads the console of ``cumulus-node --consume`` as the script's output plus
Cumulus's own short lines, each marked ``cumulus:``: its warnings, and the status lines
logged to ``STATUS`` (receipts). py-libp2p's warnings about streams that failed between
other peers (``Failed to read DHT message from stream``, by the dozen) are a log file's
business, not theirs: they go to ``<data dir>/node.log`` (rotated), with everything
else. ``-v`` brings them back to the console and records debug detail in the file.

py-libp2p's ``libp2p`` logger does not propagate to the root logger (its own logging
setup turns that off) and has no handler unless ``LIBP2P_DEBUG`` is set, so Python's
last-resort handler printed its warnings bare on stderr; it gets the file handler here.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from logging.handlers import RotatingFileHandler
from pathlib import Path

LOG_FILE = "node.log"
#: The logger of the short status lines a console shows (INFO and up).
STATUS = "cumulus_p2p.status"
#: Size at which the log file is rotated, and how many old ones are kept.
MAX_BYTES = 10 * 1024 * 1024
BACKUPS = 3
_CONSOLE_FORMAT = "%(levelname)s %(name)s: %(message)s"
_SHORT_FORMAT = "cumulus: %(message)s"
_FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure(data_dir: Path, *, verbose: bool) -> Path:
    """Send this process's log records to the console and ``data_dir/node.log``.

    Without ``verbose``: the console shows ``cumulus_p2p`` warnings and ``STATUS`` lines,
    each as ``cumulus: <message>``; the file holds INFO and above from every logger
    (py-libp2p's DEBUG records on every stream would slow the node). With it: the console
    shows INFO from every logger, the file DEBUG.

    Returns:
        The log file's path.
    """
    path = data_dir / LOG_FILE
    to_file = RotatingFileHandler(path, maxBytes=MAX_BYTES, backupCount=BACKUPS, encoding="utf-8")
    to_file.setFormatter(logging.Formatter(_FILE_FORMAT))
    to_console = logging.StreamHandler()
    to_console.setFormatter(logging.Formatter(_CONSOLE_FORMAT if verbose else _SHORT_FORMAT))
    to_console.setLevel(logging.INFO)
    if not verbose:
        to_console.addFilter(_ours_worth_showing)
    root = logging.getLogger()
    root.handlers.clear()
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    root.addHandler(to_file)
    root.addHandler(to_console)
    libp2p = logging.getLogger("libp2p")
    libp2p.setLevel(logging.NOTSET)  # follow the root's level
    libp2p.handlers.clear()
    libp2p.addHandler(to_file)
    if verbose:
        libp2p.addHandler(to_console)
    return path


def _ours_worth_showing(record: logging.LogRecord) -> bool:
    """Cumulus's warnings and its status lines; nothing from other libraries."""
    if record.name == STATUS:
        return True
    return record.name.startswith("cumulus_p2p") and record.levelno >= logging.WARNING


def last_lines(path: Path, count: int) -> list[str]:
    """The last ``count`` lines of the log file at ``path`` (``[]`` if it has none yet)."""
    return tail(path, count)[0]


def tail(path: Path, count: int) -> tuple[list[str], int]:
    """The last ``count`` lines, and the byte offset they end at (where ``follow`` goes
    on from, so that a line written in between is neither lost nor shown twice)."""
    try:
        with open(path, "rb") as f:
            lines = deque(f, maxlen=count)
            end = f.tell()
    except FileNotFoundError:
        return [], 0
    return [line.decode("utf-8", errors="replace") for line in lines], end


def follow(
    path: Path,
    *,
    start: int | None = None,
    poll_s: float = 0.5,
    keep_going: Callable[[], bool] = lambda: True,
) -> Iterator[str]:
    """Lines appended to the log file at ``path`` after byte ``start`` (default: its end
    now), across its rotations, while ``keep_going()``."""
    f = _open(path, at=start)
    try:
        while keep_going():
            if f is None:
                f = _open(path, at=0)  # created since: all of it is new
            line = f.readline() if f is not None else ""
            if line:
                yield line
            elif f is not None and _rotated(path, f):
                f.close()  # read to its end: the rest is in the new file
                f = _open(path, at=0)
            else:
                time.sleep(poll_s)
    finally:
        if f is not None:
            f.close()


def _open(path: Path, *, at: int | None):
    """The file opened at byte ``at`` (None: at its end), or None if it is not there."""
    try:
        f = open(path, encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return None
    if at is None:
        f.seek(0, os.SEEK_END)
    else:
        f.seek(min(at, os.fstat(f.fileno()).st_size))
    return f


def _rotated(path: Path, f) -> bool:
    try:
        return os.stat(path).st_ino != os.fstat(f.fileno()).st_ino
    except FileNotFoundError:
        return False
