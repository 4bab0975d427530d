"""The admission core: an in-flight limit with a bounded priority queue. Pure; time is passed in.

The gate's proxy layer (:mod:`agent.gate.proxy`) is a thin aiohttp shell over :class:`AdmissionQueue`,
so the virtual-time tests drive exactly the code that serves traffic.

Rules, for a limit ``L`` and a reserve ``R = min(L - 1, round(r L))`` (``r`` = ``high_reserved_ratio``):

* the limit counts sequences in the engine, not requests: a request asking for several (``n``, a list of
  prompts) has that ``weight``, and takes that many slots, capped at its class's share (below) so that
  it can always run, alone if need be. Counting it as one let a client with ``n`` = 8 put eight times
  the effective batch into the engine;
* a request whose *original* class is ``high`` may run while ``in_flight + weight <= L``; any other
  request only while ``in_flight + weight <= L - R``. The reserve keeps room for high traffic during a
  flood of lower classes, and is not open to promoted requests, so aging cannot drain it;
* a request that has waited ``aging_s`` is promoted one class (once: low -> normal, normal -> high);
* when capacity frees, waiting requests are ranked by (effective class, arrival order) and the first
  that fits is admitted. A lower effective class is never admitted ahead of a higher one that fits
  (no inversion), and a promoted request keeps its original arrival order within its new class. A
  request that would fit but for its weight waits for room, and nothing ranked below it is admitted
  meanwhile (smaller requests filling the slots as they free would starve it), except requests whose
  original class is ``high`` when it is not: the reserve and the high class's precedence hold even
  while a heavy normal or low request waits;
* a full queue sheds the newest request of the lowest class present when a higher class arrives, and
  otherwise rejects the arrival (429); a request that waits ``max_wait_s`` expires (503);
* a class may have its own deadline, ``max_wait_s`` times its ``wait_scale`` (the gate sets it to the
  class's TTFT target over the global one: batch traffic allowed 30 s against a 2 s SLO waits 15x as
  long). Aging still ranks it, so a patient low request delays a fresh normal one by ``aging_s`` at most.

Each original class has its own FIFO deque. Within one deque arrival order equals age, so the effective
class is monotone along it and the best waiting request is always one of the (at most three) heads:
dispatch is O(1) per admitted request.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum

#: The longest any request may wait for admission, whatever its class's scale (the gate's knob bound).
MAX_WAIT_S = 3600.0


class Priority(IntEnum):
    """Priority classes; larger is more important."""

    LOW = 0
    NORMAL = 1
    HIGH = 2

    @classmethod
    def parse(cls, text: str | None, default: Priority) -> Priority:
        """``"high"``/``"normal"``/``"low"`` (any case) or ``default`` for anything else."""
        if text:
            try:
                return cls[text.strip().upper()]
            except KeyError:
                return default
        return default


def class_wait_scales(
    by_priority: Mapping[str, tuple[float, float]], ttft_slo_s: float
) -> dict[Priority, float]:
    """Each class's deadline as a multiple of the gate's: its own TTFT target (``by_priority``: class ->
    (TTFT, ITL), ``policies.slo_by_priority``) over the SLO's, 1 for a class without one. The live gate
    and the replay's gate both take it from here."""
    return {
        p: by_priority[p.name.lower()][0] / ttft_slo_s if p.name.lower() in by_priority else 1.0
        for p in Priority
    }


class TicketState(StrEnum):
    WAITING = "waiting"
    ADMITTED = "admitted"
    REJECTED = "rejected"  # queue full, or shed for a higher class: 429
    EXPIRED = "expired"  # waited max_wait_s: 503
    CANCELLED = "cancelled"  # the client went away while waiting
    DONE = "done"


@dataclass(eq=False, slots=True)
class Ticket:
    """One request's place in the gate. Identity, not value, equality: two tickets are never equal."""

    seq: int
    priority: Priority
    arrived: float
    state: TicketState = TicketState.WAITING
    admitted_at: float | None = None
    promoted: bool = False
    reason: str = field(default="")
    weight: int = 1
    """Sequences it will put in the engine (``n``, a batch's prompts)."""
    charge: int = 0
    """Slots it holds while admitted: its weight, capped at its class's share of the limit then."""

    def effective(self, now: float, aging_s: float) -> Priority:
        if self.priority < Priority.HIGH and now - self.arrived >= aging_s:
            return Priority(self.priority + 1)
        return self.priority

    @property
    def queue_wait_s(self) -> float:
        return 0.0 if self.admitted_at is None else self.admitted_at - self.arrived


class AdmissionQueue:
    """In-flight limit + bounded priority queue with reservation and aging (see the module docstring).

    Methods that can admit, shed or expire waiting requests return the tickets whose state they
    changed, so the caller can wake whoever waits on them.
    """

    def __init__(
        self,
        limit: int,
        queue_size: int,
        *,
        high_reserved_ratio: float = 0.2,
        aging_s: float = 0.2,
        max_wait_s: float = 10.0,
    ) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.queue_size = queue_size
        self.high_reserved_ratio = high_reserved_ratio
        self.aging_s = aging_s
        self.max_wait_s = max_wait_s
        #: each original class's deadline as a multiple of ``max_wait_s`` (:meth:`max_wait_for`)
        self.wait_scale: dict[Priority, float] = dict.fromkeys(Priority, 1.0)
        self._limit = limit
        self._queues: dict[Priority, deque[Ticket]] = {p: deque() for p in Priority}
        self._depth = 0
        self._in_flight = 0
        self._seq = 0
        self.promotions = 0

    # --- observation -------------------------------------------------------------------------------
    @property
    def limit(self) -> int:
        return self._limit

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def queue_depth(self) -> int:
        return self._depth

    @property
    def reserved(self) -> int:
        """Slots only original-high requests may use."""
        return min(self._limit - 1, int(self._limit * self.high_reserved_ratio + 0.5))  # 20% of 2 is 0, not 1

    def max_wait_for(self, priority: Priority) -> float:
        """How long a request whose original class is ``priority`` may wait: ``max_wait_s`` scaled by its
        class, at most :data:`MAX_WAIT_S`."""
        return min(MAX_WAIT_S, self.max_wait_s * self.wait_scale[priority])

    def depth_by_class(self) -> dict[Priority, int]:
        return {p: len(q) for p, q in self._queues.items()}

    # --- transitions -------------------------------------------------------------------------------
    def offer(self, priority: Priority, now: float, weight: int = 1) -> tuple[Ticket, list[Ticket]]:
        """A request of ``weight`` sequences arrives. Returns its ticket and the other tickets whose state
        changed (shed)."""
        if weight < 1:
            raise ValueError(f"weight must be >= 1, got {weight}")
        self._seq += 1
        ticket = Ticket(self._seq, priority, now, weight=int(weight))
        self._queues[priority].append(ticket)
        self._depth += 1
        changed = self._dispatch(now)
        if ticket.state is TicketState.WAITING and self._depth > self.queue_size:
            victim = self._shed_for(ticket)
            if victim is not ticket:
                changed.append(victim)
        return ticket, [t for t in changed if t is not ticket]

    def release(self, ticket: Ticket, now: float) -> list[Ticket]:
        """An admitted request finished (any outcome); admit whoever is next."""
        if ticket.state is not TicketState.ADMITTED:
            raise ValueError(f"release of a ticket in state {ticket.state.value}")
        ticket.state = TicketState.DONE
        self._in_flight -= ticket.charge
        return self._dispatch(now)

    def cancel(self, ticket: Ticket) -> bool:
        """Withdraw a waiting request (client gone). True when it was still waiting."""
        if ticket.state is not TicketState.WAITING:
            return False
        self._remove(ticket, TicketState.CANCELLED)
        return True

    def expire(self, now: float) -> list[Ticket]:
        """Expire every request that has waited its class's deadline or more; returns them."""
        expired = []
        for priority, queue in self._queues.items():
            deadline = self.max_wait_for(priority)
            while queue and now - queue[0].arrived >= deadline:
                ticket = queue.popleft()
                self._depth -= 1
                ticket.state = TicketState.EXPIRED
                expired.append(ticket)
        return expired

    def expire_ticket(self, ticket: Ticket) -> bool:
        """Expire one waiting request (its own timer fired). True when it was still waiting."""
        if ticket.state is not TicketState.WAITING:
            return False
        self._remove(ticket, TicketState.EXPIRED)
        return True

    def set_limit(self, limit: int, now: float) -> list[Ticket]:
        """Change the in-flight limit. Lowering it admits nobody until enough requests finish; nothing
        running is interrupted, so ``in_flight`` may exceed a just-lowered limit but never grows past it."""
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self._limit = int(limit)
        return self._dispatch(now)

    def poll(self, now: float) -> list[Ticket]:
        """Admit what fits now (after promotions, say); normally release/offer do this."""
        return self._dispatch(now)

    # --- internals ---------------------------------------------------------------------------------
    def _cap(self, ticket: Ticket) -> int:
        """The most of the limit ``ticket``'s original class may use."""
        return self._limit if ticket.priority is Priority.HIGH else self._limit - self.reserved

    def _dispatch(self, now: float) -> list[Ticket]:
        admitted: list[Ticket] = []
        while self._depth and self._in_flight < self._limit:
            heads = [(q[0].effective(now, self.aging_s), -q[0].seq, q[0]) for q in self._queues.values() if q]
            heads.sort(key=lambda h: (h[0], h[1]), reverse=True)
            chosen = None
            held_back = False  # a lower class waits for room: only original-high requests may pass it
            for head in heads:
                ticket = head[2]
                if held_back and ticket.priority is not Priority.HIGH:
                    continue
                cap = self._cap(ticket)
                if self._in_flight + min(ticket.weight, cap) <= cap:
                    chosen = head
                    break
                if self._in_flight < cap:  # only its weight keeps it out: what ranks below waits for it
                    if ticket.priority is Priority.HIGH:
                        break
                    held_back = True  # but high traffic keeps its reserve
            if chosen is None:
                break
            effective, _, ticket = chosen
            self._queues[ticket.priority].popleft()
            self._depth -= 1
            ticket.charge = min(ticket.weight, self._cap(ticket))
            self._in_flight += ticket.charge
            if effective > ticket.priority:
                ticket.promoted = True
                self.promotions += 1
            ticket.state = TicketState.ADMITTED
            ticket.admitted_at = now
            admitted.append(ticket)
        return admitted

    def _shed_for(self, arrival: Ticket) -> Ticket:
        """The queue is one over its size: shed the newest of the lowest class (maybe the arrival)."""
        lowest = next(p for p in Priority if self._queues[p])
        victim = arrival if lowest >= arrival.priority else self._queues[lowest][-1]
        self._remove(victim, TicketState.REJECTED)
        victim.reason = "queue full" if victim is arrival else "shed for a higher-priority request"
        return victim

    def _remove(self, ticket: Ticket, state: TicketState) -> None:
        queue = self._queues[ticket.priority]
        if queue and queue[-1] is ticket:
            queue.pop()
        else:
            queue.remove(ticket)
        self._depth -= 1
        ticket.state = state
