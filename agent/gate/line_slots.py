"""Per-line caps on the gate's capacity: one business line cannot take every slot (``max_in_flight_share``).

A line's token buckets bound how fast it may send, not how much of the engine it holds: a tenant within
its request rate that sends long generations (or one huge batch job) fills the in-flight limit for
minutes, and every other line then waits behind it in the shared queue. With a share set, a line's
requests past this point (waiting in the gate's queue or at the engine) number at most
``max(1, floor(share x limit))``; the others wait here, in the line's own FIFO, under the same queue
deadline, so the shared queue and the engine keep room for the other lines. The cap follows the limit as
the policies move it (a raised limit hands its new slots to the waiters at once; a lowered one takes
none back, the line drains to it). Lines without a share are not held here at all.

Asyncio-only state, no I/O: a slot freed goes straight to the line's oldest waiter.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable


def line_cap(share: float, limit: int) -> int:
    """The most requests a line with ``share`` of an in-flight ``limit`` may have past its own queue."""
    return max(1, int(share * limit))


class LineSlots:
    """Slots of the lines that have a share, and their waiters."""

    def __init__(self) -> None:
        self.held: dict[str, int] = {}
        self._caps: dict[str, Callable[[], int]] = {}
        self._waiters: dict[str, deque[asyncio.Future[None]]] = {}

    def waiting(self, line: str) -> int:
        """Requests of ``line`` waiting for one of its slots."""
        return len(self._waiters.get(line, ()))

    async def acquire(self, line: str, cap: Callable[[], int], timeout_s: float) -> bool:
        """One of ``line``'s slots, first come, first served (``cap()`` says how many it has now); False
        when none freed within ``timeout_s``. A caller that gets one gives it back with :meth:`release`;
        one cancelled while waiting holds nothing."""
        self._caps[line] = cap
        self._fill(line)
        waiters = self._waiters.setdefault(line, deque())
        if self.held.get(line, 0) < cap() and not waiters:
            self.held[line] = self.held.get(line, 0) + 1
            return True
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters.append(future)
        try:
            await asyncio.wait_for(asyncio.shield(future), timeout_s)
        except BaseException as error:  # timed out, or the client left while waiting
            if future.done():
                self.release(line)  # handed a slot just as it gave up: pass it on
            else:
                future.cancel()
                waiters.remove(future)
            if isinstance(error, TimeoutError):
                return False
            raise
        return True

    def release(self, line: str) -> None:
        """Give back a slot :meth:`acquire` granted; the line's oldest waiter gets it."""
        self.held[line] -= 1
        self._fill(line)

    def refill(self) -> None:
        """After the in-flight limit grew: hand the slots it adds to the lines' waiters now."""
        for line in list(self._waiters):
            self._fill(line)

    def _fill(self, line: str) -> None:
        """Hand free slots (one released, or more after the cap grew) to the oldest waiters."""
        waiters = self._waiters.get(line)
        while waiters and self.held.get(line, 0) < self._caps[line]():
            future = waiters.popleft()
            self.held[line] = self.held.get(line, 0) + 1
            future.set_result(None)
        if not waiters and not self.held.get(line):  # nothing of the line left: forget it
            self._waiters.pop(line, None)
            self.held.pop(line, None)
