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
