"""A tenant in a process of its own: trains a test model on an executor, for isolation tests.

``python -m cumulus_p2p.testing.tenant HOST:PORT TASK STEPS [--pause-after K]`` attaches,
prints ``{"worker_pid": ...}`` (from the welcome), trains ``TASK`` for ``STEPS`` steps
and prints ``{"losses": [...]}``; each a JSON line. With ``--pause-after K`` it prints
``{"paused": K}`` after step ``K`` and waits for a line on stdin before going on, so a
test can do something to another tenant meanwhile. Errors print ``{"error": "..."}``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import cumulus_p2p.remote as remote
from cumulus_p2p._errors import CumulusError
from cumulus_p2p.testing import forkstart
from cumulus_p2p.testing.models import TASKS, train


def _say(**fields) -> None:
    print(json.dumps(fields), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tenant", description=__doc__.splitlines()[0])
    parser.add_argument("address")
    parser.add_argument("task", choices=sorted(TASKS))
    parser.add_argument("steps", type=int)
    parser.add_argument("--pause-after", type=int, default=None, metavar="K")
    args = parser.parse_args(argv)

    def on_step(i: int) -> None:
        if i == args.pause_after:
            _say(paused=i)
            sys.stdin.readline()

    try:
        with remote.attach(args.address) as session:
            _say(worker_pid=session.info.get("worker_pid"))
            losses, _ = train(args.task, "cumulus", steps=args.steps, on_step=on_step)
    except CumulusError as exc:
        _say(error=f"{type(exc).__name__}: {exc}")
        return 1
    _say(losses=losses)
    return 0


class Tenant:
    """A tenant process (this module's ``main``), driven by a test line by line."""

    def __init__(self, address: str, task: str, steps: int, pause_after: int | None = None):
        cmd = [sys.executable, "-m", "cumulus_p2p.testing.tenant", address, task, str(steps)]
        if pause_after is not None:
            cmd += ["--pause-after", str(pause_after)]
        self.pause_after = pause_after
        self.proc = forkstart.popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"the tenant exited early (status {self.proc.wait()})"
        return json.loads(line)

    def wait_paused(self) -> dict:
        """Its first line (the session it got), once it paused after ``pause_after``
        steps, its memory still held."""
        hello = self.read()
        assert self.read() == {"paused": self.pause_after}
        return hello

    def go_on(self) -> None:
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()

    def finish(self) -> dict:
        """The tenant's last line (its losses), once it exited cleanly."""
        result = self.read()
        while "losses" not in result and "error" not in result:
            result = self.read()
        assert self.proc.wait(timeout=60) == 0, result
        return result


if __name__ == "__main__":
    sys.exit(main())
