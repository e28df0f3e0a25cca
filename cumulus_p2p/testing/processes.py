"""Whether a process is still running, read from Linux's ``/proc``, for the tests.

A zombie counts as gone: it has exited, and only its parent's ``wait`` is left. A process
may also be reaped between opening its ``stat`` file and reading it (the read then fails
with ``ProcessLookupError``): gone as well.
"""

from __future__ import annotations

import time


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            # The command name, in parentheses, may hold spaces: the state follows it.
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:  # no such file, or reaped while it was read
        return False


def gone_within(pid: int, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for process ``pid`` to exit; whether it did."""
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
