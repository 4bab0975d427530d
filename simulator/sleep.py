"""vLLM-style sleep mode for the simulated engine, with a modelled wake-up delay. Pure; time passed in.

vLLM's sleep mode (dev endpoints ``POST /sleep``, ``POST /wake_up``, ``GET /is_sleeping``) offloads or
discards the weights and frees the KV cache, so the GPU can idle cheaply; waking reloads the weights,
which takes seconds to minutes depending on model size and level (level 1 keeps weights in CPU memory,
level 2 discards them). The simulator models the reload as a fixed ``wake_delay_s`` during which the
engine answers 503, like an engine that is still loading. Sleeping with requests in flight is refused
(409): the engine would drop them.
"""

from __future__ import annotations

from dataclasses import dataclass


class SleepRefused(RuntimeError):
    """Sleep asked for while requests are in flight."""


@dataclass
class SleepModel:
    """``asleep`` from :meth:`sleep` until :meth:`wake_up`; then ``waking`` for ``wake_delay_s``."""

    wake_delay_s: float = 20.0
    asleep: bool = False
    ready_at: float = 0.0  # when the last wake-up completes
    sleeps: int = 0

    def sleep(self, in_flight: int, now: float) -> None:
        """Put the engine to sleep; :class:`SleepRefused` while ``in_flight`` > 0."""
        if in_flight > 0:
            raise SleepRefused(f"{in_flight} request(s) in flight: refusing to sleep")
        if not self.asleep:
            self.asleep = True
            self.sleeps += 1

    def wake_up(self, now: float) -> float:
        """Start waking (idempotent); returns the time the engine is ready."""
        if self.asleep:
            self.asleep = False
            self.ready_at = now + self.wake_delay_s
        return self.ready_at

    def is_sleeping(self, now: float) -> bool:
        """True while asleep or still reloading: the engine cannot serve."""
        return self.asleep or now < self.ready_at
