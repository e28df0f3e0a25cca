"""The reputation explorer: a read-only web view of what a node knows.

``model`` builds the data (also behind ``cumulus-node <view> --json``), ``history``
keeps each host's score, price and free shares over time, ``app`` is the ASGI
application (pages and ``/api/``), ``serve`` runs it with Hypercorn on trio.
"""

#: Where the explorer listens unless told otherwise: this machine only.
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8787
