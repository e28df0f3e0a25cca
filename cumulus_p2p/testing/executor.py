"""Start a real executor process on loopback for tests and benchmarks."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

_LISTENING = re.compile(r"listening on ([0-9.]+):(\d+)")
_KEY = re.compile(r"key=([0-9a-f]{64})")


@contextmanager
def executor_process(
    *, device: str = "cpu", quota: str = "8GiB", extra: list[str] | None = None
) -> Iterator[tuple[str, subprocess.Popen]]:
    """Run ``cumulus-executor`` on 127.0.0.1, yield ``("127.0.0.1:PORT", process)``.

    The process is terminated (then killed) on exit, whatever happened inside.
    """
    cmd = [sys.executable, "-m", "cumulus_p2p.remote.executor_main", "--host", "127.0.0.1"]
    cmd += ["--port", "0", "--device", device, "--quota", quota, *(extra or [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        match = _LISTENING.search(line)
        if match is None:
            err = proc.stderr.read() if proc.poll() is not None else ""
            raise RuntimeError(f"executor did not start: {line!r} {err}")
        key = _KEY.search(line)
        proc.provider_key = bytes.fromhex(key.group(1)) if key else None
        yield f"{match.group(1)}:{match.group(2)}", proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
