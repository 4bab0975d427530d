"""Names and safe bounds of the knobs policies propose values for (data, shared with the actuators).

``batch.max_in_flight`` is the effective batch: the admission gate's in-flight limit (and the engine's
``max_num_seqs`` where a control adapter allows it). ``route.upstream`` picks the deployment that serves
traffic (``primary``, the ``fp8`` variant, or the ``small`` model); ``route.fp8_share`` is the share of
traffic a precision canary sends to the fp8 upstream. ``engine.max_num_batched_tokens`` is the engine's
chunked-prefill token budget per step, a knob only where the engine's control API offers it (the
simulator does; released vLLM and SGLang cannot change it at run time); the same name is the signal the
engine's current value is published under.
"""

from __future__ import annotations

import math

BATCH = "batch.max_in_flight"
SM_CLOCK = "gpu.sm_clock_mhz"
POWER_LIMIT = "gpu.power_limit_w"
#: The GPU knob each ``actuators.gpu`` setting drives (the actuator binds it, the energy policy proposes it).
GPU_KNOB = {"power_limit": POWER_LIMIT, "locked_clocks": SM_CLOCK}
UPSTREAM = "route.upstream"
FP8_SHARE = "route.fp8_share"
TOKEN_BUDGET = "engine.max_num_batched_tokens"
#: The admission gate's queue deadline: a request not admitted within it is answered 503.
QUEUE_WAIT = "gate.max_queue_wait_s"

UPSTREAMS: tuple[str, ...] = ("primary", "fp8", "small")
#: ``route.upstream``'s value for "the configured split" (``gate.split``): the breaker's L0 and L1 give
#: routing back to it rather than to ``primary``, so an operator's own split survives a calm breaker.
DEFAULT_ROUTE = "default"

#: Knobs that are two names for one piece of state: both routing knobs set the gate's traffic split. The
#: arbiter lets only the highest class's proposal in each group stand (see policies/arbiter.py).
LINKED: tuple[frozenset[str], ...] = (frozenset({UPSTREAM, FP8_SHARE}),)

#: Signals the policies read (published by the collectors, the gate and the replay alike).
RUNNING = "engine.requests_running"
WAITING = "engine.requests_waiting"
#: The most requests the engine runs at once, where it says so: llama.cpp's slots (its ``/slots``).
ENGINE_SLOTS = "engine.slots_total"
KV_USAGE = "engine.kv_cache_usage_ratio"
PREEMPTIONS = "engine.preemptions_per_second"
FINISHED = "engine.requests_finished_per_second"
GEN_TPS = "engine.generation_tokens_per_second"
PROMPT_TPS = "engine.prompt_tokens_per_second"
#: What the steps compute of the prompt tokens, less the prefix cache's hits (vLLM; llama.cpp's prompt
#: counter excludes its cache hits already).
PROMPT_COMPUTED_TPS = "engine.prompt_tokens_computed_per_second"
TTFT_P99 = "engine.ttft_seconds.p99"
ITL_P99 = "engine.itl_seconds.p99"
ITL_MEAN = "engine.itl_seconds.mean"
GPU_UTIL = "nvml.gpu0.utilization_ratio.mean"
MEM_BW_UTIL = "nvml.gpu0.memory_bandwidth_utilization_ratio.mean"
SM_CLOCK_HZ = "nvml.gpu0.sm_clock_hz.mean"
MEMORY_USED = "nvml.gpu0.memory_used_bytes"
MEMORY_TOTAL = "nvml.gpu0.memory_total_bytes"
GATE_LIMIT = "gate.limit"
GATE_QUEUE = "gate.queue_depth"
#: Requests the gate has sent upstream and not yet seen answered (running or queued in the engine).
GATE_IN_FLIGHT = "gate.in_flight"
#: Slots of the gate's limit only high-priority requests may take (the rest of the traffic sees L - R).
GATE_RESERVED = "gate.reserved"
#: Requests answered in the tick, and how many of them met the latency SLO / got a 5xx.
GATE_REQUESTS = "gate.requests"
GATE_SLO_BAD = "gate.slo_bad"
GATE_ERRORS = "gate.errors"
#: Requests at an upstream now that will miss the latency SLO whatever comes next (no first token past the
#: TTFT SLO, or decoding past what the ITL SLO allows for their max_tokens): SLO-bad answers to come.
GATE_LATE = "gate.late"


def upstream_signal(upstream: str, what: str) -> str:
    """``gate.upstream.<name>.<what>``: per upstream, this tick's ``requests``, ``errors`` and ``slo_bad``
    (the answers it gave, after failover), ``up`` (1 while its health check passes) and ``late`` (the
    requests it holds now that will miss the latency SLO: a level, see :data:`GATE_LATE`)."""
    return f"gate.upstream.{upstream}.{what}"


def class_signal(priority: str, what: str) -> str:
    """``gate.class.<priority>.<what>``: per priority class (``high``, ``normal``, ``low``), this tick's
    ``requests`` (answers) and ``slo_bad`` (the answers that missed that class's own targets)."""
    return f"gate.class.{priority}.{what}"


#: The classes :func:`class_signal` names.
CLASSES = ("high", "normal", "low")


def clamp(value: float, lower: float, upper: float) -> float:
    """``min(upper, max(lower, value))``: every policy ends with it."""
    return min(upper, max(lower, value))


def out_of_range(knob: str, value: object, lower: float, upper: float) -> str | None:
    """Why ``value`` cannot be set on ``knob`` whose range is ``[lower, upper]`` (None when it can): what
    an operator's pin is checked against, for the arbiter's bounds and an actuator's own range alike."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return f"{knob} takes a number, got {value!r}"
    if not lower <= value <= upper:
        return f"{knob} must be in [{lower:g}, {upper:g}], got {value:g}"
    return None
