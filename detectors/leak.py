r"""Memory staircase (leak) detector: GPU memory that grows in steps and is not given back.

Which series it watches (each independently):

* ``nvml.gpu<i>.process_used_bytes.pid<pid>`` — what the driver charges to one process;
* ``nvml.gpu<i>.memory_used_bytes`` — the whole device;
* ``probe.reserved_bytes`` and ``probe.device<i>.reserved_bytes`` — the caching allocator's reservation.

The model. Memory legitimately follows load (activations, KV blocks, allocator caches), so a rising series
is not a leak by itself. Over a bounded window of one-minute buckets the detector models

.. math::
    m_t = a + \sum_k b_k \, \ell_{k,t} + \text{leak}(t) + \varepsilon_t

where :math:`\ell_k` are the load signals (running requests, KV-cache usage). The coefficients
:math:`b_k` are fitted by least squares on bucket-to-bucket *differences*
:math:`\Delta m = \sum_k b_k \Delta\ell_k`, trimmed once at 3 robust sigmas: differencing removes the slow
leak (which would otherwise be explained away as load on a morning ramp) and trimming drops its steps.
The *load-adjusted* series
:math:`r_t = m_t - \sum_k b_k \ell_{k,t}` is what a leak moves. Its trend is the Theil-Sen slope
:math:`\hat c` (median of pairwise slopes, robust to the steps themselves and to bursts) with Sen's 95%
interval. (The rate used for the forecast below is the steeper of this and the Theil-Sen slope of
the window's recent half, since a leak that began mid-window is diluted over the whole window.)
A leak is declared when

1. the interval's lower end is above zero (the growth is real, not noise);
2. the load-adjusted growth over the window, :math:`\mathrm{med}(r_{\text{last }20\%}) -
   \mathrm{med}(r_{\text{first }25\%})`, exceeds ``min_growth_ratio`` of device memory (and 4 noise
   sigmas, :math:`\sigma = 1.4826\,\mathrm{MAD}(\Delta r)/\sqrt2`); and
3. it was not released: the latest level is within half the growth of the window's peak level.

Steps are located on :math:`r` by a level tracker (a shift of a 3-bucket median by more than
:math:`\max(4\sigma, \text{min\_step\_ratio} \cdot M)`); each is reported with its time, size and
whether load was stable across it (relative change of load below ``stable_load_tolerance``).

Time to exhaustion. With :math:`M` the device total, the usage at peak load is the current level plus
the largest load-driven term seen in the window, and

.. math::
    \mathrm{TTE} = \frac{M - (r_{\text{now}} + \max_t \textstyle\sum_k b_k \ell_{k,t})}{\hat c}.

Severity: critical under ``critical_tte_s`` (4 h), warning under ``warning_tte_s`` (24 h), info beyond.
Without a known total (no ``nvml.gpu<i>.memory_total_bytes`` and no ``memory_total_bytes`` parameter) the
growth threshold is ``min_growth_bytes`` and the finding is a warning without a TTE.
Without any load signal the detector stays silent (``require_load``): it cannot tell a leak from load.
"""

from __future__ import annotations

import math
import re
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from detectors.base import Finding, Severity
from detectors.domain_util import FloatArray, PerNameSet, robust_slope
from detectors.snapshot import Snapshot

_SERIES = re.compile(
    r"^(?:nvml\.gpu(?P<gpu>\d+)\.(?:process_used_bytes\.pid\d+|memory_used_bytes)"
    r"|probe\.(?:device(?P<dev>\d+)\.)?reserved_bytes)$"
)


def _watched(snapshot: Snapshot) -> list[tuple[str, str]]:
    """The memory series of ``snapshot``, each with the name of its device's total memory signal."""
    out = []
    for name in snapshot.values:
        match = _SERIES.match(name)
        if match is not None:
            gpu = match.group("gpu") or match.group("dev") or "0"
            out.append((name, f"nvml.gpu{gpu}.memory_total_bytes"))
    return out


_GIB = float(1 << 30)
_MIB = float(1 << 20)


@dataclass
class _Bucket:
    start: float
    n: int = 0
    mem_sum: float = 0.0
    load_sum: list[float] = field(default_factory=list)
    load_n: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Step:
    """One upward shift of the load-adjusted memory level."""

    at: float
    size_bytes: float
    stable_load: bool


_ANALYSIS_PHASES = 8


class _Series:
    """Per-series state: the open bucket, the closed buckets of the window and the last verdict."""

    def __init__(self, n_load: int) -> None:
        self.n_load = n_load
        self.open: _Bucket | None = None
        self.buckets: deque[tuple[float, float, tuple[float, ...]]] = deque()
        self.last_seen = -math.inf
        self.last_analysis = -math.inf
        self.finding: Finding | None = None
        self.since: float | None = None


def _load_coefficients(dload: FloatArray, dmem: FloatArray) -> FloatArray:
    """Bytes per unit of each load signal, from bucket-to-bucket *differences*, trimmed.

    Differencing removes the slow trend (the leak must not be explained away as load when both rise
    together, as they do on a morning ramp); a leak's steps are rare large differences, so one trimming
    pass at 3 robust sigmas keeps them from biasing the coefficient.
    """
    if dload.size == 0:
        return np.zeros(dload.shape[1] if dload.ndim == 2 else 0)
    coef, *_ = np.linalg.lstsq(dload, dmem, rcond=None)
    err = dmem - dload @ coef
    scale = 1.4826 * float(np.median(np.abs(err - np.median(err)))) + 1e-9
    keep = np.abs(err - np.median(err)) <= 3 * scale
    if keep.sum() > dload.shape[1] + 2:
        coef, *_ = np.linalg.lstsq(dload[keep], dmem[keep], rcond=None)
    return np.asarray(coef, dtype=np.float64)


class MemoryLeakDetector:
    """Finds step-wise GPU memory growth not explained by load; see the module docstring for the math."""

    name = "memory_leak"

    def __init__(
        self,
        load_signals: tuple[str, ...] = ("engine.requests_running", "engine.kv_cache_usage_ratio"),
        bucket_s: float = 60.0,
        window_s: float = 2 * 3600.0,
        min_window_s: float = 1800.0,
        analyse_every_s: float = 120.0,
        min_growth_ratio: float = 0.004,
        min_growth_bytes: float = 256 * _MIB,
        min_step_ratio: float = 0.0005,
        stable_load_tolerance: float = 0.2,
        warning_tte_s: float = 24 * 3600.0,
        critical_tte_s: float = 4 * 3600.0,
        memory_total_bytes: float | None = None,
        require_load: bool = True,
        max_series: int = 64,
    ) -> None:
        self.load_signals = load_signals
        self.bucket_s = bucket_s
        self.window_s = window_s
        self.min_window_s = min_window_s
        self.analyse_every_s = analyse_every_s
        self.min_growth_ratio = min_growth_ratio
        self.min_growth_bytes = min_growth_bytes
        self.min_step_ratio = min_step_ratio
        self.stable_load_tolerance = stable_load_tolerance
        self.warning_tte_s = warning_tte_s
        self.critical_tte_s = critical_tte_s
        self.memory_total_bytes = memory_total_bytes
        self.require_load = require_load
        self.max_series = max_series
        self.series_: dict[str, _Series] = {}
        self._watched = PerNameSet(_watched)
        self._created = 0  # series made so far: spreads their analyses over the interval

    # -- streaming ------------------------------------------------------------------------------------
    def update(self, snapshot: Snapshot) -> list[Finding]:
        """Report the verdicts of the latest analysis (score), then fold this tick in (learn)."""
        now = snapshot.now
        for name in [n for n, s in self.series_.items() if now - s.last_seen > self.window_s]:
            del self.series_[name]  # the process is gone; its memory went with it
        findings = [s.finding for s in self.series_.values() if s.finding is not None]
        load = tuple(snapshot.get(n) for n in self.load_signals)
        values = snapshot.values
        for name, total_name in self._watched(snapshot):
            value = values[name]
            series = self.series_.get(name)
            if series is None:
                if len(self.series_) >= self.max_series:
                    continue
                series = self.series_[name] = _Series(len(self.load_signals))
                # analyses in 8 phases across the interval, not every series on one tick (17 memory
                # series analysed together cost ~1.3 ms, on top of a tick of ~3 ms)
                phase = (self._created % _ANALYSIS_PHASES) * self.analyse_every_s / _ANALYSIS_PHASES
                series.last_analysis = now - self.analyse_every_s + phase
                self._created += 1
            if now < series.last_seen:
                continue  # time stepped back: keep the buckets causal
            series.last_seen = now
            self._learn(series, now, value, load)
            if now - series.last_analysis >= self.analyse_every_s:
                series.last_analysis = now
                series.finding = self._analyse(name, series, now, self._total(snapshot, total_name))
        return findings

    def _total(self, snapshot: Snapshot, total_name: str) -> float | None:
        total = snapshot.get(total_name)
        return total if total is not None and total > 0 else self.memory_total_bytes

    def _learn(self, series: _Series, now: float, value: float, load: tuple[float | None, ...]) -> None:
        bucket = series.open
        if bucket is not None and now - bucket.start >= self.bucket_s:
            self._close(series, bucket)
            bucket = None
        if bucket is None:
            bucket = series.open = _Bucket(now, load_sum=[0.0] * series.n_load, load_n=[0] * series.n_load)
        bucket.n += 1
        bucket.mem_sum += value
        for k, v in enumerate(load):
            if v is not None:
                bucket.load_sum[k] += v
                bucket.load_n[k] += 1
        while series.buckets and series.buckets[0][0] < now - self.window_s:
            series.buckets.popleft()

    def _close(self, series: _Series, bucket: _Bucket) -> None:
        loads = tuple(s / n if n else math.nan for s, n in zip(bucket.load_sum, bucket.load_n, strict=True))
        series.buckets.append((bucket.start, bucket.mem_sum / bucket.n, loads))

    # -- analysis -------------------------------------------------------------------------------------
    def _analyse(self, name: str, series: _Series, now: float, total: float | None) -> Finding | None:
        rows = list(series.buckets)
        if len(rows) < 8 or rows[-1][0] - rows[0][0] < self.min_window_s:
            return None
        t = np.array([r[0] for r in rows])
        mem = np.array([r[1] for r in rows])
        loads = np.array([r[2] for r in rows]).reshape(len(rows), -1)
        usable = [
            k for k in range(loads.shape[1]) if np.all(np.isfinite(loads[:, k])) and np.ptp(loads[:, k])
        ]
        if not usable and self.require_load:
            return self._clear(series)
        lmat = loads[:, usable]
        hours = (t - t[0]) / 3600.0
        load_term = lmat @ _load_coefficients(np.diff(lmat, axis=0), np.diff(mem))
        resid = mem - load_term
        slope_h, low_h, _ = robust_slope(hours, resid)
        n = len(resid)
        growth = float(np.median(resid[-max(2, n // 5) :]) - np.median(resid[: max(2, n // 4)]))
        sigma = 1.4826 * float(np.median(np.abs(np.diff(resid) - np.median(np.diff(resid))))) / math.sqrt(2)
        floor = self.min_growth_ratio * total if total else self.min_growth_bytes
        levels = np.convolve(resid, np.ones(3) / 3, mode="valid")
        released = float(levels.max() - levels[-1]) > 0.5 * max(growth, 0.0)
        if low_h <= 0 or growth < max(floor, 4 * sigma) or released:
            return self._clear(series)
        step_floor = self.min_step_ratio * total if total else self.min_growth_bytes / 8
        steps = self._steps(t, resid, lmat, max(4 * sigma, step_floor))
        # The window-wide slope is diluted when the leak began mid-window; the exhaustion forecast uses
        # the recent half's slope when that is steeper (the conservative reading).
        recent = robust_slope(hours[n // 2 :], resid[n // 2 :])[0] if n >= 16 else slope_h
        slope_h = max(slope_h, recent)
        if series.since is None:
            series.since = now
        return self._finding(name, series.since, slope_h, growth, steps, resid, load_term, total, len(usable))

    def _clear(self, series: _Series) -> Finding | None:
        """Forget the episode start: the next finding on this series is a new episode."""
        series.since = None
        return None

    def _steps(self, t: FloatArray, resid: FloatArray, lmat: FloatArray, threshold: float) -> list[Step]:
        steps: list[Step] = []
        level = float(np.median(resid[:3]))
        i = 3
        while i + 3 <= len(resid):
            ahead = float(np.median(resid[i : i + 3]))
            if abs(ahead - level) > threshold:
                if ahead > level:
                    before = lmat[max(0, i - 3) : i].mean(axis=0) if lmat.size else np.zeros(0)
                    after = lmat[i : i + 3].mean(axis=0) if lmat.size else np.zeros(0)
                    rel = np.abs(after - before) / np.maximum(np.abs(before), 1e-9)
                    stable = bool(np.all(rel <= self.stable_load_tolerance))
                    steps.append(Step(float(t[i]), ahead - level, stable))
                level = ahead
                i += 3
            else:
                i += 1
        return steps

    def _finding(
        self,
        name: str,
        since: float,
        slope_h: float,
        growth: float,
        steps: list[Step],
        resid: FloatArray,
        load_term: FloatArray,
        total: float | None,
        n_load: int,
    ) -> Finding:
        evidence: dict[str, float | str] = {
            "slope_bytes_per_hour": slope_h,
            "window_growth_bytes": growth,
            "steps": "; ".join(
                f"t={s.at:.0f}s +{s.size_bytes / _MIB:.1f}MiB{'' if s.stable_load else ' (load changed)'}"
                for s in steps
            )
            or "none resolved (smooth creep)",
            "step_count": float(len(steps)),
            "stable_load_steps": float(sum(s.stable_load for s in steps)),
            "load_signals_used": float(n_load),
        }
        rate = f"{slope_h / _GIB:.2f} GiB/h"
        if total:
            peak = float(np.median(resid[-3:])) + float(load_term.max(initial=0.0))
            headroom = total - peak
            tte = 0.0 if headroom <= 0 else headroom / (slope_h / 3600.0)
            evidence |= {"memory_total_bytes": total, "peak_usage_bytes": peak, "time_to_exhaustion_s": tte}
            severity = (
                Severity.CRITICAL
                if tte < self.critical_tte_s
                else Severity.WARNING
                if tte < self.warning_tte_s
                else Severity.INFO
            )
            score = 1.0 - tte / (tte + self.warning_tte_s)
            tail = f"; memory runs out in {tte / 3600:.1f} h at peak load"
        else:
            severity, score, tail = Severity.WARNING, 0.5, "; device total unknown, no time to exhaustion"
        return Finding(
            detector=self.name,
            signal=name,
            severity=severity,
            score=score,
            summary=f"{name} grows {rate} beyond what load explains, in {len(steps)} step(s){tail}",
            since=since,
            evidence=evidence,
            hint=(
                "Memory held and never released: look for growing caches (prefix cache, CUDA graphs, LoRA "
                "adapters, fragments kept by the allocator); schedule a rolling restart before exhaustion."
            ),
        )
