"""Start ``cumulus-node explore`` on a data directory, for tests and benchmarks."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_URL = re.compile(r"explorer on (http://\S+/)")


class ExplorerProcess:
    """A running explorer: its URL, and its JSON API."""

    def __init__(self, url: str) -> None:
        self.url = url

    def api(self, path: str):
        """``GET`` ``path`` (relative to the URL) and decode its JSON."""
        with urllib.request.urlopen(self.url + path, timeout=10) as response:
            return json.loads(response.read())


@contextmanager
def explorer_process(data_dir: Path) -> Iterator[ExplorerProcess]:
    """Serve ``data_dir``'s explorer on a free loopback port until the block ends."""
    command = [
        sys.executable,
        "-m",
        "cumulus_p2p.cli",
        "explore",
        "--data-dir",
        str(data_dir),
        "--explore-port",
        "0",
    ]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = next((m[1] for line in proc.stdout if (m := _URL.search(line))), None)
        if url is None:
            raise RuntimeError(f"the explorer did not start (exit {proc.wait()})")
        yield ExplorerProcess(url)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
