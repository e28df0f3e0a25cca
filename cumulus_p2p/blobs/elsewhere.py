"""A session's host fetching the upload pieces it lacks from other hosts, as the consumer
asks it (``node/blobshare.py`` does the fetching). Either device's session uses it."""

from __future__ import annotations

import logging
from collections.abc import Callable

from .._errors import CumulusError

log = logging.getLogger(__name__)


class FetchElsewhere:
    """Asks the session's host to fetch pieces from other hosts that announce them, and
    counts what it fetched. A fetch that fails turns fetching off for the session: the
    consumer sends the bytes from then on."""

    def __init__(self, fetch: Callable[[list[str]], dict] | None) -> None:
        """``fetch(digests)``: the node's ``fetch``, answering ``{"pieces", "bytes"}``;
        None: never fetch (a private session, or no node)."""
        self._fetch = fetch
        #: Bytes the host fetched from other hosts instead of the consumer's link.
        self.bytes = 0

    def __call__(self, missing: list[str]) -> bool:
        """Whether the host fetched any of ``missing``."""
        if self._fetch is None:
            return False
        try:
            fetched = self._fetch(missing)
        except (OSError, CumulusError) as exc:
            log.warning("cumulus: the host cannot fetch from other hosts (%s); uploading", exc)
            self._fetch = None
            return False
        self.bytes += fetched.get("bytes", 0)
        return fetched.get("pieces", 0) > 0
