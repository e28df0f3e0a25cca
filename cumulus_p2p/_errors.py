"""Every exception Cumulus raises, under one root.

*Ours* versus *theirs* is kept apart on purpose: a ``LocalProtocolError`` means this
node misused a protocol (a bug here), a ``RemoteProtocolError`` means the peer sent
something invalid (evidence against the peer). Reputation must punish the right party.
Each room appends its own errors in its own section below.
"""


class CumulusError(Exception):
    """Root of every Cumulus error. Catch this to catch them all."""


class ProtocolError(CumulusError):
    """A protocol was violated. Abstract: raise one of the two subclasses."""


class LocalProtocolError(ProtocolError):
    """This node tried to do something the protocol forbids. Fix the caller."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something invalid: malformed, oversized, forged or out of order.

    The connection or message is dropped; the peer may lose reputation.
    """


# --- remote: the op stream, the executor, the cumulus device ---------------------------


class FrameTooLargeError(RemoteProtocolError):
    """A frame announced a length above the negotiated limit. The connection is closed."""


class BlobMismatchError(RemoteProtocolError):
    """Bytes sent under a blob's digest are not the bytes that digest names (a consumer's
    bug, bytes changed after they were named, a damaged transfer or a forgery), or a stored
    blob was damaged on disk. Nothing is stored; the session's op fails with this kind."""


class RemoteExecutionError(CumulusError):
    """An op failed on the executor. Raised in the client at the next sync point.

    ``remote_type`` names the executor's exception type, ``op`` the aten op that failed.
    The session stays usable: later ops that do not depend on the failed result run.
    """

    def __init__(self, message: str, *, remote_type: str = "", op: str = "") -> None:
        super().__init__(message)
        self.remote_type = remote_type
        self.op = op


class SessionClosedError(CumulusError):
    """The remote session is gone (closed, dropped or never attached). Attach a new one."""


class HostSilentError(SessionClosedError):
    """The host sent nothing, not even a keepalive, for longer than the consumer waits
    while an answer is due: it hangs (a stopped process, a frozen machine) though its
    kernel still holds the connection open. The session is given up, as if the host died."""


# --- market and signed messages --------------------------------------------------------


class IdentityFileError(CumulusError):
    """The node key file exists but is not a valid key.

    The file is never overwritten. Restore it from a backup, or move it away to start
    over with a new identity (a new peer ID, and no reputation).
    """


class InvalidMessageError(LocalProtocolError):
    """This node tried to build a message or envelope with an invalid field value.

    Raised by the constructors of the typed messages, so an invalid message cannot exist.
    Fix the caller; the message names the field.
    """


class MalformedMessageError(RemoteProtocolError):
    """Bytes from a peer did not decode into a valid message: bad msgpack, wrong shape,
    wrong types, out-of-range values, or a non-canonical encoding. Drop the message.
    """


class EnvelopeRejectedError(RemoteProtocolError):
    """A signed envelope from a peer failed validation.

    ``reason`` is a ``cumulus_p2p.envelope.Rejection`` (bad signature, expired, replayed,
    ...) and ``detail`` a sentence for logs. Drop the message; ``reason`` tells whether
    the sender is at fault.
    """

    def __init__(self, reason: object, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class LeaseRefusedError(CumulusError):
    """The host refused a lease proposal.

    ``reason`` is a ``cumulus_p2p.market.RefusalReason`` (no capacity, expired, price
    mismatch, ...). Try another offer, or re-propose after fixing what ``reason`` names.
    """

    def __init__(self, reason: object, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class InvalidCountersignatureError(RemoteProtocolError):
    """A peer's countersignature on a lease or receipt does not verify, or does not
    match the document it claims to sign. Treat the document as unsigned.
    """


class LivenessProofError(RemoteProtocolError):
    """A host's answer to a liveness probe was refused: malformed, signed by another
    key than the host's, for another prober or challenge (replayed), or expired.

    ``reason`` is a ``cumulus_p2p.market.liveness.ProofRefusal`` and ``detail`` a
    sentence for logs. The host counts as not having answered: it is set aside like a
    host that ignores probes.
    """

    def __init__(self, reason: object, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class ReceiptRejectedError(RemoteProtocolError):
    """A usage receipt from a host is inconsistent with its lease (wrong lease, interval
    outside the lease, more share-seconds than leased). Do not countersign it.
    """


class LedgerCorruptError(CumulusError):
    """The ledger file is damaged somewhere other than its last, unacknowledged line.

    Nothing was changed. Restore the file from a backup or inspect the named line.
    """


# --- mesh ---


class MeshError(CumulusError):
    """The mesh (libp2p host, DHT, gossip) could not do what was asked.

    Raised by ``cumulus_p2p.dht``; the subclasses say what went wrong.
    """


class PeerUnreachableError(MeshError):
    """No connection could be made to a peer, directly or through a relay.

    Check the address, or reach the peer through a relay it holds a reservation on.
    """


class AnnouncementError(MeshError, LocalProtocolError):
    """This node tried to announce something the mesh cannot carry: too many offers,
    a sheet over the envelope size limit, or a kind its own validator refuses.
    Announce fewer or smaller offers, or add the kind to the validator.
    """


class InvalidRecordError(RemoteProtocolError):
    """A ``/cumulus/`` DHT record from a peer failed validation: a bad key, a bad or
    expired envelope, or an offer not authored by the key's owner. The record is
    neither stored nor used.
    """


# --- secure channel -------------------------------------------------------------------


class HandshakeError(RemoteProtocolError):
    """The peer's secure-channel handshake was malformed, truncated, oversized or too slow.

    The connection is closed; a provider keeps serving everyone else. The message says
    which rule was broken.
    """


class PeerAuthenticationError(HandshakeError):
    """The peer failed to prove the identity it had to have.

    On the consumer: the provider is not the expected key, or its transcript signature or
    resumption MAC is wrong (an impostor or a man in the middle). On the provider: the
    consumer's signature does not match the key it claimed. Do not retry blindly.
    """


class SessionRefusedError(CumulusError):
    """The provider refused the session; ``reason`` is the provider's explanation.

    Typical reasons: no valid lease, not on the private pool's allow list, or (on a
    resumption) the session already expired. Obtain a lease, or open a new session.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(f"provider refused the session: {reason}")
        self.reason = reason


class RecordAuthenticationError(RemoteProtocolError):
    """An encrypted record failed authentication: tampered, replayed, reordered or forged.

    The connection is dropped; the session may resume on a new connection.
    """


# --- reputation -----------------------------------------------------------------------


class InvalidEvidenceError(RemoteProtocolError):
    """A reputation report's evidence does not check: a lease or receipt signature does
    not verify, the parts do not belong together (a receipt for another lease, an offer
    the lease never named), or the reporter is not a party entitled to report it.

    The report is dropped and nothing is stored; the message says which check failed.
    """


class ReportRejectedError(RemoteProtocolError):
    """A reputation report from a peer was refused.

    ``reason`` is a ``cumulus_p2p.reputation.ReportRefusal`` and ``detail`` a sentence
    for logs. Nothing was stored; drop the report.
    """

    def __init__(self, reason: object, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


# --- the node (cumulus-node) ----------------------------------------------------------


class NodeConfigError(CumulusError):
    """The node cannot start as configured: a bad flag value, a corrupt or busy data
    directory, an unreachable bootstrap peer. The message says what to do."""


class NoMatchError(CumulusError):
    """No offer on the mesh met the bid before the wait ended."""


# --- failover (remote) ---------------------------------------------------------------


class FailoverError(SessionClosedError):
    """The session's host was lost and no replacement could take the session over.

    Raised after ``failover_attempts`` tries (``reconnect`` failed, or each new host failed
    during the restore). The session is closed; its remote tensors are gone. The cause of
    the last attempt is chained. Attach a new session and restart from your own checkpoint.
    """


class StandbyFullError(CumulusError):
    """A standby was asked to keep more checkpoint bytes than its lease lends it.

    Attributes:
        needed_bytes: What the checkpoint would have it keep.
    """

    def __init__(self, message: str, *, needed_bytes: int) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes


class CheckpointCorruptError(CumulusError):
    """A stored checkpoint file is truncated or not a checkpoint.

    Failover cannot restore from it; the session falls back to the next attempt and fails
    with ``FailoverError`` if none works. Delete the file; the next checkpoint rewrites it.
    """
