"""Checks of a signed document's fields, as its dataclass's ``__post_init__`` runs them:
market messages (``messages.py``) and reputation evidence (``reputation/evidence.py``)
hold peer input to the same rules, and say what was wrong in the same words.

Each check raises ``InvalidMessageError`` naming the class and the field.
"""

from __future__ import annotations

import math

from .._errors import InvalidMessageError

MAX_U64 = 2**64 - 1


def bad(cls: type, name: str, why: str) -> InvalidMessageError:
    """The error for field ``name`` of a ``cls``: ``why`` says what it must be."""
    return InvalidMessageError(f"{cls.__name__}.{name} {why}")


def check_int(msg: object, name: str, lo: int, hi: int = MAX_U64) -> None:
    value = getattr(msg, name)
    if type(value) is not int or not lo <= value <= hi:
        raise bad(type(msg), name, f"must be an int in {lo}..{hi}, got {value!r}")


def check_float(msg: object, name: str) -> None:
    """A finite, non-negative float (a time, a price). Ints from local callers are
    accepted for convenience and stored as floats, so that the encoding is canonical;
    decoded peer input is held to the float type by the re-encode check."""
    value = getattr(msg, name)
    if type(value) is int:
        value = float(value)
        object.__setattr__(msg, name, value)
    if type(value) is not float or not math.isfinite(value) or value < 0:
        raise bad(type(msg), name, f"must be a finite, non-negative float, got {value!r}")
