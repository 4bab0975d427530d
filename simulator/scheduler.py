"""Continuous batching with chunked prefill and recompute preemption, after vLLM V1's scheduler.

Each step has a token budget (``max_num_batched_tokens``). Running requests are served first, oldest
first: a decoding request takes 1 token, a request still in prefill takes the rest of its prompt up to
the budget (chunked prefill). When the KV pool cannot hold a running request's next tokens, the youngest
running request is preempted (its blocks freed, its progress discarded, put back at the head of the
queue to be recomputed); if the youngest is the request itself, it is preempted. Only when nothing was
preempted are waiting requests admitted, first come first served, while fewer than ``max_num_seqs`` run,
budget remains and their first chunk's blocks fit.

With ``policy="priority"`` (vLLM's ``--scheduling-policy priority``) each request carries an integer
``priority``, lower first: the queue is ordered by (priority, arrival), a preempted request goes back
into it by that order, and the victim of a preemption is the running request that is last by it (the
lowest priority, the youngest among equals) rather than the youngest. As in vLLM, a waiting request of
high priority does not preempt running ones to get in; it is only the next admitted.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from simulator.kvcache import BLOCK_SIZE, BlockPool, blocks_for

Policy = Literal["fcfs", "priority"]
POLICIES: tuple[Policy, ...] = ("fcfs", "priority")


class Request:
    """One request's progress. ``computed`` tokens have KV in the cache; the sequence is the prompt plus
    ``output`` generated tokens, and a token is emitted each time ``computed`` reaches its length."""

    __slots__ = (
        "arrival",
        "blocks",
        "computed",
        "first_scheduled",
        "first_token",
        "last_token",
        "max_tokens",
        "output",
        "preemptions",
        "priority",
        "prompt",
        "rid",
    )

    def __init__(self, rid: str, prompt: int, max_tokens: int, arrival: float, priority: int = 0) -> None:
        self.rid = rid
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.arrival = arrival
        self.priority = priority
        self.output = 0
        self.computed = 0
        self.blocks = 0
        self.preemptions = 0
        self.first_scheduled = -1.0
        self.first_token = -1.0
        self.last_token = arrival

    @property
    def seq_len(self) -> int:
        return self.prompt + self.output

    @property
    def rank(self) -> tuple[int, float]:
        """Its place under the priority policy: lower priority value first, then earlier arrival."""
        return self.priority, self.arrival

    @property
    def decoding(self) -> bool:
        """True when the next step for this request is a one-token decode."""
        return self.computed == self.prompt + self.output - 1


@dataclass
class Schedule:
    """What one step runs: ``(request, new tokens)`` pairs, and who was preempted to make room."""

    items: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    #: True when a waiting request could not be admitted for lack of KV blocks or sequence slots (as
    #: opposed to lack of token budget): decoding alone cannot change that, so steps may be coalesced.
    waiting_blocked: bool = True
    num_tokens: int = 0


class Scheduler:
    """Queues and the block pool; ``schedule(now)`` decides one step."""

    def __init__(
        self,
        pool: BlockPool,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        block_size: int = BLOCK_SIZE,
        policy: Policy = "fcfs",
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = block_size
        self.policy = policy
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        if self.policy == "fcfs":
            self.waiting.append(request)
        else:
            self._insert(request)

    def _insert(self, request: Request) -> None:
        """Into the waiting queue by rank, after the requests of equal rank (the priority policy)."""
        self.waiting.insert(bisect.bisect_right(self.waiting, request.rank, key=_rank), request)

    def _victim_at(self) -> int:
        """Where in ``running`` a preemption takes its victim: the youngest (the end), or under the
        priority policy the last by rank (the lowest priority, the youngest among equals)."""
        running = self.running
        if self.policy == "fcfs":
            return len(running) - 1
        return max(range(len(running)), key=lambda j: running[j].rank)

    def _preempt(self, victim: Request) -> None:
        self.pool.release(victim.blocks)
        victim.blocks = 0
        victim.computed = 0
        victim.preemptions += 1
        if self.policy == "fcfs":
            self.waiting.appendleft(victim)
        else:
            self._insert(victim)

    def schedule(self, now: float) -> Schedule:
        """Pick this step's work. Mutates block ownership and the queues, not request progress."""
        out = Schedule()
        budget = self.max_num_batched_tokens
        running, pool, bs = self.running, self.pool, self.block_size
        i = 0
        items = out.items
        append = items.append
        # ``free`` mirrors ``pool.num_blocks - pool.used`` in a local (this loop runs for every running
        # request at every step, the replay's hottest code); the pool is written back before anything
        # else reads it.
        free = pool.num_blocks - pool.used
        taken = 0
        while i < len(running) and budget > 0:
            req = running[i]
            computed = req.computed
            left = req.prompt + req.output - computed
            num_new = left if left < budget else budget
            need = -(-(computed + num_new) // bs) - req.blocks
            if need > free:
                pool.used += taken
                taken = 0
                self_preempted = False
                while need > pool.num_blocks - pool.used:
                    at = self._victim_at()
                    victim = running.pop(at)
                    if at < i:  # scheduled earlier in this step (priority policy): its tokens go back
                        i -= 1
                        j = next(k for k, (r, _) in enumerate(items) if r is victim)
                        budget += items.pop(j)[1]
                    self._preempt(victim)
                    out.preempted.append(victim)
                    if victim is req:
                        self_preempted = True
                        break
                free = pool.num_blocks - pool.used
                if self_preempted:
                    break
            free -= need
            taken += need
            req.blocks += need
            append((req, num_new))
            budget -= num_new
            i += 1
        pool.used += taken
        if out.preempted:
            out.num_tokens = self.max_num_batched_tokens - budget
            return out
        waiting = self.waiting
        while waiting and len(running) < self.max_num_seqs:
            if budget <= 0:
                out.waiting_blocked = False
                break
            req = waiting[0]
            num_new = min(req.prompt + req.output - req.computed, budget)
            need = blocks_for(req.computed + num_new, bs) - req.blocks
            if not pool.allocate(need):
                break
            req.blocks += need
            waiting.popleft()
            running.append(req)
            if req.first_scheduled < 0:
                req.first_scheduled = now
            items.append((req, num_new))
            budget -= num_new
        out.num_tokens = self.max_num_batched_tokens - budget
        return out

    def shrink_to_fit(self) -> list[Request]:
        """Preempt the youngest running requests until the pool's used blocks fit its (new) size."""
        preempted: list[Request] = []
        while self.pool.used > self.pool.num_blocks and self.running:
            victim = self.running.pop(self._victim_at())
            self._preempt(victim)
            preempted.append(victim)
        return preempted

    def remove(self, rid: str) -> Request | None:
        """Take a request out wherever it is (an abort), freeing its blocks."""
        for queue in (self.running, self.waiting):
            for req in queue:
                if req.rid == rid:
                    queue.remove(req)
                    self.pool.release(req.blocks)
                    req.blocks = 0
                    return req
        return None


def _rank(request: Request) -> tuple[int, float]:
    return request.rank
