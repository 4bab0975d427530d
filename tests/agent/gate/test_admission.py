"""The admission core in virtual time: limits, reservation, aging, no inversion, shedding, expiry."""

from __future__ import annotations

import heapq
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.gate.admission import MAX_WAIT_S, AdmissionQueue, Priority, Ticket, TicketState

H, N, L = Priority.HIGH, Priority.NORMAL, Priority.LOW


def _queue(limit: int = 4, queue_size: int = 100, **kw: float) -> AdmissionQueue:
    return AdmissionQueue(limit, queue_size, **kw)


def test_admits_up_to_the_limit_then_queues() -> None:
    q = _queue(limit=2, high_reserved_ratio=0.0)
    states = [q.offer(N, 0.0)[0].state for _ in range(3)]
    assert states == [TicketState.ADMITTED, TicketState.ADMITTED, TicketState.WAITING]
    assert (q.in_flight, q.queue_depth) == (2, 1)


def test_release_admits_the_next_waiter() -> None:
    q = _queue(limit=1, high_reserved_ratio=0.0)
    first, _ = q.offer(N, 0.0)
    second, _ = q.offer(N, 0.0)
    assert q.release(first, 0.1) == [second]
    assert second.state is TicketState.ADMITTED and second.queue_wait_s == 0.1


def test_reserve_keeps_slots_for_high_priority() -> None:
    q = _queue(limit=10, high_reserved_ratio=0.2)
    normals = [q.offer(N, 0.0)[0] for _ in range(10)]
    assert sum(t.state is TicketState.ADMITTED for t in normals) == 8
    high, _ = q.offer(H, 0.0)
    assert high.state is TicketState.ADMITTED


def test_promoted_request_does_not_use_the_reserve() -> None:
    q = _queue(limit=10, high_reserved_ratio=0.2)
    for _ in range(8):
        q.offer(N, 0.0)
    waiting, _ = q.offer(N, 0.0)
    assert q.poll(5.0) == []  # promoted to high by age, still not allowed into the reserve
    assert waiting.state is TicketState.WAITING


def test_low_request_is_promoted_after_200_ms() -> None:
    q = _queue(limit=1, high_reserved_ratio=0.0, aging_s=0.2)
    running, _ = q.offer(H, 0.0)
    low, _ = q.offer(L, 0.0)
    normal, _ = q.offer(N, 0.15)
    assert low.effective(0.199, 0.2) is L
    q.release(running, 0.2)
    assert low.state is TicketState.ADMITTED and low.promoted
    assert normal.state is TicketState.WAITING


def test_without_aging_the_higher_class_goes_first() -> None:
    q = _queue(limit=1, high_reserved_ratio=0.0, aging_s=0.2)
    running, _ = q.offer(H, 0.0)
    low, _ = q.offer(L, 0.0)
    normal, _ = q.offer(N, 0.05)
    q.release(running, 0.1)
    assert normal.state is TicketState.ADMITTED and low.state is TicketState.WAITING


def test_promoted_request_keeps_its_arrival_order_within_the_new_class() -> None:
    q = _queue(limit=1, high_reserved_ratio=0.0, aging_s=0.2)
    running, _ = q.offer(H, 0.0)
    old_low, _ = q.offer(L, 0.0)
    normal, _ = q.offer(N, 0.1)
    order = []
    ticket = running
    for t in (0.3, 0.4):
        admitted = q.release(ticket, t)
        order.extend(admitted)
        ticket = admitted[0]
    assert order[:2] == [old_low, normal]


@pytest.mark.parametrize("max_weight", [1, 4])
def test_no_inversion_over_random_traffic(max_weight: int) -> None:
    """Whenever a request is admitted, no waiting request has a higher effective class that would fit,
    and none of the same class arrived earlier; with weights too (a request kept out by its weight holds
    back everything ranked below it)."""
    rng = random.Random(7)
    q = _queue(limit=6, queue_size=1000, high_reserved_ratio=0.2, aging_s=0.2)
    running: list[Ticket] = []
    waiting: list[Ticket] = []
    now = 0.0

    def check(admitted: list[Ticket], before: list[Ticket]) -> None:
        for ticket in admitted:
            rank = (ticket.effective(now, 0.2), -ticket.seq)
            for other in before:
                if other.state is TicketState.WAITING and (other.priority is H or ticket.priority is not H):
                    assert (other.effective(now, 0.2), -other.seq) < rank

    for _ in range(3000):
        now += rng.expovariate(40.0)
        before = [t for t in waiting if t.state is TicketState.WAITING]
        if running and rng.random() < 0.5:
            admitted = q.release(running.pop(rng.randrange(len(running))), now)
        else:
            ticket, changed = q.offer(Priority(rng.randrange(3)), now, rng.randint(1, max_weight))
            waiting.append(ticket)
            admitted = [t for t in (ticket, *changed) if t.state is TicketState.ADMITTED]  # aging reorders
        check(admitted, before)
        running += admitted
        assert q.in_flight == sum(t.charge for t in running) <= q.limit
    assert q.promotions > 0


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["offer", "release", "limit"]), st.integers(0, 2), st.integers(1, 12))
    ),
    st.booleans(),
)
def test_in_flight_never_exceeds_the_limit_also_while_it_changes(
    ops: list[tuple[str, int, int]], weighted: bool
) -> None:
    q = _queue(limit=4, queue_size=20)
    running: list[Ticket] = []
    for step, (op, prio, value) in enumerate(ops):
        now = step * 0.05
        before = q.in_flight
        if op == "offer":
            ticket, changed = q.offer(Priority(prio), now, value if weighted else 1)
            if ticket.state is TicketState.ADMITTED:
                running.append(ticket)
            running += [t for t in changed if t.state is TicketState.ADMITTED]
        elif op == "release" and running:
            running += q.release(running.pop(value % len(running)), now)
        elif op == "limit":
            running += q.set_limit(value, now)
        grew = q.in_flight > before
        assert not grew or q.in_flight <= q.limit
        assert q.in_flight == sum(t.charge for t in running) and q.in_flight <= max(q.limit, before)


def test_full_queue_rejects_an_arrival_of_the_lowest_class() -> None:
    q = _queue(limit=1, queue_size=1)
    q.offer(N, 0.0)
    q.offer(L, 0.0)
    ticket, changed = q.offer(L, 0.0)
    assert ticket.state is TicketState.REJECTED and changed == []


def test_full_queue_sheds_the_newest_low_for_a_high_arrival() -> None:
    q = _queue(limit=1, queue_size=2, high_reserved_ratio=0.0)
    q.offer(N, 0.0)
    older, _ = q.offer(L, 0.0)
    newer, _ = q.offer(L, 0.1)
    high, changed = q.offer(H, 0.2)
    assert high.state is TicketState.WAITING and changed == [newer]
    assert newer.state is TicketState.REJECTED and older.state is TicketState.WAITING


def test_requests_waiting_too_long_expire() -> None:
    q = _queue(limit=1, max_wait_s=2.0)
    q.offer(H, 0.0)
    late, _ = q.offer(N, 0.0)
    fresh, _ = q.offer(N, 1.5)
    assert q.expire(2.0) == [late]
    assert fresh.state is TicketState.WAITING and q.queue_depth == 1


def test_a_class_with_its_own_deadline_expires_by_it() -> None:
    """A class's ``wait_scale`` (its TTFT target over the global one) scales its deadline; the rest keep
    ``max_wait_s``, and no scale takes a deadline past the gate's bound."""
    q = _queue(limit=1, max_wait_s=2.0)
    q.wait_scale[L] = 15.0  # batch traffic: 30 s against a 2 s SLO
    q.wait_scale[H] = 0.25
    q.offer(H, 0.0)
    low, _ = q.offer(L, 0.0)
    normal, _ = q.offer(N, 0.0)
    high, _ = q.offer(H, 0.0)
    assert q.expire(0.6) == [high]
    assert q.expire(2.0) == [normal]
    assert q.expire(29.9) == [] and low.state is TicketState.WAITING
    assert q.expire(30.0) == [low]
    q.wait_scale[L] = 1e6
    assert q.max_wait_for(L) == MAX_WAIT_S and q.max_wait_for(N) == 2.0


def test_cancel_withdraws_a_waiting_request() -> None:
    q = _queue(limit=1)
    running, _ = q.offer(H, 0.0)
    gone, _ = q.offer(N, 0.0)
    assert q.cancel(gone) and q.queue_depth == 0
    assert q.release(running, 1.0) == []


def test_raising_the_limit_admits_waiters() -> None:
    q = _queue(limit=1, high_reserved_ratio=0.0)
    q.offer(N, 0.0)
    waiter, _ = q.offer(N, 0.0)
    assert q.set_limit(2, 0.5) == [waiter]


def test_high_priority_wait_p99_under_250_ms_during_a_low_priority_flood() -> None:
    """Discrete-event run, 300 s of virtual time: lows arrive at 1.5x the gate's capacity, highs at 10%;
    every request holds its slot ~1 s. High-priority queue wait P99 must stay under 250 ms."""
    rng = random.Random(3)
    q = AdmissionQueue(32, 100_000, high_reserved_ratio=0.2, aging_s=0.2, max_wait_s=1e9)
    events: list[tuple[float, int, str, Ticket | None]] = []
    counter = 0

    def push(t: float, kind: str, ticket: Ticket | None = None) -> None:
        nonlocal counter
        counter += 1
        heapq.heappush(events, (t, counter, kind, ticket))

    def start(tickets: list[Ticket], now: float) -> None:
        for ticket in tickets:
            push(now + rng.uniform(0.5, 1.5), "done", ticket)

    push(0.0, "low")
    push(0.0, "high")
    high_waits: list[float] = []
    high_tickets: list[Ticket] = []
    while events:
        now, _, kind, ticket = heapq.heappop(events)
        if now > 300:
            break
        if kind == "done":
            assert ticket is not None
            start(q.release(ticket, now), now)
            continue
        prio = L if kind == "low" else H
        new, _ = q.offer(prio, now)
        start([new] if new.state is TicketState.ADMITTED else [], now)
        if prio is H:
            high_tickets.append(new)
        push(now + rng.expovariate(48.0 if prio is L else 3.2), kind)
    high_waits = [t.queue_wait_s for t in high_tickets if t.admitted_at is not None]
    assert len(high_waits) > 800 and q.queue_depth > 1000  # the flood really flooded
    assert float(np.percentile(high_waits, 99)) < 0.25


def test_a_request_for_several_sequences_takes_as_many_slots() -> None:
    """``n`` = 4 is four sequences in the engine: two such requests fill a limit of 8, a third waits."""
    q = _queue(limit=8, high_reserved_ratio=0.0)
    first, _ = q.offer(N, 0.0, weight=4)
    second, _ = q.offer(N, 0.0, weight=4)
    third, _ = q.offer(N, 0.0, weight=4)
    assert (first.state, second.state, third.state) == (TicketState.ADMITTED,) * 2 + (TicketState.WAITING,)
    assert q.in_flight == 8
    assert q.release(first, 0.1) == [third] and q.in_flight == 8


def test_a_request_larger_than_its_share_runs_alone_and_leaves_the_reserve() -> None:
    """A batch of 20 prompts with a limit of 10 (2 reserved for high): it takes the 8 other slots once
    they are all free, never the reserve, so high traffic still gets through beside it."""
    q = _queue(limit=10, high_reserved_ratio=0.2)
    small, _ = q.offer(N, 0.0)
    big, _ = q.offer(N, 0.0, weight=20)
    assert big.state is TicketState.WAITING
    assert q.release(small, 0.1) == [big] and big.charge == 8 and q.in_flight == 8
    high, _ = q.offer(H, 0.2)
    assert high.state is TicketState.ADMITTED and q.in_flight == 9


def test_a_heavy_request_is_not_starved_by_lighter_ones_behind_it() -> None:
    """Slots freed one at a time go to the heavy request at the head once enough are free, not to the
    single-sequence requests that arrived after it (which would otherwise refill them forever)."""
    q = _queue(limit=4, high_reserved_ratio=0.0)
    running = [q.offer(N, 0.0)[0] for _ in range(4)]
    heavy, _ = q.offer(N, 0.1, weight=3)
    light = [q.offer(N, 0.1 + i / 100)[0] for i in range(3)]
    assert q.release(running.pop(), 0.2) == []  # one free slot: the heavy one needs three
    assert q.release(running.pop(), 0.2) == []
    assert q.release(running.pop(), 0.2) == [heavy]
    assert all(t.state is TicketState.WAITING for t in light)
    assert q.release(running.pop(), 0.3) == [light[0]]


def test_a_heavy_request_of_a_higher_class_holds_back_the_lower_classes() -> None:
    q = _queue(limit=4, high_reserved_ratio=0.0, aging_s=10.0)
    running = [q.offer(N, 0.0)[0] for _ in range(3)]
    heavy_high, _ = q.offer(H, 0.1, weight=2)
    low, _ = q.offer(L, 0.1)
    assert heavy_high.state is TicketState.WAITING and low.state is TicketState.WAITING  # 1 free slot
    assert q.release(running.pop(), 0.2) == [heavy_high]
    assert low.state is TicketState.WAITING


def test_weight_must_be_positive() -> None:
    with pytest.raises(ValueError, match="weight must be >= 1"):
        _queue().offer(N, 0.0, weight=0)


def test_high_traffic_passes_a_heavy_lower_request_that_waits_for_room() -> None:
    """A heavy normal request waiting for room must not hold high traffic out of its reserve (the
    acceptance's high-priority wait under a flood of lower classes); normal traffic behind it waits."""
    q = _queue(limit=10, high_reserved_ratio=0.2, aging_s=10.0)
    running = [q.offer(N, 0.0)[0] for _ in range(7)]
    heavy, _ = q.offer(N, 0.1, weight=3)  # 7 + 3 > 8, the share normal traffic may use
    high, _ = q.offer(H, 0.2)
    normal, _ = q.offer(N, 0.3)
    assert heavy.state is TicketState.WAITING and high.state is TicketState.ADMITTED
    assert normal.state is TicketState.WAITING and q.in_flight == 8
    q.release(running.pop(), 0.4)
    assert q.release(running.pop(), 0.4) == [] and q.release(high, 0.4) == [heavy]  # 5 + 3 = 8
    assert normal.state is TicketState.WAITING
