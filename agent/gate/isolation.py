"""Long-request isolation: prompts over a length threshold go to a dedicated long-context pool.

Why: a 6k-token prefill occupies the engine for a whole step budget (``max_num_batched_tokens``) and
pushes every short request queued behind it back by that much. Sending long prompts to their own
upstream, behind their own in-flight limit and queue, stops them from inflating everyone's tail (the
replay in :mod:`agent.gate.levers_replay` measures the effect on the Azure 2023 code trace).

The rule is pure: ``is_long(prompt_tokens)`` compares the gate's estimate (4 bytes of UTF-8 per token,
or the exact count for token-id prompts) with ``threshold_tokens``. A long request waits in the lane's own
:class:`AdmissionQueue` (same priority, reserve and aging rules as the main queue) and is sent to the
lane's upstream first, the others only as failover. Off when ``threshold_tokens`` is 0.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from agent.config import GateConfig
from agent.gate.admission import AdmissionQueue


class IsolationLane:
    """The long-context lane: a threshold, the pool's upstream name and its own admission queue."""

    def __init__(self, cfg: GateConfig, registry: CollectorRegistry) -> None:
        if cfg.isolation_threshold_tokens <= 0:
            raise ValueError("isolation is off (isolation_threshold_tokens is 0)")
        self.threshold_tokens = cfg.isolation_threshold_tokens
        self.upstream = cfg.isolation_upstream
        self.admission = AdmissionQueue(
            cfg.isolation_max_in_flight,
            cfg.isolation_queue_size,
            high_reserved_ratio=cfg.high_reserved_ratio,
            aging_s=cfg.aging_s,
            max_wait_s=cfg.max_queue_wait_s,
        )
        self.routed = Counter(
            "servepilot_gate_isolation_requests",
            "Requests routed to the long-context pool.",
            registry=registry,
        )
        in_flight = Gauge(
            "servepilot_gate_isolation_in_flight", "Long requests upstream now.", registry=registry
        )
        queue = Gauge(
            "servepilot_gate_isolation_queue_depth", "Long requests waiting for admission.", registry=registry
        )
        limit = Gauge(
            "servepilot_gate_isolation_limit", "In-flight limit of the long pool.", registry=registry
        )
        threshold = Gauge(
            "servepilot_gate_isolation_threshold_tokens", "Prompt length routed to the long pool.",
            registry=registry,
        )  # fmt: skip
        in_flight.set_function(lambda: self.admission.in_flight)
        queue.set_function(lambda: self.admission.queue_depth)
        limit.set_function(lambda: self.admission.limit)
        threshold.set_function(lambda: self.threshold_tokens)

    def is_long(self, prompt_tokens: float) -> bool:
        """True when a prompt of ``prompt_tokens`` (the gate's estimate) belongs in the long pool."""
        return prompt_tokens >= self.threshold_tokens

    def values(self) -> dict[str, float]:
        """Flat signals: ``gate.isolation.{in_flight,queue_depth,limit}``."""
        return {
            "gate.isolation.in_flight": float(self.admission.in_flight),
            "gate.isolation.queue_depth": float(self.admission.queue_depth),
            "gate.isolation.limit": float(self.admission.limit),
        }
