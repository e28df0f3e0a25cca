"""From received bytes to the order book: validate, decode, insert. Sans-IO.

``MarketIntake.receive`` is what a gossip handler (or a DHT read) calls with each
offer, bid or cancel it receives. It chains the envelope validator (signature,
expiry, replay, size, kind), the market's own checks (``open_message``: body shape,
author and expiry consistent with the envelope) and ``OrderBook.insert``. A message
refused at any step leaves the book as it was.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._errors import MalformedMessageError
from ..envelope import Envelope, EnvelopeValidator, Rejected, Rejection
from .book import InsertStatus, OrderBook
from .messages import Bid, Cancel, Offer, open_message

__all__ = ["Admitted", "MarketIntake", "ORDER_KINDS"]

ORDER_KINDS = frozenset({Offer.KIND, Bid.KIND, Cancel.KIND})


@dataclass(frozen=True, slots=True)
class Admitted:
    """A message that passed validation, and what the book did with it."""

    envelope: Envelope
    message: Offer | Bid | Cancel
    status: InsertStatus


class MarketIntake:
    """Validates order messages and feeds them to a book.

    Args:
        book: The order book to feed.
        validator: The envelope validator; by default one accepting ``ORDER_KINDS``.
    """

    def __init__(self, book: OrderBook, validator: EnvelopeValidator | None = None) -> None:
        self.book = book
        self.validator = validator or EnvelopeValidator(ORDER_KINDS)

    def receive(self, raw: bytes, *, now: float, remember: bool = True) -> Admitted | Rejected:
        """Validate ``raw`` and insert its order message into the book.

        Args:
            raw: Envelope bytes as received.
            now: The current Unix time.
            remember: Record the nonce against replays (see ``EnvelopeValidator``).

        Returns:
            ``Admitted`` (check ``status`` for whether the book changed) or
            ``Rejected`` with the reason; a rejected message changes nothing.
        """
        checked = self.validator.validate(raw, now=now, remember=remember)
        if isinstance(checked, Rejected):
            return checked
        return self.admit(checked, now=now)

    def admit(self, envelope: Envelope, *, now: float) -> Admitted | Rejected:
        """Insert an envelope that an ``EnvelopeValidator`` has already accepted.

        For envelopes the mesh node delivers: its topic gate ran the validator, so
        validating again here would refuse them as replays.
        """
        try:
            message = open_message(envelope)
        except MalformedMessageError as exc:
            return Rejected(Rejection.MALFORMED, str(exc))
        if not isinstance(message, (Offer, Bid, Cancel)):
            return Rejected(Rejection.UNKNOWN_KIND, f"{envelope.kind} is not an order message")
        return Admitted(envelope, message, self.book.insert(message, now=now))
