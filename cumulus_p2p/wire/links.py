"""How a job's hosts link to each other: the consumer's choice, named alike in the
records that form a group (``@pg_store``, ``@pg_join``), in the ranks' usage reports
and in status."""

from __future__ import annotations

#: TLS 1.3 tunnels keyed by the group's secret (``host/peerlinks.py``): the default.
TLS = "tls"
#: gloo's own TCP, for hosts on one network the job's owner trusts: not encrypted.
PLAIN = "plain"
PEER_LINKS = (TLS, PLAIN)
