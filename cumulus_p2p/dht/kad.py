"""The Kademlia shell: a KadDHT that only stores valid ``/cumulus/`` offer sheets.

py-libp2p's KadDHT always speaks ``/ipfs/kad/1.0.0`` whatever ``protocol_prefix``
says, so Cumulus records are told apart by key namespace instead: the DHT runs with
a strict ``NamespacedValidator`` that knows only ``cumulus``, and every other key
(``/pk/``, ``/ipns/``, bare keys) is refused. The routing table is not filled from
connections either; the node adds each connected peer itself (``add_peer``).
"""

from __future__ import annotations

from collections.abc import Callable

import trio
from libp2p.abc import IHost
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.peer.id import ID
from libp2p.records.validator import NamespacedValidator, Validator

from .._errors import InvalidRecordError
from ..envelope import Envelope, EnvelopeValidator
from .records import NAMESPACE, OFFERS_INDEX, check_sheet, offers_key, select_sheet

__all__ = ["SheetRecordValidator", "fetch_offer_sheets", "new_dht"]


class SheetRecordValidator(Validator):
    """libp2p ``Validator`` for the ``cumulus`` namespace, over ``records.check_sheet``.

    KadDHT calls ``validate`` on every PUT it receives and every record a GET returns,
    many times per record, so the check never records nonces.
    """

    def __init__(
        self, validator: EnvelopeValidator, *, clock: Callable[[], float], max_offers: int
    ) -> None:
        self._validator = validator
        self._clock = clock
        self._max_offers = max_offers

    def validate(self, key: str, value: bytes) -> None:
        """Raise ``InvalidRecordError`` unless ``value`` is a valid sheet for ``key``."""
        check_sheet(key, value, self._validator, now=self._clock(), max_offers=self._max_offers)

    def select(self, key: str, values: list[bytes]) -> int:
        """Return the index of the freshest sheet."""
        return select_sheet(values)


def new_dht(
    host: IHost,
    validator: EnvelopeValidator,
    *,
    mode: DHTMode,
    clock: Callable[[], float],
    max_offers: int,
) -> KadDHT:
    """Build (but do not start) the DHT; run it with ``background_trio_service``.

    Args:
        host: The libp2p host.
        validator: The node's envelope validator; it must accept ``SHEET_KIND``.
        mode: ``DHTMode.SERVER`` when this node is reachable, else ``DHTMode.CLIENT``
            (a client does not answer DHT requests, so unreachable nodes are never
            put in others' routing tables).
        clock: Returns the current Unix time.
        max_offers: Largest number of offers one sheet may list.
    """
    namespaced = NamespacedValidator(
        {NAMESPACE: SheetRecordValidator(validator, clock=clock, max_offers=max_offers)},
        strict_validation=True,
    )
    return KadDHT(
        host,
        mode,
        validator=namespaced,
        validator_changed=True,
        strict_validation=True,
    )


async def fetch_offer_sheets(
    dht: KadDHT,
    validator: EnvelopeValidator,
    *,
    clock: Callable[[], float],
    max_offers: int,
    max_hosts: int = 1000,
    concurrency: int = 8,
) -> dict[ID, list[Envelope]]:
    """Read every announcing host's current offers from the DHT.

    Finds the hosts as providers of ``OFFERS_INDEX`` (deduplicated: py-libp2p returns
    one entry per answering peer), then reads each host's sheet. Hosts whose sheet is
    missing, expired or invalid are left out.

    Returns:
        Each host's live offers, checked without recording nonces.
    """
    providers = await dht.find_providers(OFFERS_INDEX, count=max_hosts)
    hosts = list(dict.fromkeys(p.peer_id for p in providers))[:max_hosts]
    found: dict[ID, list[Envelope]] = {}
    limiter = trio.CapacityLimiter(concurrency)

    async def read_sheet(host_id: ID) -> None:
        key = offers_key(host_id)
        async with limiter:
            value = await dht.get_value(key)
        if value is None:
            return
        try:
            _sheet, offers = check_sheet(key, value, validator, now=clock(), max_offers=max_offers)
        except InvalidRecordError:
            # get_value validated it already; it may have expired in between.
            return
        found[host_id] = offers

    async with trio.open_nursery() as nursery:
        for host_id in hosts:
            nursery.start_soon(read_sheet, host_id)
    return found
