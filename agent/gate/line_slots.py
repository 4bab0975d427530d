"""Per-line caps on the gate's capacity: one business line cannot take every slot (``max_in_flight_share``).

A line's token buckets bound how fast it may send, not how much of the engine it holds: a tenant within
its request rate that sends long generations (or one huge batch job) fills the in-flight limit for
minutes, and every other line then waits behind it in the shared queue. With a share set, a line's
requests past this point (waiting in the gate's queue or at the engine) number at most
``max(1, floor(share x limit))``; the others wait here, in the line's own FIFO, under the same queue
deadline, so the shared queue and the engine keep room for the other lines. The cap follows the limit as
the policies move it (a raised limit hands its new slots to the waiters at once; a lowered one takes
none back, the line drains to it). Lines without a share are not held here at all. Slots count
sequences, as the in-flight limit does (agent/gate/admission.py): a request for ``n`` of them takes ``n``,
capped at the line's cap so that it can always run, alone if need be.

Asyncio-only state, no I/O: a slot freed goes straight to the line's oldest waiter.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable


def line_cap(share: float, limit: int) -> int:
    """The most sequences a line with ``share`` of an in-flight ``limit`` may have past its own queue."""
    return max(1, int(share * limit))


class LineSlots:
    """Slots of the lines that have a share, and their waiters."""

    def __init__(self) -> None:
        self.held: dict[str, int] = {}
        self._caps: dict[str, Callable[[], int]] = {}
        #: per line, its waiters in arrival order: each one's future (its charge, once granted) and weight
        self._waiters: dict[str, deque[tuple[asyncio.Future[int], int]]] = {}

    def waiting(self, line: str) -> int:
        """Requests of ``line`` waiting for one of its slots."""
        return len(self._waiters.get(line, ()))

    async def acquire(self, line: str, cap: Callable[[], int], timeout_s: float, weight: int = 1) -> int:
        """Slots of ``line`` for a request of ``weight`` sequences, first come, first served (``cap()`` says
        how many the line has now); returns how many it holds (its weight, at most the cap), 0 when they
        did not free within ``timeout_s``. A caller that gets some gives them back with :meth:`release`;
        one cancelled while waiting holds nothing."""
        self._caps[line] = cap
        self._fill(line)
        waiters = self._waiters.setdefault(line, deque())
        charge = self._charge(line, weight)
        if charge and not waiters:
            self.held[line] = self.held.get(line, 0) + charge
            return charge
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        entry = (future, weight)
        waiters.append(entry)
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout_s)
        except BaseException as error:  # timed out, or the client left while waiting
            if future.done():
                self.release(line, future.result())  # handed slots just as it gave up: pass them on
            else:
                future.cancel()
                waiters.remove(entry)
            if isinstance(error, TimeoutError):
                return 0
            raise

    def release(self, line: str, slots: int = 1) -> None:
        """Give back ``slots`` that :meth:`acquire` granted; the line's oldest waiters get them."""
        self.held[line] -= slots
        self._fill(line)

    def _charge(self, line: str, weight: int) -> int:
        """The slots a request of ``weight`` takes if it fits now, else 0."""
        cap = self._caps[line]()
        charge = min(weight, cap)
        return charge if self.held.get(line, 0) + charge <= cap else 0

    def refill(self) -> None:
        """After the in-flight limit grew: hand the slots it adds to the lines' waiters now."""
        for line in list(self._waiters):
            self._fill(line)

    def _fill(self, line: str) -> None:
        """Hand free slots (one released, or more after the cap grew) to the oldest waiters."""
        waiters = self._waiters.get(line)
        while waiters and (charge := self._charge(line, waiters[0][1])):
            future, _ = waiters.popleft()
            self.held[line] = self.held.get(line, 0) + charge
            future.set_result(charge)
        if not waiters and not self.held.get(line):  # nothing of the line left: forget it
            self._waiters.pop(line, None)
            self.held.pop(line, None)
