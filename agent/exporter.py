"""The agent's own ``/metrics``: what servepilot derives, from its own registry, in base units.

Flat snapshot names (see :mod:`detectors.snapshot`) become Prometheus families through the ordered rules
in :data:`RULES` — names are data, so a new signal needs a rule, not code. Raw series that the engine and
dcgm-exporter already serve are not re-exported as such: the agent publishes its windowed quantiles, its
rates, its 100 ms-sampled aggregates (mean/max within the tick), its findings and its decisions.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector as PromCollector

from agent import build_info
from agent.state import AgentState
from detectors.snapshot import SourceStatus

BREAKER = "breaker"
"""Name of the circuit-breaker policy whose state carries ``level`` (policies/registry.py)."""
QUANTILES = {"p50": "0.5", "p90": "0.9", "p95": "0.95", "p99": "0.99"}


def without_created_series() -> None:
    """Export no ``<counter>_created`` or ``<histogram>_created`` samples, in this process.

    prometheus_client writes one beside every counter and histogram series, the time it was created.
    Nothing servepilot's dashboards or rules read uses it, and Prometheus 2 ingests each as a series
    of its own: 42 of the sidecar's 550 in a scrape beside vLLM with the gate on. The long-running
    commands (``run``, ``gate``) call this at start; it is prometheus_client's one switch, a global.
    """
    disable_created_metrics()  # type: ignore[no-untyped-call]  # prometheus_client does not annotate it


@dataclass(frozen=True)
class Rule:
    """Map snapshot names matching ``pattern`` to ``template`` with the named groups as labels.

    ``{metric}`` in the template is replaced by the group of that name; every other named group becomes
    a label. ``fixed`` adds constant labels.
    """

    pattern: re.Pattern[str]
    template: str
    help: str
    fixed: tuple[tuple[str, str], ...] = ()


SKIP = ""
"""Template of rules whose signals are not exported (someone else already exports them)."""


def _rule(pattern: str, template: str, help_text: str, **fixed: str) -> Rule:
    return Rule(re.compile(pattern), template, help_text, tuple(sorted(fixed.items())))


RULES: tuple[Rule, ...] = (
    _rule(
        r"^nvml\.gpu(?P<gpu>\d+)\.process_used_bytes\.pid(?P<pid>\d+)$",
        "servepilot_gpu_process_used_bytes",
        "GPU memory used by one process (NVML, sampled at most once per second).",
    ),
    _rule(
        r"^nvml\.gpu(?P<gpu>\d+)\.throttle\.(?P<reason>\w+)$",
        "servepilot_gpu_throttle_active",
        "1 when the clocks-event (throttle) reason was active during the tick.",
    ),
    _rule(
        r"^nvml\.gpu(?P<gpu>\d+)\.(?P<metric>\w+)\.(?P<agg>mean|max|last)$",
        "servepilot_gpu_{metric}",
        "NVML reading aggregated over the tick's ~100 ms samples (agg = mean, max or last).",
    ),
    _rule(
        r"^nvml\.gpu(?P<gpu>\d+)\.(?P<metric>\w+)$",
        "servepilot_gpu_{metric}",
        "NVML reading at the end of the tick.",
    ),
    _rule(
        r"^engine\.(?P<metric>\w+)\.(?P<quantile>p50|p90|p95|p99)$",
        "servepilot_engine_{metric}",
        "Quantile of the engine's histogram over the agent's quantile window.",
    ),
    _rule(
        r"^engine\.(?P<metric>\w+)\.mean$",
        "servepilot_engine_{metric}_mean",
        "Mean of the engine's histogram over the agent's quantile window.",
    ),
    _rule(
        r"^engine\.(?P<metric>\w+)\.position(?P<position>\d+)$",
        "servepilot_engine_{metric}",
        "Engine signal per speculative draft position (0 = the first drafted token).",
    ),
    _rule(
        r"^engine\.decode_tokens_per_step$",
        "servepilot_engine_decode_tokens_per_step",
        "Decode tokens a request got per engine step over the quantile window, 1 + its accepted draft "
        "tokens; present only while the engine drafts (speculative decoding).",
    ),
    _rule(r"^engine\.(?P<metric>\w+)$", "servepilot_engine_{metric}", "Engine signal derived by the agent."),
    _rule(
        r"^probe\.device(?P<device>\d+)\.(?P<metric>\w+)$",
        "servepilot_allocator_{metric}",
        "Torch allocator statistic from the probe in the engine process.",
    ),
    _rule(
        r"^probe\.(?P<metric>\w+)$",
        "servepilot_allocator_{metric}",
        "Torch allocator statistic from the probe, summed over devices.",
        device="all",
    ),
    _rule(
        r"^cost\.per_1k_tokens_usd$", "servepilot_cost_per_1k_tokens", "Cost of 1,000 generated tokens (USD)."
    ),
    _rule(
        r"^cost\.energy_joules_per_token$",
        "servepilot_energy_joules_per_token",
        "GPU energy per generated token over the cost window (NVML power x time / tokens).",
    ),
    # The gate publishes its own histograms, gauges and counters (servepilot_gate_*) in this registry;
    # its snapshot signals are for the detectors and must not be exported a second time.
    _rule(r"^gate\..*$", SKIP, "Exported by the gate itself."),
    _rule(
        r"^forecast\.(?P<metric>requests_per_second|tokens_per_second)\.h(?P<horizon_min>\d+)m"
        r"\.q(?P<quantile>0\.\d+)$",
        "servepilot_forecast_{metric}",
        "Forecast rate `horizon` seconds ahead at the given quantile (0.5 = point forecast).",
    ),
    _rule(
        r"^forecast\.backtest_mase\.(?P<model>.+)\.h(?P<horizon_min>\d+)m$",
        "servepilot_forecast_backtest_mase",
        "Rolling-origin backtest MASE of each candidate forecaster on recent data (lower is better).",
    ),
    _rule(r"^forecast\.(?P<metric>\w+)$", "servepilot_forecast_{metric}", "Forecasting signal."),
)

_INVALID = re.compile(r"[^a-zA-Z0-9_]")


@dataclass(frozen=True)
class Translation:
    name: str
    help: str
    labels: tuple[tuple[str, str], ...]


def translate(signal: str) -> Translation | None:
    """Map one flat snapshot name to a metric name and labels (unmatched names get a generic name);
    ``None`` for signals that are deliberately not exported."""
    for rule in RULES:
        match = rule.pattern.match(signal)
        if not match:
            continue
        if rule.template == SKIP:
            return None
        groups = match.groupdict()
        name = rule.template.format(metric=groups.pop("metric", ""))
        if "quantile" in groups:
            groups["quantile"] = QUANTILES.get(groups["quantile"], groups["quantile"])
        if "horizon_min" in groups:  # forecast horizons are minutes in names, seconds in labels
            groups["horizon"] = str(int(groups.pop("horizon_min")) * 60)
        labels = tuple(sorted({**groups, **dict(rule.fixed)}.items()))
        return Translation(name, rule.help, labels)
    return Translation("servepilot_" + _INVALID.sub("_", signal), "Signal derived by the agent.", ())


class StateCollector(PromCollector):
    """Builds the families from the latest :class:`AgentState` at scrape time (nothing kept in between).

    ``slo`` holds the configured latency targets (``{"ttft": s, "itl": s}``), exported as
    ``servepilot_slo_<name>_seconds`` so panels and rules can draw and compare against them without
    copying the config into PromQL.
    """

    def __init__(self, slo: Mapping[str, float] | None = None) -> None:
        self.state = AgentState()
        self.slo = dict(slo or {})
        #: the ITL target the policies steer to (agent/itl_steering.py); None: not exported
        self.policy_itl_s: float | None = None
        self._cache: dict[str, Translation | None] = {}

    def update(self, state: AgentState) -> None:
        self.state = state

    def _translation(self, signal: str) -> Translation | None:
        if signal in self._cache:
            return self._cache[signal]
        if len(self._cache) > 100_000:  # pid churn must not grow the cache for ever
            self._cache.clear()
        found = self._cache[signal] = translate(signal)
        return found

    def collect(self) -> Iterator[Metric]:
        state = self.state
        snap = state.snapshot
        success = GaugeMetricFamily(
            "servepilot_collector_success",
            "1 when the collector's last fetch returned data (0 for an error or for no data yet).",
            labels=["collector"],
        )
        status = GaugeMetricFamily(
            "servepilot_collector_status",
            "1 for the collector's last outcome: ok, no_data (answered, nothing to report yet) or error.",
            labels=["collector", "status"],
        )
        duration = GaugeMetricFamily(
            "servepilot_collector_duration_seconds",
            "Duration of the collector's last fetch.",
            labels=["collector"],
        )
        age = GaugeMetricFamily(
            "servepilot_collector_data_age_seconds",
            "Seconds between the tick and the observation it used (staleness).",
            labels=["collector"],
        )
        ups = {
            "engine": GaugeMetricFamily("servepilot_engine_up", "1 when the engine's /metrics answered."),
            "nvml": GaugeMetricFamily("servepilot_nvml_up", "1 when NVML (or its simulation) answered."),
            "probe": GaugeMetricFamily("servepilot_probe_up", "1 when the allocator probe answered."),
        }
        families: dict[str, GaugeMetricFamily] = {}
        if snap is not None:
            for name, reading in sorted(snap.readings.items()):
                ok = reading.status is SourceStatus.OK
                success.add_metric([name], 1.0 if ok else 0.0)
                for outcome in SourceStatus:  # a state set: every state present, the current one 1
                    status.add_metric([name, outcome.value], 1.0 if reading.status is outcome else 0.0)
                duration.add_metric([name], reading.duration_s)
                age.add_metric([name], max(0.0, snap.now - reading.observed_at))
                if name in ups:
                    ups[name].add_metric([], 1.0 if ok else 0.0)
            for signal, value in snap.values.items():
                tr = self._translation(signal)
                if tr is None:
                    continue
                family = families.get(tr.name)
                if family is None:
                    family = families[tr.name] = GaugeMetricFamily(
                        tr.name, tr.help, labels=[k for k, _ in tr.labels]
                    )
                if len(family._labelnames) == len(tr.labels):  # a mismatch would break the exposition
                    family.add_metric([v for _, v in tr.labels], value)
        yield success
        yield status
        yield duration
        yield age
        yield from (f for f in ups.values() if f.samples)
        yield from families.values()
        yield from self._brain_families(state)
        yield from self._config_families()

    def _config_families(self) -> Iterator[Metric]:
        for name, target_s in sorted(self.slo.items()):
            slo = GaugeMetricFamily(
                f"servepilot_slo_{name}_seconds",
                f"Configured {name.upper()} target (P99 for TTFT, mean for ITL).",
            )
            slo.add_metric([], target_s)
            yield slo
        if self.policy_itl_s is not None:
            steered = GaugeMetricFamily(
                "servepilot_policy_itl_target_seconds",
                "ITL the policies steer the engine to: policies.itl_slo_s, or with policies.itl_steering "
                "served_classes the tightest target of the priority classes served lately.",
            )
            steered.add_metric([], self.policy_itl_s)
            yield steered

    @staticmethod
    def _brain_families(state: AgentState) -> Iterator[Metric]:
        active = GaugeMetricFamily(
            "servepilot_finding_active",
            "1 for each active finding.",
            labels=["detector", "signal", "severity"],
        )
        score = GaugeMetricFamily(
            "servepilot_finding_score",
            "Score in [0, 1] of each active finding.",
            labels=["detector", "signal"],
        )
        for finding in state.findings:
            active.add_metric([finding.detector, finding.signal, finding.severity.value], 1.0)
            score.add_metric([finding.detector, finding.signal], finding.score)
        yield active
        yield score
        knobs = GaugeMetricFamily(
            "servepilot_knob_value", "Current value of each numeric knob.", labels=["knob"]
        )
        for knob, value in sorted(state.knobs.items()):
            if isinstance(value, int | float):
                knobs.add_metric([knob], float(value))
        yield knobs
        breaker = state.policy_states.get(BREAKER)
        level = getattr(breaker, "level", None)
        if isinstance(level, int | float):  # absent until the breaker policy has run once
            family = GaugeMetricFamily(
                "servepilot_breaker_level",
                "Circuit breaker level: 0 normal, 1 smaller batch, 2 fp8 upstream, 3 small model.",
            )
            family.add_metric([], float(level))
            yield family
        ticks = CounterMetricFamily("servepilot_ticks", "Ticks completed by the control loop.")
        ticks.add_metric([], state.stats.ticks)
        yield ticks
        overruns = CounterMetricFamily(
            "servepilot_tick_overruns", "Tick slots skipped because a tick ran past its interval."
        )
        overruns.add_metric([], state.stats.overruns)
        yield overruns
        yield _per_name(
            "servepilot_detector_errors",
            "Detector updates that raised.",
            "detector",
            state.stats.detector_errors,
        )
        yield _per_name(
            "servepilot_policy_errors",
            "Policy decisions that raised: that policy proposed nothing on those ticks.",
            "policy",
            state.stats.policy_errors,
        )
        raised = CounterMetricFamily(
            "servepilot_findings_raised",
            "Findings raised: a new episode, or one escalated to a higher severity (agent/tally.py).",
            labels=["detector", "severity"],
        )
        for (detector, severity), count in sorted(state.stats.findings_raised.items()):
            raised.add_metric([detector, severity], count)
        yield raised
        yield _per_name(
            "servepilot_findings_suppressed",
            "Alarms a detector's alarm budget dropped instead of raising them.",
            "detector",
            state.stats.findings_suppressed,
        )


def _per_name(name: str, documentation: str, label: str, counts: Mapping[str, int]) -> CounterMetricFamily:
    """A counter with one series per ``label`` value (a detector's, a policy's name)."""
    family = CounterMetricFamily(name, documentation, labels=[label])
    for value, count in sorted(counts.items()):
        family.add_metric([value], count)
    return family


class Exporter:
    """Owns the agent's :class:`CollectorRegistry` (never the global one). ``slo``: see
    :class:`StateCollector`."""

    def __init__(self, slo: Mapping[str, float] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.state_collector = StateCollector(slo)
        self.registry.register(self.state_collector)
        build_info.register(self.registry)
        self.tick_duration = Histogram(
            "servepilot_tick_duration_seconds",
            "Wall time of one control-loop tick (collect + think).",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=self.registry,
        )

    def set_slo(self, slo: Mapping[str, float]) -> None:
        """The targets ``servepilot_slo_<name>_seconds`` export from the next scrape on (a config reload)."""
        self.state_collector.slo = dict(slo)

    def set_policy_itl(self, itl_s: float) -> None:
        """``servepilot_policy_itl_target_seconds`` from the next scrape on."""
        self.state_collector.policy_itl_s = itl_s

    def publish(self, state: AgentState) -> None:
        self.state_collector.update(state)
        self.tick_duration.observe(state.stats.last_duration_s)
