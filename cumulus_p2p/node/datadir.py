"""The node's data directory: identity, configuration, ledger and live state.

Default ``~/.cumulus`` (``--data-dir`` or ``CUMULUS_DATA_DIR`` override it)::

    node_key       the ed25519 identity (see ``identity``), mode 0600
    config.json    optional defaults for flags, e.g. {"price": 0.5, "bootstrap": [...]}
    ledger.jsonl   countersigned receipts (see ``market.ledger``)
    state.json     what the running node knows, rewritten every second, for
                   ``cumulus-node status|peers|offers``
    node.lock      held while a node runs, so two nodes never share one directory

Nothing here is ever overwritten or deleted on error: a corrupt file is reported with
what to do, and left as it was.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._errors import IdentityFileError, LedgerCorruptError, NodeConfigError
from ..identity import NodeIdentity

if TYPE_CHECKING:
    from ..market.ledger import Ledger

CONFIG_FILE = "config.json"
STATE_FILE = "state.json"
LOCK_FILE = "node.lock"


def default_data_dir() -> Path:
    """``$CUMULUS_DATA_DIR``, else ``~/.cumulus``."""
    return Path(os.environ.get("CUMULUS_DATA_DIR") or Path.home() / ".cumulus")


class DataDir:
    """One node's data directory. Creating it makes the directory (mode 0700) if absent."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path).expanduser()
        if self.path.exists() and not self.path.is_dir():
            raise NodeConfigError(
                f"data directory {self.path} is a file, not a directory: pass another "
                f"--data-dir or move the file away"
            )
        try:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise NodeConfigError(f"cannot create data directory {self.path}: {exc}") from exc

    def identity(self) -> NodeIdentity:
        """The node key, created on first use.

        Raises:
            NodeConfigError: The key file is corrupt (it is left untouched).
        """
        try:
            return NodeIdentity.load_or_create(self.path)
        except IdentityFileError as exc:
            raise NodeConfigError(str(exc)) from exc

    def config(self) -> dict[str, Any]:
        """The optional ``config.json`` as a dict (empty when absent).

        Raises:
            NodeConfigError: The file is not a JSON object.
        """
        path = self.path / CONFIG_FILE
        if not path.exists():
            return {}
        try:
            value = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise NodeConfigError(
                f"{path} is not valid JSON ({exc}); fix it or move it away (it was left untouched)"
            ) from exc
        if not isinstance(value, dict):
            raise NodeConfigError(f"{path} must hold a JSON object of flag defaults")
        return value

    def ledger(self) -> Ledger:
        """Open the ledger.

        Raises:
            NodeConfigError: The ledger is damaged beyond a torn last line.
        """
        try:
            from ..market.ledger import Ledger  # the shim opens a data dir, never a ledger

            return Ledger.open(self.path)
        except LedgerCorruptError as exc:
            raise NodeConfigError(str(exc)) from exc

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the directory's lock for a running node.

        Raises:
            NodeConfigError: Another node already runs on this directory.
        """
        with open(self.path / LOCK_FILE, "a+") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as exc:
                raise NodeConfigError(
                    f"another cumulus-node is running on {self.path}; stop it, or give this "
                    f"one its own --data-dir"
                ) from exc
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def is_locked(self) -> bool:
        """Whether a node is running on this directory now."""
        path = self.path / LOCK_FILE
        if not path.exists():
            return False
        with open(path, "a+") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(handle, fcntl.LOCK_UN)
            return False

    def write_state(self, state: dict[str, Any]) -> None:
        """Atomically replace ``state.json`` (readers never see half a file)."""
        tmp = self.path / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, self.path / STATE_FILE)

    def read_state(self) -> dict[str, Any] | None:
        """The last state a node wrote, or ``None`` if there is none or it is unreadable."""
        try:
            value = json.loads((self.path / STATE_FILE).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return None
        return value if isinstance(value, dict) else None
