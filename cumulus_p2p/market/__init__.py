"""The market: offers, bids, the order book, leases, metering and the ledger.

Parts, lowest first (each imports only those above it):

- ``messages``: the typed wire messages (``Offer``, ``Bid``, ``Cancel``,
  ``LeaseProposal``, ``Receipt``), their canonical msgpack encoding, and
  ``seal_message``/``open_message`` to carry them in signed envelopes. ``Lease`` and
  ``CountersignedReceipt`` add the other party's countersignature.
- ``pricing``: what a compute lease pays (sans-IO): at least the ask, or for a
  contending lease the offer's contend price, one price for all its contending tenants.
- ``book``: the order book (sans-IO): price-time priority per resource class,
  partial fills, cancels, expiry, amendment by newer nonce, deterministic matching.
- ``admission``: who gets a host's free shares (sans-IO): the best bid waiting for them
  in the host's book first, not the first proposal to arrive.
- ``clearing``: what GPUs cost now (sans-IO): per GPU model the ask, the contending
  floor, and what recent leases cleared at, from accepted service records.
- ``intake``: received bytes -> envelope validator -> ``open_message`` -> book.
- ``matcher``: the consumer's ranking of offers by effective price (reliability and
  latency are inputs).
- ``hostchoice``: the consumer's choice of host after failures (sans-IO): failure is
  evidence with a half-life, a failed host is set aside for a backoff and tried again
  once it announces afresh; a job with no usable host waits, within its patience.
- ``liveness``: the cost of entry (sans-IO): a host with no record counts for matching
  once it has signed a fresh challenge with its offer's key (``Liveness``, a transition
  table per host, ``answer_probe`` on the host's side); a host that answers nothing is
  set aside for a backoff that doubles with each miss.
- ``standby``: the consumer's choice of a standby host, the second host that keeps a
  session's checkpoints on its disk (``choose_standby``), and its ``LeaseKind.STANDBY``
  proposal (``standby_proposal``), priced per GiB-hour (sans-IO).
- ``lease``: the host's reservation core (sans-IO): reserve shares (or, for a standby,
  GiB) atomically and countersign, or refuse with a ``RefusalReason``.
- ``rpc``: one request, one response per direct libp2p stream, the shell the
  protocols below share.
- ``negotiation``: the thin trio shell speaking ``/cumulus/lease/1.0.0``
  (``call_propose_lease`` / ``rpc_propose_lease``), returning a ``LeaseGrant``.
- ``probing``: the thin trio shell speaking ``/cumulus/liveness/1.0.0``
  (``call_probe`` / ``serve_liveness``).
- ``metering``: the host's ``Meter`` issuing signed receipts, the consumer's
  ``check_receipt``.
- ``lease_state``: a served lease's lifecycle on the host as a transition table
  (``LeaseState``, ``LeaseEvent``, ``LeaseLifecycle``) and ``payment_event``, the move
  its unsettled receipts call for (sans-IO).
- ``ledger``: the durable, deduplicated receipt store, and the ``PaymentRail``
  protocol a payment system plugs into.
- ``settlement``: receipts countersigned over ``/cumulus/receipt/1.0.0`` (the
  consumer's ``ReceiptDesk``) and lease settlement over ``/cumulus/lease-close/1.0.0``.

Cores take the time as an argument and never read a clock; only ``rpc``,
``negotiation``, ``probing``, ``settlement`` (trio, libp2p) and ``ledger`` (files) do I/O.
The names this package takes from ``negotiation`` and ``probing`` load on first use, so
that a program reading only the cores (the CLI's views, the simulations) never loads
libp2p, which costs a process 0.5 s of CPU.
"""

import importlib
from typing import TYPE_CHECKING, Any

from .book import BookLimits as BookLimits
from .book import BookStatistics as BookStatistics
from .book import Fill as Fill
from .book import InsertStatus as InsertStatus
from .book import OrderBook as OrderBook
from .book import RestingOrder as RestingOrder
from .hostchoice import EXCLUDE_FOR_THE_JOB as EXCLUDE_FOR_THE_JOB
from .hostchoice import BackoffPolicy as BackoffPolicy
from .hostchoice import GiveUp as GiveUp
from .hostchoice import HostChoice as HostChoice
from .hostchoice import HostStanding as HostStanding
from .hostchoice import JobState as JobState
from .hostchoice import Propose as Propose
from .hostchoice import Wait as Wait
from .intake import ORDER_KINDS as ORDER_KINDS
from .intake import Admitted as Admitted
from .intake import MarketIntake as MarketIntake
from .lease import LeaseBook as LeaseBook
from .lease import Refusal as Refusal
from .lease import RefusalReason as RefusalReason
from .lease import Reservation as Reservation
from .lease_state import LeaseEvent as LeaseEvent
from .lease_state import LeaseLifecycle as LeaseLifecycle
from .lease_state import LeaseState as LeaseState
from .ledger import Ledger as Ledger
from .ledger import LedgerEntry as LedgerEntry
from .ledger import LedgerTotals as LedgerTotals
from .ledger import PaymentRail as PaymentRail
from .liveness import Liveness as Liveness
from .liveness import LivenessEvidence as LivenessEvidence
from .liveness import LivenessPolicy as LivenessPolicy
from .liveness import LivenessState as LivenessState
from .liveness import ProofRefusal as ProofRefusal
from .liveness import answer_probe as answer_probe
from .matcher import Entry as Entry
from .matcher import RankedOffer as RankedOffer
from .matcher import RankingPolicy as RankingPolicy
from .matcher import effective_price as effective_price
from .matcher import entry_of as entry_of
from .matcher import proposal_batch as proposal_batch
from .matcher import rank_offers as rank_offers
from .messages import KINDS as KINDS
from .messages import Bid as Bid
from .messages import Cancel as Cancel
from .messages import CountersignedReceipt as CountersignedReceipt
from .messages import Lease as Lease
from .messages import LeaseKind as LeaseKind
from .messages import LeaseProposal as LeaseProposal
from .messages import MarketMessage as MarketMessage
from .messages import Offer as Offer
from .messages import PriorityClass as PriorityClass
from .messages import Receipt as Receipt
from .messages import Side as Side
from .messages import decode_message as decode_message
from .messages import encode_message as encode_message
from .messages import open_message as open_message
from .messages import peer_id_of as peer_id_of
from .messages import seal_message as seal_message
from .metering import Meter as Meter
from .metering import check_receipt as check_receipt
from .standby import choose_standby as choose_standby
from .standby import standby_proposal as standby_proposal

#: The names taken from the I/O shells, by the module that defines them.
_SHELLS = {
    "LEASE_PROTOCOL": "negotiation",
    "LeaseGrant": "negotiation",
    "LeaseServer": "negotiation",
    "RpcContext": "negotiation",
    "call_propose_lease": "negotiation",
    "serve_leases": "negotiation",
    "LIVENESS_PROTOCOL": "probing",
    "call_probe": "probing",
    "serve_liveness": "probing",
}

if TYPE_CHECKING:
    from .negotiation import LEASE_PROTOCOL as LEASE_PROTOCOL
    from .negotiation import LeaseGrant as LeaseGrant
    from .negotiation import LeaseServer as LeaseServer
    from .negotiation import RpcContext as RpcContext
    from .negotiation import call_propose_lease as call_propose_lease
    from .negotiation import serve_leases as serve_leases
    from .probing import LIVENESS_PROTOCOL as LIVENESS_PROTOCOL
    from .probing import call_probe as call_probe
    from .probing import serve_liveness as serve_liveness


def __getattr__(name: str) -> Any:
    """A name of an I/O shell, loaded now (PEP 562)."""
    module = _SHELLS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
