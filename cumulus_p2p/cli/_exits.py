"""How ``cumulus-node`` ends: its exit statuses, and our error out of trio's groups."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from .._errors import CumulusError

EXIT_USAGE, EXIT_CONFIG, EXIT_NO_MATCH = 2, 3, 4


@contextlib.contextmanager
def plain_errors() -> Iterator[None]:
    """Raise a lone ``CumulusError`` out of the exception groups trio's nurseries make."""
    try:
        yield
    except BaseExceptionGroup as group:
        leaves = _leaves(group)
        # Our own error first: what else failed did so while the node was shutting
        # down because of it (py-libp2p services can raise as they are torn down).
        ours = [e for e in leaves if isinstance(e, CumulusError | KeyboardInterrupt)]
        if not ours:
            raise
        for other in leaves:
            if other is not ours[0]:
                logging.getLogger("cumulus_p2p.cli").debug(
                    "also raised while stopping: %r", other, exc_info=other
                )
        raise ours[0] from None


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    found: list[BaseException] = []
    for exc in group.exceptions:
        found.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return found
