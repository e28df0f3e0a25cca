"""Content-addressed bytes, shared by the consumer's device, the host and the node.

- ``names``: how a blob is named (a digest per 16 MiB piece) and which blobs a full
  store lets go. Sans-IO.
- ``store``: a host's size-capped, least-recently-used directory of verified blobs.
- ``service``: blobs between hosts: a session's kept pieces served to a grant, and pulled.
- ``elsewhere``: a session's host fetching the upload pieces it lacks from other hosts,
  as the consumer asks it.
- ``standby``: the consumer's link to a standby host, which pulls each checkpoint's pieces
  from the session's host and keeps them (either device's sessions).
"""
