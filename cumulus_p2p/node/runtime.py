"""What every node runs: the mesh node, its order book and its reputation view.

``open_runtime`` joins the mesh and feeds each accepted envelope to the right core:
offers, bids and cancels to the ``OrderBook`` (through ``MarketIntake.admit``: the mesh
already validated them), reports to ``Reputation``. Providers and consumers build on it;
a node with neither role is a bootstrap peer that only routes and relays.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import trio
from libp2p.peer.id import ID

from .._errors import CumulusError, NodeConfigError
from ..dht import REPUTATION_TOPIC, MeshConfig, MeshNode, mesh_validator, open_mesh_node
from ..dht.gossip import TOPICS
from ..envelope import Envelope
from ..identity import NodeIdentity
from ..market import KINDS as MARKET_KINDS
from ..market import BookLimits, MarketIntake, Offer, OrderBook, Side
from ..market.clearing import ClearingPrices, price_rows
from ..market.intake import ORDER_KINDS, Admitted
from ..market.messages import open_message
from ..reputation import REPORT_KIND, Accepted, Evidence, Report, Reputation, seal_report
from ..reputation.evidence import ServiceRecord
from .datadir import DataDir

log = logging.getLogger(__name__)

#: Seconds a report is gossiped for (the evidence it carries is kept far longer).
REPORT_TTL_S = 600.0


@dataclass
class Runtime:
    """A running node's shared parts. Get one from ``open_runtime``."""

    identity: NodeIdentity
    data: DataDir
    mesh: MeshNode
    book: OrderBook
    intake: MarketIntake
    reputation: Reputation
    clock: Callable[[], float]
    received: dict[str, int] = field(default_factory=dict)
    #: The host-signed envelope of each live offer, by ``(host, offer_id, nonce)``: a
    #: lease names one, and evidence about the lease (a performance report) carries it.
    offer_envelopes: dict[tuple[str, str, int], Envelope] = field(default_factory=dict)
    #: What recent leases cleared at, from the service records this node accepted.
    clearing: ClearingPrices = field(default_factory=ClearingPrices)

    @property
    def peer_id(self) -> str:
        """This node's peer ID (base58)."""
        return self.mesh.peer_id.to_base58()

    async def report(self, about: str, evidence: Evidence) -> bool:
        """Sign a report of ``evidence`` about peer ``about`` and gossip it; False (and
        logged) when the mesh would not take it."""
        now = self.clock()
        report = Report(
            self.peer_id, about, evidence, now, now + REPORT_TTL_S, self.mesh.next_nonce()
        )
        try:
            await self.publish_report(seal_report(self.identity, report, now=now))
        except CumulusError as exc:
            log.warning("could not report on peer %s: %s", about[:12], exc)
            return False
        return True

    async def publish_report(self, envelope: Envelope) -> None:
        """Gossip a signed reputation report (and count it ourselves)."""
        self._take_report(envelope, self.clock())
        await self.mesh.publish(envelope, topic=REPUTATION_TOPIC)

    async def consume_messages(self) -> None:
        """Feed every accepted envelope to its core, until cancelled."""
        async for msg in self.mesh.messages:
            kind = msg.envelope.kind
            self.received[kind] = self.received.get(kind, 0) + 1
            now = self.clock()
            if kind in ORDER_KINDS:
                admitted = self.intake.admit(msg.envelope, now=now)
                if isinstance(admitted, Admitted) and type(admitted.message) is Offer:
                    offer = admitted.message
                    key = (offer.host, offer.offer_id, offer.nonce)
                    self.offer_envelopes[key] = msg.envelope
            elif kind == REPORT_KIND:
                self._take_report(msg.envelope, now)

    def _take_report(self, envelope: Envelope, now: float) -> None:
        """Count a reputation report; an accepted service record's lease is also a price."""
        result = self.reputation.receive_envelope(envelope, now=now)
        if not isinstance(result, Accepted):
            return
        self._vouch_if_served(result.report.host, now)
        evidence = result.report.evidence
        if type(evidence) is ServiceRecord:
            proposal = evidence.lease.proposal
            model = self._gpu_model_of(proposal.host, proposal.offer_id, proposal.offer_nonce)
            if model is not None:
                self.clearing.record(proposal, model, now=now)

    def _gpu_model_of(self, host: str, offer_id: str, nonce: int) -> str | None:
        """The GPU model of an offer this node has seen: the very version a lease names,
        or the live one under its ID (a long lease outlives the version it named)."""
        envelope = self.offer_envelopes.get((host, offer_id, nonce))
        if envelope is not None:
            offer = open_message(envelope)
            if type(offer) is Offer:
                return offer.gpu_model
        live = self.book.get(Side.OFFER, host, offer_id)
        return None if live is None else live.order.gpu_model

    def _vouch_if_served(self, host: str, now: float) -> None:
        """A host with credible evidence of service (paid leases) is vouched for in the
        book: a full book evicts newcomers' orders first, and consumers rank it ahead of
        hosts with no record."""
        if not self.book.vouched(host) and self.reputation.score(host, now=now).successes > 0:
            self.book.vouch(host)

    async def expire_loop(self, interval: float = 1.0) -> None:
        """Drop expired orders and evidence on a timer."""
        while True:
            now = self.clock()
            self.book.expire(now)
            self.reputation.expire(now)
            self.clearing.expire(now)
            for key, envelope in list(self.offer_envelopes.items()):
                if envelope.expires_at <= now:
                    del self.offer_envelopes[key]
            await trio.sleep(interval)

    def peers(self) -> list[dict]:
        """The peers this node is connected to, with their addresses."""
        store = self.mesh.host.get_peerstore()
        rows = []
        for peer in self.mesh.host.get_connected_peers():
            addrs = [str(a) for a in store.addrs(peer)] if peer in store.peer_ids() else []
            rows.append({"peer": peer.to_base58(), "addrs": addrs[:3]})
        return rows

    def snapshot(self) -> dict:
        """What every node's ``state.json`` holds: who it is, its peers, the live offers
        and its host scores (computed once for both)."""
        now = self.clock()
        offers = list(self.book.offers())
        scores, weight = self.reputation.scores_and_credibility(
            now=now, hosts={r.order.host for r in offers}
        )
        return {
            "peer_id": self.peer_id,
            "addrs": [str(a) for a in self.mesh.addrs],
            "peers": self.peers(),
            "topics": list(TOPICS),
            "offers": _offer_rows(offers, scores, now),
            "prices": _price_rows(offers, self.clearing.recent(now)),
            "bids": _bid_rows(self.book.bids(), now),
            "scores": _score_rows(scores.values()),
            "evidence": _evidence_rows(self.reputation.store.findings(), weight),
            "updated": time.time(),
        }


def _price_rows(offers: list, clearings: list) -> list[dict]:
    """Per GPU model: the ask, the contending floor, and what recent leases cleared at."""
    return [dataclasses.asdict(row) for row in price_rows(offers, clearings)]


def _offer_rows(offers: list, scores: dict, now: float) -> list[dict]:
    """Every live offer, cheapest first, with its host's score."""
    rows = [
        {
            "host": r.order.host,
            "offer_id": r.order.offer_id,
            "gpu": r.order.gpu_model,
            "vram_mib": r.order.vram_mib,
            "perf": r.order.perf_units,
            "shares": r.remaining,
            "contend_shares": r.contend_remaining,
            "price": r.order.price,
            "contend_price": r.order.contend_price,
            "storage_gib": r.order.storage_gib,
            "storage_price": r.order.storage_price,
            "score": round(scores[r.order.host].mean, 3),
            "expires_in": round(r.order.expires_at - now, 1),
        }
        for r in offers
    ]
    return sorted(rows, key=lambda row: (row["price"], row["host"]))


def _bid_rows(bids, now: float) -> list[dict]:
    """Every resting bid, highest limit first (the book's order)."""
    return [
        {
            "consumer": r.order.consumer,
            "bid_id": r.order.bid_id,
            "gpu_models": list(r.order.gpu_models),
            "min_vram_mib": r.order.min_vram_mib,
            "shares": r.remaining,
            "max_price": r.order.max_price,
            "priority": r.order.priority.name.lower().replace("_", "-"),
            "expires_in": round(r.order.expires_at - now, 1),
        }
        for r in bids
    ]


#: How many evidence records ``state.json`` carries, newest first.
EVIDENCE_ROWS = 2000


def _evidence_rows(findings, weight: dict[str, float]) -> list[dict]:
    """The evidence held, newest first: what it says about whom, who reported it and how
    much that reporter's word weighs."""
    findings = sorted(findings, key=lambda f: -f.at)[:EVIDENCE_ROWS]
    return [
        {
            "kind": f.kind.name.lower(),
            "about": f.host,
            "reporter": f.credited,
            "weight": round(weight.get(f.credited, 0.0), 4),
            "at": f.at,
            "served_share_s": f.served,
            "shares": f.lease_shares,
            "ratio": round(f.ratio, 4),
        }
        for f in findings
    ]


def _score_rows(scores) -> list[dict]:
    """Each host's reliability, most reliable (by lower credible bound) first."""
    rows = [
        {
            "host": s.host,
            "mean": round(s.mean, 4),
            "lower_bound": round(s.lower_bound, 4),
            "evidence": round(s.evidence_weight, 3),
            "successes": round(s.successes, 3),
            "failures": round(s.failures, 3),
        }
        for s in scores
    ]
    return sorted(rows, key=lambda r: (-r["lower_bound"], r["host"]))


@asynccontextmanager
async def open_runtime(
    identity: NodeIdentity,
    data: DataDir,
    config: MeshConfig,
    *,
    clock: Callable[[], float] = time.time,
    book_limits: BookLimits | None = None,
) -> AsyncIterator[Runtime]:
    """Join the mesh and run the message loop; everything stops on exit.

    ``book_limits`` bounds the order book (``BookLimits()`` by default): a flood of
    valid offers from fresh keys must not grow it without end.

    Raises:
        NodeConfigError: Bootstrap peers were given and none could be reached.
    """
    validator = mesh_validator([*MARKET_KINDS, REPORT_KIND])
    async with open_mesh_node(identity, validator, config, clock=clock) as mesh:
        if config.bootstrap and not mesh.host.get_connected_peers():
            raise NodeConfigError(
                f"no bootstrap peer could be reached ({', '.join(config.bootstrap)}). Check "
                "that the address is right and that the node there is running, or leave "
                "out --bootstrap to start a new mesh."
            )
        book = OrderBook(book_limits or BookLimits())
        runtime = Runtime(
            identity,
            data,
            mesh,
            book,
            MarketIntake(book),
            Reputation(identity.peer_id.to_base58()),
            clock,
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(runtime.consume_messages)
            nursery.start_soon(runtime.expire_loop)
            yield runtime
            nursery.cancel_scope.cancel()


def peer_of(peer_id: str) -> ID:
    """A base58 peer ID as libp2p's ``ID``."""
    return ID.from_base58(peer_id)
