r"""Thermal: GPU temperature that utilisation does not explain, and the clock throttling NVML reports.

**Temperature unexplained by utilisation.** At steady cooling a GPU's temperature is close to linear in
the heat it dissipates, which follows utilisation (and power, where reported) with a thermal lag of tens
of seconds. Per GPU the detector keeps lagged inputs, exponentially smoothed in *time* with constant
:math:`\tau` (``lag_s``): :math:`\tilde u_t = \tilde u_{t'} + (1 - e^{-(t - t')/\tau})(u_t - \tilde u_{t'})`,
and fits by recursive least squares with slow forgetting

.. math:: T_t = w_0 + w_1 \tilde u_t + w_2 \tilde p_t / 1000 + \varepsilon_t

(:math:`T` = ``temperature_celsius.mean``, :math:`u` = ``utilization_ratio.mean``, :math:`p` =
``power_watts.mean``, 0 when absent). A tick is a hit when the prior residual exceeds
:math:`\max(\text{min\_excess\_c}, z_\text{thr}\hat\sigma)`; ``k`` of ``n`` hits make a finding (cooling
problem: fan, airflow, inlet temperature). Hits are not learned, so a failing fan is not adopted as normal.

**Throttle reasons.** ``nvml.gpu<i>.throttle_reasons`` is NVML's clocks-event bitmask
(``nvmlDeviceGetCurrentClocksEventReasons``); ``nvml.gpu<i>.throttle.<reason>`` flags (0/1) are read
as well. Reasons that cost throughput become findings after ``k`` of ``n`` ticks: hardware slowdown,
hardware/software thermal slowdown and power-brake are serious; the software power cap is
informational (it is how a fully loaded GPU normally runs). Idle, application-clock, sync-boost and
display-clock reasons are ignored.
"""

from __future__ import annotations

import math
from functools import partial

from detectors.base import Finding, Severity
from detectors.domain_util import KOfN, LastHit, RecursiveLeastSquares, gpu_indices
from detectors.snapshot import Snapshot

_EVIDENCE = ("sm_clock_hz.mean", "temperature_celsius.mean", "power_watts.mean", "utilization_ratio.mean")

#: NVML clocks-event reason bits (nvml.h ``nvmlClocksEventReason*``): name -> (bit, severity or None).
THROTTLE_REASONS: dict[str, tuple[int, Severity | None]] = {
    "gpu_idle": (0x1, None),
    "applications_clocks_setting": (0x2, None),
    "sw_power_cap": (0x4, Severity.INFO),
    "hw_slowdown": (0x8, Severity.CRITICAL),
    "sync_boost": (0x10, None),
    "sw_thermal_slowdown": (0x20, Severity.WARNING),
    "hw_thermal_slowdown": (0x40, Severity.CRITICAL),
    "hw_power_brake_slowdown": (0x80, Severity.CRITICAL),
    "display_clock_setting": (0x100, None),
}
#: The reasons that can become findings (the others are never looked at).
_WATCHED = tuple(
    (reason, bit, severity) for reason, (bit, severity) in THROTTLE_REASONS.items() if severity is not None
)
_WATCHED_BITS = sum(bit for _, bit, _ in _WATCHED)
_HINTS = {
    "sw_power_cap": "The GPU runs at its power limit: expected at full load; if utilisation is low, "
    "check the configured power limit.",
    "hw_slowdown": "Hardware slowdown (thermal or power brake asserted by the board): check cooling and PSU.",
    "sw_thermal_slowdown": "The driver lowers clocks to stay under the temperature target: improve airflow.",
    "hw_thermal_slowdown": "Too hot, clocks cut hard: check fans, airflow and inlet temperature.",
    "hw_power_brake_slowdown": "External power brake asserted (PSU or chassis power): check node power.",
}


class _Gpu:
    def __init__(self, forgetting: float, k: int, n: int) -> None:
        self.rls = RecursiveLeastSquares(3, forgetting=forgetting, delta=1000.0)
        self.gate = KOfN(k, n)
        self.shown = LastHit()
        self.util: float | None = None
        self.power: float | None = None
        self.t = -math.inf


class _Names:
    """The signal names of one GPU, built once (f-strings per GPU per tick add up at 8 GPUs)."""

    def __init__(self, i: int) -> None:
        prefix = f"nvml.gpu{i}"
        self.temperature = f"{prefix}.temperature_celsius.mean"
        self.utilization = f"{prefix}.utilization_ratio.mean"
        self.power = f"{prefix}.power_watts.mean"
        self.mask = f"{prefix}.throttle_reasons"
        self.flags = tuple(f"{prefix}.throttle.{reason}" for reason, _, _ in _WATCHED)
        self.evidence = tuple((key, f"{prefix}.{key}") for key in _EVIDENCE)


class ThermalDetector:
    """Temperature not explained by utilisation, and throttle reasons that cost throughput."""

    name = "thermal"

    def __init__(
        self,
        lag_s: float = 60.0,
        forgetting: float = 0.9995,
        min_excess_c: float = 8.0,
        z_threshold: float = 4.0,
        warmup: int = 300,
        k: int = 3,
        n: int = 5,
    ) -> None:
        self.lag_s = lag_s
        self.forgetting = forgetting
        self.min_excess_c = min_excess_c
        self.z_threshold = z_threshold
        self.warmup = warmup
        self.k = k
        self.n = n
        self.gpus_: dict[int, _Gpu] = {}
        self.throttle_: dict[tuple[int, str], KOfN] = {}
        #: per GPU, ticks in a row with no watched reason active (capped at ``n``)
        self.calm_: dict[int, int] = {}
        self._names: dict[int, _Names] = {}
        self._keys: frozenset[str] = frozenset()
        self._indices: list[int] = []

    def _gpu_indices(self, snapshot: Snapshot) -> list[int]:
        """:func:`gpu_indices`, recomputed only when the set of signal names changes (rarely: a tick
        carries the same names as the one before)."""
        keys = snapshot.values.keys()
        if keys != self._keys:
            self._keys = frozenset(keys)
            self._indices = gpu_indices(snapshot)
        return self._indices

    def update(self, snapshot: Snapshot) -> list[Finding]:
        """Per GPU: score temperature against the lagged-utilisation model, then learn; read throttling."""
        findings: list[Finding] = []
        for i in self._gpu_indices(snapshot):
            names = self._names.get(i)
            if names is None:
                names = self._names[i] = _Names(i)
            finding = self._temperature(i, names, snapshot)
            if finding is not None:
                findings.append(finding)
            findings.extend(self._throttle(i, names, snapshot))
        return findings

    def _temperature(self, i: int, names: _Names, snapshot: Snapshot) -> Finding | None:
        values = snapshot.values
        temp = values.get(names.temperature)
        util = values.get(names.utilization)
        if temp is None or util is None:
            return None
        gpu = self.gpus_.get(i)
        if gpu is None:
            gpu = self.gpus_[i] = _Gpu(self.forgetting, self.k, self.n)
        if snapshot.now <= gpu.t:
            return None  # repeated or backward time: the lag filter needs forward time
        power = values.get(names.power)
        weight = 1.0 - math.exp(-(snapshot.now - gpu.t) / self.lag_s) if math.isfinite(gpu.t) else 1.0
        gpu.util = util if gpu.util is None else gpu.util + weight * (util - gpu.util)
        if power is not None:
            gpu.power = power if gpu.power is None else gpu.power + weight * (power - gpu.power)
        gpu.t = snapshot.now
        x = [1.0, gpu.util, (gpu.power or 0.0) / 1000.0]  # a list: the RLS works in plain floats
        if gpu.rls.n_ < self.warmup:
            gpu.rls.learn(x, temp)
            return None
        predicted = gpu.rls.predict(x)
        excess = temp - predicted
        hit = excess > max(self.min_excess_c, self.z_threshold * gpu.rls.residual_std)
        if not hit:
            gpu.rls.learn(x, temp)
        if not gpu.gate.push(hit, snapshot.now):
            gpu.shown.clear()
            return None
        build = partial(
            self._temperature_finding, i, names, gpu, snapshot.now, temp, predicted, gpu.util, power
        )
        return gpu.shown.show(gpu.gate, hit, build, f"{temp:.0f}°C, {excess:+.0f}°C against the model")

    def _temperature_finding(
        self,
        i: int,
        names: _Names,
        gpu: _Gpu,
        now: float,
        temp: float,
        predicted: float,
        util: float,
        power: float | None,
    ) -> Finding:
        excess = temp - predicted
        return Finding(
            detector=self.name,
            signal=names.temperature,
            severity=Severity.CRITICAL if excess > 2 * self.min_excess_c else Severity.WARNING,
            score=excess / (2 * self.min_excess_c),
            summary=(
                f"GPU{i} at {temp:.0f}°C, {excess:.0f}°C above the {predicted:.0f}°C its utilisation "
                f"({util:.0%}) explains"
            ),
            since=gpu.gate.since(now),
            evidence={
                "temperature_celsius": temp,
                "predicted_celsius": predicted,
                "excess_celsius": excess,
                "utilization_ratio_lagged": util,
                "power_watts": power if power is not None else "absent",
                "residual_std_celsius": gpu.rls.residual_std,
            },
            hint="Hotter than the load explains: check fans, airflow, inlet temperature and neighbours.",
        )

    def _throttle(self, i: int, names: _Names, snapshot: Snapshot) -> list[Finding]:
        values = snapshot.values
        mask = values.get(names.mask)
        bits = 0 if mask is None else int(mask)
        flags = [values.get(name) for name in names.flags]
        if not bits & _WATCHED_BITS and not any(flag is not None and flag >= 0.5 for flag in flags):
            # Nothing active. Once the last ``n`` checks of this GPU were all calm, every gate's window
            # holds no hit and one more miss changes nothing, so the gates are not pushed (the common
            # case, which otherwise cost a dozen look-ups per reason per GPU per tick).
            calm = self.calm_.get(i, 0)
            if calm >= self.n:
                return []
            self.calm_[i] = calm + 1
        else:
            self.calm_[i] = 0
        findings: list[Finding] = []
        for (reason, bit, severity), flag_name, flag in zip(_WATCHED, names.flags, flags, strict=True):
            if flag is None and mask is None:
                continue
            active = (flag is not None and flag >= 0.5) or bits & bit != 0
            gate = self.throttle_.get((i, reason))
            if gate is None:
                gate = self.throttle_[(i, reason)] = KOfN(self.k, self.n)
            if not gate.push(active, snapshot.now):
                continue
            evidence: dict[str, float | str] = {"reason": reason, "bit": float(bit)}
            for key, name in names.evidence:
                value = values.get(name)
                if value is not None:
                    evidence[key] = value
            findings.append(
                Finding(
                    detector=self.name,
                    signal=flag_name,
                    severity=severity,
                    score={Severity.INFO: 0.3, Severity.WARNING: 0.6, Severity.CRITICAL: 0.9}[severity],
                    summary=f"GPU{i} clocks throttled: {reason.replace('_', ' ')}",
                    since=gate.since(snapshot.now),
                    evidence=evidence,
                    hint=_HINTS[reason],
                )
            )
        return findings
