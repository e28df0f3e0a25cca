"""What a consumer's device and a host's executor say to each other (sans-IO).

Both sides of a session import this package, and it imports neither of them: the
Python device (``cumulus_p2p.remote``) and the native device (``cumulus_p2p.native``)
cannot share a process, yet both speak to the same executor.

- ``protocol``: the op-stream codec: a msgpack header and raw tensor bytes per frame.
  Every session opens with its ``hello``, and the Python device speaks it throughout.
- ``native``: the frames of a native session after its ``hello``: batches of C++ wire
  records (``cumulus_p2p/native/csrc/record.h``) and the executor's replies.
- ``ops``: which aten ops an executor runs, named the same on both sides.
- ``manifest``: a checkpoint's manifest, the executor's answer to a ``checkpoint`` query
  and what a failover's ``restore`` names.
- ``links``: how a job's hosts link to each other (TLS or plain), as every side names it.
"""
