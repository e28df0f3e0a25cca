"""Trio synchronisation cheap enough to pass through for every record of a session.

A session's tasks (its handler's senders and receiver, the session task, a resume) meet
on every record, so the general-purpose ``trio.Event`` and ``trio.Lock`` cost too much
there; these two do only what the session needs.
"""

from __future__ import annotations

import trio


class Signal:
    """Wakes every task waiting for "something changed"; costs nothing when none waits.

    A ``trio.Event`` per change would be allocated and set for every record even though
    someone waits only now and then (a sender short of acknowledgements, a second reader).
    """

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event: trio.Event | None = None

    async def wait(self) -> None:
        """Wait for the next ``fire``."""
        if self._event is None:
            self._event = trio.Event()
        await self._event.wait()

    def fire(self) -> None:
        """Wake every task waiting now."""
        if self._event is not None:
            self._event.set()
            self._event = None


class Mutex:
    """A lock between the tasks of one session, cheap enough for every record.

    Like ``trio.Lock`` (first come, first served: ``release`` hands the lock to the
    longest waiter) but without owner bookkeeping, and taking a free lock does not pass
    through the scheduler; the write that follows is the checkpoint. On the round-trip
    path ``trio.Lock`` cost about 2 µs per frame.
    """

    __slots__ = ("locked", "_lot")

    def __init__(self) -> None:
        #: Held by some task (read it to decide whether ``acquire`` would wait).
        self.locked = False
        self._lot = trio.lowlevel.ParkingLot()

    async def acquire(self) -> None:
        """Take the lock, waiting behind earlier takers if it is held."""
        if self.locked:
            await self._lot.park()  # woken by release, which hands the lock over
        else:
            self.locked = True

    def release(self) -> None:
        """Hand the lock to the longest waiter, or free it."""
        if len(self._lot):
            self._lot.unpark()
        else:
            self.locked = False

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc_info: object) -> None:
        self.release()
