"""The node: what ``cumulus-node`` runs, composing the mesh, market, remote and reputation.

Parts:

- ``datadir``: the node's data directory (identity, configuration, ledger, live state).
- ``hardware``: what this machine can offer (NVML, or the CPU) and its self benchmark.
- ``control``: the local channel between a consumer node and the shim in its script.
- ``provider``: ``--provide``: offers, leases, the executor behind the secure channel,
  receipts.
- ``consumer``: ``--consume``: the bid, matching, the lease, the script under the shim,
  failover, receipts and cost.
- ``views``: the tables people read (status, peers, offers, ledger).
"""
