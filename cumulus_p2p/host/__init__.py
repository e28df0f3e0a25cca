"""The host's side of a session: the executor that runs consumers' op streams.

It imports neither device (``cumulus_p2p.remote``, ``cumulus_p2p.native``'s client); both
reach it through ``cumulus_p2p.wire``.

- ``executor``: the trio service. One session per consumer connection, a device context
  shared by them (``DeviceContext``), parking in the host cache (``hostcache``).
- ``session``: one session's state machine: its handle table (``handles``), quota, op
  execution, compiled graphs (``graphs``, ``graph_compiler``) and checkpoints (``kept``,
  ``restoring``).
- ``scheduler`` and ``waits``: who runs on a shared device and for how long, and how long
  each session waited. Sans-IO.
- ``supervisor``, ``worker`` and ``workerlink``: a worker process per session, handed its
  consumer's connection, and the device's health (``health``).
- ``executor_main`` is ``cumulus-executor``; ``options`` holds the flags it shares with
  ``cumulus-node --provide``.
"""
