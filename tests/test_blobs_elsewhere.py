"""A session's host fetching pieces from other hosts, as the consumer asks it."""

from __future__ import annotations

from cumulus_p2p._errors import CumulusError
from cumulus_p2p.blobs.elsewhere import FetchElsewhere


def test_what_the_host_fetched_is_counted_and_said():
    asked = []

    def fetch(names):
        asked.append(names)
        return {"pieces": len(names), "bytes": 16 * len(names)}

    elsewhere = FetchElsewhere(fetch)
    assert elsewhere(["a", "b"]) is True
    assert (asked, elsewhere.bytes) == ([["a", "b"]], 32)


def test_a_fetch_that_got_nothing_says_so():
    elsewhere = FetchElsewhere(lambda names: {"pieces": 0, "bytes": 0})
    assert elsewhere(["a"]) is False


def test_a_failed_fetch_turns_fetching_off_for_the_session():
    calls = []

    def fetch(names):
        calls.append(names)
        raise CumulusError("the node could not fetch")

    elsewhere = FetchElsewhere(fetch)
    assert elsewhere(["a"]) is False
    assert elsewhere(["b"]) is False
    assert calls == [["a"]] and elsewhere.bytes == 0


def test_a_private_session_never_fetches():
    assert FetchElsewhere(None)(["a"]) is False
