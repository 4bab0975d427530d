"""Engine stall: requests held, no progress. A hung engine that every other check misses.

An engine can hang with its HTTP side up: a collective that never returns (one rank of a
tensor-parallel group lost), a stuck kernel, a deadlocked scheduler. Its ``/health`` and ``/metrics``
still answer (vLLM's API server runs apart from its engine core), so the pod stays ready and
``ServepilotEngineDown`` stays quiet; no request finishes, so the latency histograms and the SLO burn
rates see nothing either, and the gate's queue turns every new request into a 503. What does show it:
the engine holds requests (``requests_running`` + ``requests_waiting``) and none of the signals its step
loop moves has moved for ``stall_s``.

**Progress**, in any tick, is any of

* a token or request counter of the engine rising: ``engine.generation_tokens_per_second``,
  ``prompt_tokens_per_second``, ``decode_steps_per_second`` (llama.cpp's live step counter),
  ``requests_finished_per_second``;
* a gauge the engine sets from its step loop changing value: ``engine.kv_cache_usage_ratio``,
  ``kv_cache_used_tokens``, ``reported_generation_tokens_per_second``.

The gauges matter for SGLang and llama.cpp, whose token counters grow only when a request finishes: a
few long generations can run for minutes without a counter moving, which is not a stall. SGLang's
throughput gauge is recomputed from wall time every few dozen decode steps and never repeats a value
while it decodes; a hung engine freezes it. Each signal is judged only where the engine publishes it.
The gate's answers are not progress: they may come from another upstream (a canary's fp8, a fallback)
while this engine hangs.

**What the GPUs read** during the stall says where to look first, so the finding carries it (evidence
``gpus_busy`` / ``gpus_idle``, and a hint chosen by it):

* every GPU busy (utilisation >= 90%) while nothing progresses: kernels that never finish, typically a
  collective (NCCL) waiting for a rank that is gone, whose spin kernels keep the GPUs "busy" at low
  power; or a stuck kernel;
* every GPU idle (<= 5%): nothing was launched, so the host side is stuck (the scheduler, a Python
  deadlock, a blocking CPU-side call);
* some busy, some idle: the busy ranks wait in a collective for the idle ones, which are the suspects.

**Held** is what the engine reports running and waiting, or, where more, the requests the gate has sent
this pod's engine and had no byte of back (``gate.engine_unanswered``). vLLM counts a request only once
its engine core has it: one that reached a hung core's API server waits there unseen, and a core that hung
idle reads 0 running and 0 waiting with requests piling up at its door (seen on vLLM 0.32 with its engine
core stopped: the gate held 2 requests there, vLLM read 0 and 0). A request still streaming is not
counted from the gate: an engine finishes an answer before a slow client has read it.

A tick without the engine's reading (a failed scrape) neither starts nor ends a stall: that is
``ServepilotEngineDown``'s case. No warm-up, no learning: a stall is a fact, not an anomaly score, and
``stall_s`` (60 s by default) is far longer than any step of a healthy engine, a long prompt's prefill
included (chunked prefill emits decode tokens in between).

**Only watched stillness counts.** When no tick at all came for a while (the sidecar was not scheduled:
a node that stalled, a VM paused for a live migration, a blocked event loop), the count starts again at
the next tick: what happened in the gap was not seen, and an engine on the same node was paused with it,
so it made no progress either. Seen on a 2-core VM: the whole machine unscheduled for up to 5.9 s. A gap
is blind when it is longer than ``stall_s / 2`` and 2.5 times the shortest gap between ticks seen (so a
60 s tick interval is not blind in itself): at the usual 1 s tick, a verdict rests on at least
``stall_s / 2`` of watched stillness. A restart of the sidecar starts the count afresh as well. The
gate counts an upstream's silence the same way (agent/gate/ejection.py).
"""

from __future__ import annotations

from detectors.base import Finding, Severity
from detectors.snapshot import Snapshot

#: Counter rates that rise only when the engine makes progress.
PROGRESS_RATES = (
    "engine.generation_tokens_per_second",
    "engine.prompt_tokens_per_second",
    "engine.decode_steps_per_second",
    "engine.requests_finished_per_second",
)
#: Gauges the engine sets from its step loop: a new value is progress, an unchanged one says nothing.
PROGRESS_GAUGES = (
    "engine.kv_cache_usage_ratio",
    "engine.kv_cache_used_tokens",
    "engine.reported_generation_tokens_per_second",
)
HELD = ("engine.requests_running", "engine.requests_waiting")
ENGINE_UNANSWERED = "gate.engine_unanswered"
"""Requests the gate in front of this pod's engine has sent it and had no byte of back: held by the engine
even where its metrics do not count them yet (see the module)."""
BUSY_RATIO = 0.9
"""A GPU at or above this utilisation has a kernel resident all the time."""
IDLE_RATIO = 0.05
"""A GPU at or below this utilisation runs nothing."""
MAX_GPUS = 64
BLIND_TICKS = 2.5
"""A gap between ticks this many times the usual one (and over half of ``stall_s``) was not watched."""
CAUSE = {
    "busy": "Its GPUs read busy while nothing progresses: kernels that never finish, typically a "
    "collective (NCCL) waiting for a rank that is gone, or a stuck kernel. Look for NCCL watchdog "
    "timeouts in the engine log and GPU Xid errors in the node's kernel log (dmesg).",
    "idle": "Its GPUs are idle: nothing was launched, so the host side is stuck (the scheduler, a Python "
    "deadlock, a blocking CPU-side call). A stack dump (py-spy dump --pid <engine pid>) shows where "
    "it waits.",
    "mixed": "GPU(s) {busy} read busy while GPU(s) {idle} are idle: the busy ranks wait in a collective "
    "for the idle ones. Look at the idle GPUs first: their rank's process, and Xid errors for them (dmesg).",
    "unknown": "A hung collective (NCCL; one tensor-parallel rank lost), a stuck kernel or a deadlocked "
    "scheduler. Take a stack dump (py-spy dump --pid <engine pid>) and check the kernel log for GPU Xid "
    "errors (dmesg).",
}
AFTER = (
    " Then restart the engine: a hung engine does not recover by itself. Meanwhile the sidecar's /readyz "
    "answers 503, so the Service sends new requests to other replicas."
)


class EngineStallDetector:
    """Finds an engine that holds requests and has made no progress for ``stall_s`` seconds."""

    name = "engine_stall"

    def __init__(self, stall_s: float = 60.0) -> None:
        if stall_s <= 0:
            raise ValueError(f"stall_s must be > 0, got {stall_s}")
        self.stall_s = stall_s
        self.last_progress_: float | None = None
        self.gauges_: dict[str, float] = {}
        self.last_tick_: float | None = None
        #: The shortest gap between two ticks seen: about the loop's interval.
        self.tick_s_: float | None = None

    def _blind(self, now: float) -> bool:
        """True when no tick came for longer than the loop could have been watching (see the module)."""
        last, self.last_tick_ = self.last_tick_, now
        if last is None or now <= last:
            return False
        gap = now - last
        shortest = self.tick_s_ = gap if self.tick_s_ is None else min(self.tick_s_, gap)
        return gap > max(self.stall_s / 2, BLIND_TICKS * shortest)

    def update(self, snapshot: Snapshot) -> list[Finding]:
        """Progress this tick moves the mark; an idle engine moves it too; a stall is time since the mark."""
        if self._blind(snapshot.now):
            self.last_progress_ = snapshot.now  # nothing before the blind gap counts
        held_parts = [v for v in (snapshot.get(name) for name in HELD) if v is not None]
        if not held_parts:  # no reading from the engine this tick: no verdict either way
            return []
        held = max(sum(held_parts), snapshot.get(ENGINE_UNANSWERED) or 0.0)
        moved = self._gauges_moved(snapshot)
        rising = any((snapshot.get(name) or 0.0) > 0 for name in PROGRESS_RATES)
        if held <= 0 or rising or moved or self.last_progress_ is None:
            self.last_progress_ = snapshot.now
            return []
        still = snapshot.now - self.last_progress_
        if still < self.stall_s:
            return []
        evidence: dict[str, float | str] = {"requests_held": held, "seconds_without_progress": still}
        cause = gpu_picture(snapshot, evidence)
        busy, idle = evidence.get("gpus_busy", ""), evidence.get("gpus_idle", "")
        return [
            Finding(
                detector=self.name,
                signal="engine.requests_running",
                severity=Severity.CRITICAL,
                score=1.0,
                summary=f"engine stalled: {held:.0f} request(s) held, no progress for {still:.0f}s",
                since=self.last_progress_,  # the episode began at the last progress seen
                evidence=evidence,
                hint="The engine holds requests and makes no progress while its HTTP server answers. "
                + CAUSE[cause].format(busy=busy, idle=idle)
                + AFTER,
            )
        ]

    def _gauges_moved(self, snapshot: Snapshot) -> bool:
        moved = False
        for name in PROGRESS_GAUGES:
            value = snapshot.get(name)
            if value is None:
                continue
            last = self.gauges_.get(name)
            if last is not None and value != last:
                moved = True
            self.gauges_[name] = value
        return moved


def gpu_picture(snapshot: Snapshot, evidence: dict[str, float | str]) -> str:
    """``busy``, ``idle``, ``mixed`` or ``unknown`` (no GPU reading, or utilisations in between), from this
    tick's mean utilisation of each GPU; adds the busy and idle GPU indices to ``evidence``."""
    busy: list[str] = []
    idle: list[str] = []
    seen = 0
    for i in range(MAX_GPUS):
        util = snapshot.get(f"nvml.gpu{i}.utilization_ratio.mean")
        if util is None:
            continue
        seen += 1
        if util >= BUSY_RATIO:
            busy.append(str(i))
        elif util <= IDLE_RATIO:
            idle.append(str(i))
    if busy:
        evidence["gpus_busy"] = ",".join(busy)
    if idle:
        evidence["gpus_idle"] = ",".join(idle)
    if not seen or len(busy) + len(idle) < seen:
        return "unknown"
    if busy and idle:
        return "mixed"
    return "busy" if busy else "idle"
