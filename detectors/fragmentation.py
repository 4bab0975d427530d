r"""Fragmentation detector: memory that is reserved or allocated but holds nothing useful.

Two kinds, each a ratio of wasted to held memory in [0, 1]:

* **Allocator** (PyTorch's caching allocator, seen by the allocator probe), per device or in total:

  .. math:: f_\text{alloc} = 1 - \frac{\text{allocated}}{\text{reserved}}

  from ``probe[.device<i>].allocated_bytes`` / ``reserved_bytes``, or
  ``probe[.device<i>].fragmentation_ratio`` when the probe computes it itself. Skipped while
  ``reserved`` is below ``min_reserved_bytes`` (a small pool makes the ratio meaningless).

* **KV cache** (paged attention), where the engine exposes enough to derive it:

  .. math:: f_\text{kv} = 1 - \frac{\text{tokens held}}{u \cdot C}

  with :math:`u` = ``engine.kv_cache_usage_ratio`` (blocks in use / blocks), :math:`C` =
  ``engine.kv_cache_capacity_tokens`` (blocks x block size) and tokens held =
  ``engine.kv_cache_tokens_held``. Internal fragmentation of the last block of each sequence is the usual
  cause; it is large when block size is large relative to sequence length.

A finding is raised when the ratio is above ``threshold`` (15%) in ``k`` of the last ``n`` ticks; it is
critical at twice the threshold. The evidence carries the trend: the least-squares slope of the ratio
over the last ``trend_window_s`` (per hour) and a label (rising / falling / flat at +/- 1 point per hour).
"""

from __future__ import annotations

import re
from collections import deque
from functools import partial

import numpy as np

from detectors.base import Finding, Severity
from detectors.domain_util import KOfN, LastHit, PerNameSet
from detectors.snapshot import Snapshot

_DEVICE = re.compile(r"^probe\.device(\d+)\.reserved_bytes$")


def _allocators(snapshot: Snapshot) -> list[tuple[str, str, str]]:
    """Per allocator (the whole probe, then each device): its reserved, allocated and ratio names.
    Recomputed only when the name set changes (:class:`~detectors.domain_util.PerNameSet`)."""
    prefixes = ["probe"] + [
        f"probe.device{m.group(1)}" for name in snapshot.values if (m := _DEVICE.match(name))
    ]
    return [(f"{p}.reserved_bytes", f"{p}.allocated_bytes", f"{p}.fragmentation_ratio") for p in prefixes]


class _Track:
    def __init__(self, k: int, n: int, points: int) -> None:
        self.gate = KOfN(k, n)
        self.shown = LastHit()
        self.history: deque[tuple[float, float]] = deque(maxlen=points)


class FragmentationDetector:
    """Allocator and KV-cache fragmentation above ``threshold``, with its trend."""

    name = "fragmentation"

    def __init__(
        self,
        threshold: float = 0.15,
        min_reserved_bytes: float = 256.0 * (1 << 20),
        min_kv_usage: float = 0.05,
        trend_window_s: float = 1800.0,
        trend_every_s: float = 10.0,
        k: int = 3,
        n: int = 5,
    ) -> None:
        self.threshold = threshold
        self.min_reserved_bytes = min_reserved_bytes
        self.min_kv_usage = min_kv_usage
        self.trend_window_s = trend_window_s
        self.trend_every_s = trend_every_s
        self.k = k
        self.n = n
        self.tracks_: dict[str, _Track] = {}
        self._allocators = PerNameSet(_allocators)

    def update(self, snapshot: Snapshot) -> list[Finding]:
        """Check every derivable ratio at this tick against the threshold, then record it for the trend."""
        findings: list[Finding] = []
        for signal, ratio, evidence, kind in self._ratios(snapshot):
            track = self.tracks_.get(signal)
            if track is None:
                points = int(self.trend_window_s / self.trend_every_s) + 1
                track = self.tracks_[signal] = _Track(self.k, self.n, points)
            hit = ratio > self.threshold
            active = track.gate.push(hit, snapshot.now)
            if active:
                build = partial(self._finding, track, snapshot.now, signal, kind, ratio, evidence)
                findings.append(track.shown.show(track.gate, hit, build, f"{ratio:.0%}"))
            else:
                track.shown.clear()
            if not track.history or snapshot.now - track.history[-1][0] >= self.trend_every_s:
                track.history.append((snapshot.now, ratio))
        return findings

    def _ratios(self, snapshot: Snapshot) -> list[tuple[str, float, dict[str, float | str], str]]:
        out: list[tuple[str, float, dict[str, float | str], str]] = []
        values = snapshot.values
        for reserved_name, allocated_name, signal in self._allocators(snapshot):
            reserved = values.get(reserved_name)
            allocated = values.get(allocated_name)
            direct = values.get(signal)
            if reserved is not None and reserved < self.min_reserved_bytes:
                continue
            if allocated is not None and reserved is not None and reserved > 0:
                ratio = 1.0 - allocated / reserved
                evidence: dict[str, float | str] = {
                    "allocated_bytes": allocated,
                    "reserved_bytes": reserved,
                    "wasted_bytes": reserved - allocated,
                }
            elif direct is not None:
                ratio, evidence = direct, {}
            else:
                continue
            out.append((signal, min(1.0, max(0.0, ratio)), evidence, "allocator"))
        usage = snapshot.get("engine.kv_cache_usage_ratio")
        capacity = snapshot.get("engine.kv_cache_capacity_tokens")
        held = snapshot.get("engine.kv_cache_tokens_held")
        if usage is not None and capacity and held is not None and usage >= self.min_kv_usage:
            in_blocks = usage * capacity
            ratio = min(1.0, max(0.0, 1.0 - held / in_blocks))
            evidence = {"kv_usage_ratio": usage, "tokens_in_blocks": in_blocks, "tokens_held": held}
            out.append(("engine.kv_cache_fragmentation_ratio", ratio, evidence, "kv"))
        return out

    def _slope_per_hour(self, track: _Track, now: float, ratio: float) -> float:
        points = [(t, r) for t, r in track.history if now - t <= self.trend_window_s] + [(now, ratio)]
        if len(points) < 3:
            return 0.0
        t = np.array([p[0] for p in points]) - now
        if float(np.ptp(t)) <= 0:
            return 0.0
        return float(np.polyfit(t / 3600.0, np.array([p[1] for p in points]), 1)[0])

    def _finding(
        self,
        track: _Track,
        now: float,
        signal: str,
        kind: str,
        ratio: float,
        evidence: dict[str, float | str],
    ) -> Finding:
        slope_h = self._slope_per_hour(track, now, ratio)
        since = track.gate.since(now)
        trend = "rising" if slope_h > 0.01 else "falling" if slope_h < -0.01 else "flat"
        severity = Severity.CRITICAL if ratio >= 2 * self.threshold else Severity.WARNING
        if kind == "allocator":
            what = "allocator memory reserved but not allocated"
            hint = (
                "The caching allocator keeps freed blocks it cannot reuse: try "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, fewer distinct batch shapes "
                "(CUDA graphs), or a lower gpu_memory_utilization to leave room."
            )
        else:
            what = "KV-cache blocks in use but not holding tokens"
            hint = (
                "Partly filled KV blocks: a smaller block size suits short requests; check prefix-cache "
                "eviction and preemption churn."
            )
        return Finding(
            detector=self.name,
            signal=signal,
            severity=severity,
            score=ratio / (2 * self.threshold),
            summary=f"{ratio:.0%} {what} (threshold {self.threshold:.0%}), {trend} {slope_h:+.1%}/h",
            since=since,
            evidence={**evidence, "ratio": ratio, "trend_per_hour": slope_h, "trend": trend},
            hint=hint,
        )
