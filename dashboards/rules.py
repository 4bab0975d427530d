"""Prometheus recording and alerting rules for servepilot, as code.

Recording rules follow the ``level:metric:operations`` convention (level = the labels kept, e.g.
``namespace_pod``). Every alert has a ``for``, a ``severity`` label, ``summary`` and ``description``
annotations and a ``runbook_url`` pointing at its section of ``docs/alerts.md``.

The TTFT SLO alerts are the multi-window, multi-burn-rate alerts of the Google SRE workbook (ch. 5):
with an objective of ``1 - budget`` of requests whose first token arrives within the SLO, the error
ratio over a window is ``1 - rate(bucket{le=SLO}) / rate(count)``; a *fast* burn pages when both the
1 h and 5 min ratios exceed 14.4 x budget (2 % of a 30-day budget gone in an hour), a *slow* burn
warns when the 6 h and 30 min ratios exceed 6 x budget (5 % in 6 h). The short window makes the alert
stop soon after the burn stops. The latency threshold must be one of the engine's histogram bounds
(``TTFT_BOUNDS``; ``--ttft-slo-s`` picks one). The per-class alerts (``ServepilotClassSloBurn*``) put the same
two pairs of windows on the gate's answers of each priority class, judged by that class's own targets,
with a floor on the answers counted so that a class sending a few requests an hour does not page on one
miss.

:func:`build` takes a :class:`Profile` so the end-to-end test can load the same rules with seconds
instead of minutes; ``python -m dashboards.rules`` writes the production file.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.utils import floatToGoString

from dashboards import inhibit

RULES_FILE = Path(__file__).resolve().parent / "rules" / "servepilot.rules.yaml"
OPERATOR_FILE = Path(__file__).resolve().parents[1] / "deploy" / "prometheus" / "prometheusrule.yaml"
RUNBOOK = "https://github.com/servepilot/servepilot/blob/main/docs/alerts.md"
BY = "namespace, pod"
# the least traffic a burn alert judges, over its long window: a pod or class serving a trickle (a few
# requests an hour in staging or at night) does not page on a few slow requests
FAST_MIN_REQUESTS = 50
SLOW_MIN_REQUESTS = 300


def _class_miss_ratio(window: str, above: float) -> str:
    """Per priority class, the share of the gate's answers that missed the class's SLO over ``window``."""
    return (
        f"(sum by ({BY}, priority) (rate(servepilot_gate_slo_bad_total[{window}]))\n"
        f"  / sum by ({BY}, priority) (rate(servepilot_gate_answered_total[{window}])) > {above:g})"
    )


def _class_burn(long: str, short: str, above: float, *, min_answers: int) -> str:
    """A class burning its budget: its miss ratio above ``above`` over both windows, with at least
    ``min_answers`` answers over the long one (a class sending a few requests does not page on one miss)."""
    return (
        _class_miss_ratio(long, above)
        + "\nand "
        + _class_miss_ratio(short, above)
        + f"\nand sum by ({BY}, priority) (increase(servepilot_gate_answered_total[{long}])) >= {min_answers}"
    )


@dataclass(frozen=True)
class Profile:
    """Durations used by the rules. ``windows`` maps the nominal window to the one used."""

    for_scale: float = 1.0
    windows: tuple[tuple[str, str], ...] = (("5m", "5m"), ("30m", "30m"), ("1h", "1h"), ("6h", "6h"))
    #: 2.5 s: the bound at or above the policies' default target (``policies.ttft_slo_s``, 2 s), so the
    #: alerts do not page while the policies hold the batch at the latency they were told to accept
    ttft_slo_le: str = "2.5"
    error_budget: float = 0.01
    agent_job: str = "servepilot"

    def w(self, nominal: str) -> str:
        return dict(self.windows)[nominal]

    def for_(self, seconds: int) -> str:
        scaled = max(1, round(seconds * self.for_scale))
        fast = self.for_scale < 1.0  # a shortened profile says seconds throughout
        return f"{scaled // 60}m" if scaled % 60 == 0 and not fast else f"{scaled}s"


PRODUCTION = Profile()
#: The end-to-end test's profile: same expressions, windows of seconds, ``for`` of about a second.
FAST = replace(
    PRODUCTION,
    for_scale=1 / 120,
    windows=(("5m", "15s"), ("30m", "30s"), ("1h", "1m"), ("6h", "2m")),
)

ENGINES = {
    "vllm": ("vllm:time_to_first_token_seconds", "vllm:generation_tokens_total"),
    "sglang": ("sglang:time_to_first_token_seconds", "sglang:generation_tokens_total"),
}
#: The bucket bounds (s) of each engine's TTFT histogram, as their /metrics serve them (vLLM 0.32, SGLang's
#: documented scrape: tests/fixtures/expo, checked by tests/dashboards/test_rules.py). The burn alerts
#: can count the answers within the SLO only at a bound: ``le`` of a value between bounds matches no series.
TTFT_BOUNDS = {
    "vllm": (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
             20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
    "sglang": (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               15.0, 20.0, 25.0, 30.0),
}  # fmt: skip
FAST_BURN, SLOW_BURN = 14.4, 6.0  # the SRE workbook's burn rates for 1 h / 5 min and 6 h / 30 min


def slo_bound(seconds: float) -> str:
    """``seconds`` as the ``le`` label both engines' TTFT histograms carry; ValueError names the bounds
    near it when one of them has no such bucket."""
    missing = [engine for engine, bounds in TTFT_BOUNDS.items() if seconds not in bounds]
    if missing:
        shared = sorted(set.intersection(*(set(bounds) for bounds in TTFT_BOUNDS.values())))
        below = [b for b in shared if b < seconds][-1:]
        above = [b for b in shared if b > seconds][:1]
        near = " or ".join(f"{b:g}" for b in below + above)
        raise ValueError(
            f"{seconds:g} s is not a bucket bound of the TTFT histogram of {' and '.join(missing)}; "
            f"the nearest bounds both engines have are {near}"
        )
    return str(floatToGoString(seconds))  # type: ignore[no-untyped-call]


def recording(p: Profile) -> list[dict[str, Any]]:
    rules: list[dict[str, Any]] = [
        {
            "record": "namespace_pod:servepilot_gpu_utilization_ratio:avg",
            "expr": f'avg by ({BY}) (servepilot_gpu_utilization_ratio{{agg="mean"}})',
        },
        {
            "record": "namespace_pod:servepilot_gpu_power_watts:sum",
            "expr": f'sum by ({BY}) (servepilot_gpu_power_watts{{agg="mean"}})',
        },
        {
            "record": "namespace_pod:servepilot_gpu_energy_joules:rate5m",
            "expr": f"sum by ({BY}) (rate(servepilot_gpu_energy_joules[{p.w('5m')}]))",
        },
    ]
    for engine, (ttft, tokens) in ENGINES.items():
        rules.append(
            {
                "record": "namespace_pod:engine_generation_tokens:rate5m",
                "expr": f"sum by ({BY}) (rate({tokens}[{p.w('5m')}]))",
                "labels": {"engine": engine},
            }
        )
        for window in ("1h", "6h"):  # the burn alerts' volume guard
            rules.append(
                {
                    "record": f"namespace_pod:engine_ttft_requests:increase{window}",
                    "expr": f"sum by ({BY}) (increase({ttft}_count[{p.w(window)}]))",
                    "labels": {"engine": engine},
                }
            )
        for window in ("5m", "30m", "1h", "6h"):
            w = p.w(window)
            rules.append(
                {
                    "record": f"namespace_pod:engine_ttft_slo_miss:ratio_rate{window}",
                    "expr": (
                        f'1 - sum by ({BY}) (rate({ttft}_bucket{{le="{p.ttft_slo_le}"}}[{w}]))\n'
                        f"  / (sum by ({BY}) (rate({ttft}_count[{w}])) > 0)"
                    ),
                    "labels": {"engine": engine},
                }
            )
    rules.append(
        {
            "record": "namespace_pod:servepilot_energy_joules_per_token:ratio_rate5m",
            "expr": (
                "namespace_pod:servepilot_gpu_energy_joules:rate5m\n"
                f"  / on ({BY}) (namespace_pod:engine_generation_tokens:rate5m > 0)"
            ),
        }
    )
    return rules


def _with_role(expr: str) -> str:
    """``expr`` (one series per upstream, values kept) with the upstream's ``role`` label (``engine``:
    this pod's own) from ``servepilot_gate_upstream_role``, for the inhibition rules; the series of a gate
    too old to export the role still come through, without the label."""
    return (
        f"({expr})\n"
        f"  * on ({BY}, upstream) group_left (role)\n"
        f"    max by ({BY}, upstream, role) (servepilot_gate_upstream_role)\n"
        f"or on ({BY}, upstream)\n"
        f"  ({expr})"
    )


def _alert(name: str, expr: str, for_: str, severity: str, summary: str, description: str) -> dict[str, Any]:
    return {
        "alert": name,
        "expr": expr,
        "for": for_,
        "labels": {"severity": severity},
        "annotations": {
            "summary": summary,
            "description": description,
            "runbook_url": f"{RUNBOOK}#{name.lower()}",
        },
    }


def alerts(p: Profile) -> list[dict[str, Any]]:
    fast, slow = FAST_BURN * p.error_budget, SLOW_BURN * p.error_budget
    return [
        _alert(
            "ServepilotAgentDown",
            f'up{{job="{p.agent_job}"}} == 0',
            p.for_(300),
            "critical",
            "servepilot agent {{ $labels.pod }} is not being scraped",
            "Prometheus has failed to scrape the servepilot sidecar at {{ $labels.instance }} for 5 minutes; "
            "nothing is watching or tuning this engine.",
        ),
        _alert(
            "ServepilotEngineDown",
            "servepilot_engine_up == 0",
            p.for_(120),
            "critical",
            "engine in {{ $labels.pod }} does not answer its /metrics",
            "The servepilot sidecar cannot scrape the inference engine's /metrics in {{ $labels.namespace }}/"
            "{{ $labels.pod }}; the engine is down, hung or overloaded.",
        ),
        _alert(
            "ServepilotEngineStalled",
            f'max by ({BY}) (servepilot_finding_active{{detector="engine_stall"}}) == 1',
            p.for_(60),
            "critical",
            "engine in {{ $labels.pod }} holds requests and makes no progress",
            "The engine has held requests for more than 2 minutes without a token, a finished request or a "
            "change in its step-loop gauges, while its HTTP server answers; it is hung and will not recover "
            "by itself. The pod is unready, so the Service sends new requests to other replicas; a gate with "
            "another upstream (fp8, small) takes this one out of its split and answers from there. With "
            "agent.engine_restart_stall_s set, the engine's liveness probe restarts it.",
        ),
        _alert(
            "ServepilotGateUpstreamOut",
            _with_role(f"min by ({BY}, upstream) (servepilot_gate_upstream_up) == 0"),
            p.for_(300),
            "warning",
            "gate upstream {{ $labels.upstream }} in {{ $labels.pod }} is out of the split",
            "The gate has had upstream {{ $labels.upstream }} marked down for 5 minutes: its health check "
            "fails, or it holds streams that get no byte while its health check passes (a hung engine, "
            "counted in servepilot_gate_upstream_ejections_total), or the sidecar finds its engine stalled. "
            "While another upstream is healthy it gets no new request, so a canary or breaker level that "
            "relies on it is not served as set.",
        ),
        _alert(
            "ServepilotGateUpstreamFailing",
            _with_role(
                f"sum by ({BY}, upstream) (rate(servepilot_gate_retried_total[{p.w('5m')}]))\n"
                f"  / on ({BY}) group_left sum by ({BY})"
                f" (rate(servepilot_gate_requests_total[{p.w('5m')}]))\n"
                "  > 0.01"
            ),
            p.for_(300),
            "warning",
            "gate upstream {{ $labels.upstream }} in {{ $labels.pod }} answers errors the gate hides",
            "For 5 minutes upstream {{ $labels.upstream }} has answered 502/503/504 to "
            "{{ $value | humanizePercentage }} as many requests as clients sent; the gate asks the next "
            "upstream instead, so clients see few of them, but the engine is failing and the others carry "
            "its load within the retry budget.",
        ),
        _alert(
            "ServepilotGateStarved",
            f"sum by ({BY}) (increase(servepilot_gate_blind_seconds_total[{p.w('30m')}])) > 20",
            p.for_(300),
            "warning",
            "the gate in {{ $labels.pod }} went unscheduled {{ $value | humanize }} s in 30 minutes",
            "The gate in front of the engine stopped, a second or more at a time, for over 20 s in 30 "
            "minutes: its event loop blocked, or its container or node was starved of CPU. Every request "
            "through it paused as long, and its hang detection waits until it wakes.",
        ),
        _alert(
            "ServepilotGateSlow",
            f"histogram_quantile(0.9, sum by ({BY}, le)"
            f" (rate(servepilot_gate_held_seconds_bucket[{p.w('30m')}]))) > 0.05\n"
            f"and sum by ({BY}) (rate(servepilot_gate_held_seconds_count[{p.w('30m')}])) > 0.1",
            p.for_(600),
            "warning",
            "the gate in {{ $labels.pod }} holds requests {{ $value | humanizeDuration }} before sending "
            "them",
            "One request in ten over the last 30 minutes, and so for 10 minutes on end, waited over 50 ms "
            "in the gate itself before it went upstream, its queue wait aside (reading and parsing it, the "
            "line's buckets, admission; the gate's own work takes well under a millisecond): the sidecar "
            "is short of CPU, throttled by its limit, or its event loop is busy with something else. Every "
            "request's time to first token carries it.",
        ),
        _alert(
            "ServepilotGateShedsHighPriority",
            f'sum by ({BY}) (rate(servepilot_gate_requests_total{{priority="high", outcome="expired"}}'
            f"[{p.w('30m')}]))\n"
            f'  / sum by ({BY}) (rate(servepilot_gate_requests_total{{priority="high"}}[{p.w("30m")}]))\n'
            "  > 0.01",
            p.for_(300),
            "warning",
            "the gate in {{ $labels.pod }} turned away {{ $value | humanizePercentage }} of its "
            "high-priority requests",
            "Over the last 30 minutes more than 1% of the requests sent as priority high waited the gate's "
            "max_queue_wait_s without a slot and were answered 503, though they go first and a share of the "
            "in-flight limit (gate.high_reserved_ratio) is theirs alone: the high class alone asks for more "
            "than this pod serves, or than its business line's share of the gate. The lower classes wait "
            "behind it, so they are turned away too.",
        ),
        _alert(
            "ServepilotClassSloBurnFast",
            _class_burn(p.w("1h"), p.w("5m"), fast, min_answers=FAST_MIN_REQUESTS),
            p.for_(120),
            "critical",
            "{{ $labels.priority }}-priority SLO budget of {{ $labels.pod }} burns 14x too fast",
            f"More than {fast:.1%} of the {{{{ $labels.priority }}}}-priority answers the gate relayed "
            "missed their class's latency targets (policies.slo_by_priority, else the SLO) or failed, over "
            "both the last hour and the last 5 minutes ({{ $value | humanizePercentage }} over the hour). A "
            "class that is a small share of the traffic can miss everything while the pod's own burn rate "
            "stays low.",
        ),
        _alert(
            "ServepilotClassSloBurnSlow",
            _class_burn(p.w("6h"), p.w("30m"), slow, min_answers=SLOW_MIN_REQUESTS),
            p.for_(900),
            "warning",
            "{{ $labels.priority }}-priority SLO budget of {{ $labels.pod }} burns 6x too fast",
            f"More than {slow:.1%} of the {{{{ $labels.priority }}}}-priority answers the gate relayed "
            "missed their class's latency targets or failed, over both the last 6 hours and the last 30 "
            "minutes ({{ $value | humanizePercentage }} over the 6 hours): a steady leak of the class's "
            "budget rather than an incident.",
        ),
        _alert(
            "ServepilotTTFTBudgetBurnFast",
            f"namespace_pod:engine_ttft_slo_miss:ratio_rate1h > {fast:g}\n"
            f"and namespace_pod:engine_ttft_slo_miss:ratio_rate5m > {fast:g}\n"
            f"and namespace_pod:engine_ttft_requests:increase1h >= {FAST_MIN_REQUESTS}",
            p.for_(120),
            "critical",
            "TTFT error budget of {{ $labels.pod }} burns 14x too fast",
            f"More than {fast:.1%} of requests missed the {p.ttft_slo_le} s time-to-first-token SLO over "
            "both the last hour and the last 5 minutes ({{ $value | humanizePercentage }} now). At this rate "
            "the 30-day budget is gone in about two days.",
        ),
        _alert(
            "ServepilotTTFTBudgetBurnSlow",
            f"namespace_pod:engine_ttft_slo_miss:ratio_rate6h > {slow:g}\n"
            f"and namespace_pod:engine_ttft_slo_miss:ratio_rate30m > {slow:g}\n"
            f"and namespace_pod:engine_ttft_requests:increase6h >= {SLOW_MIN_REQUESTS}",
            p.for_(900),
            "warning",
            "TTFT error budget of {{ $labels.pod }} burns 6x too fast",
            f"More than {slow:.1%} of requests missed the {p.ttft_slo_le} s TTFT SLO over the last 6 hours "
            "and the last 30 minutes ({{ $value | humanizePercentage }}).",
        ),
        _alert(
            "ServepilotBreakerDegraded",
            "servepilot_breaker_level >= 2",
            p.for_(900),
            "warning",
            "circuit breaker of {{ $labels.pod }} at level {{ $value }} for 15 minutes",
            "servepilot has been shedding load or routing to the fallback model for 15 minutes; "
            "capacity is short of demand for longer than a burst.",
        ),
        _alert(
            "ServepilotMemoryLeak",
            f'max by ({BY}, signal) (servepilot_finding_active{{detector="memory_leak"}}) == 1',
            p.for_(600),
            "warning",
            "memory leak suspected in {{ $labels.pod }} ({{ $labels.signal }})",
            "The leak detector has seen {{ $labels.signal }} grow steadily for 10 minutes beyond what the "
            "load explains; the engine will run out of GPU memory if nothing changes.",
        ),
        _alert(
            "ServepilotFragmentation",
            f'max by ({BY}, signal) (servepilot_finding_active{{detector="fragmentation"}}) == 1',
            p.for_(900),
            "warning",
            "allocator fragmentation in {{ $labels.pod }}",
            "A large share of the memory reserved by the torch caching allocator has been free but unusable "
            "for 15 minutes; large allocations may fail although memory looks available.",
        ),
        _alert(
            "ServepilotSpecDecodeNotPaying",
            f'max by ({BY}) (servepilot_finding_active{{detector="spec_decode", severity="critical"}}) == 1',
            p.for_(900),
            "warning",
            "speculative decoding in {{ $labels.pod }} costs more than it saves",
            "For 15 minutes the engine's draft tokens have been accepted too rarely to pay for drafting and "
            "verifying them (the spec_decode finding's expected speedup is below 1): the pod makes fewer "
            "tokens per GPU-second than it would with speculation off. The traffic has likely moved away "
            "from what the draft predicts (sampling, another language or task).",
        ),
        _alert(
            "ServepilotForecastAboveCapacity",
            f'max by ({BY}) (servepilot_forecast_requests_per_second{{quantile="0.9"}})\n'
            f"> on ({BY}) max by ({BY}) (servepilot_forecast_capacity_requests_per_second)",
            p.for_(600),
            "warning",
            "forecast demand of {{ $labels.pod }} exceeds its capacity",
            "The upper (90 %) forecast of the request rate has been above the sustainable rate for 10 "
            "minutes; add replicas before the peak arrives.",
        ),
        _alert(
            "ServepilotActuationFailing",
            f'sum by ({BY}, knob) (increase(servepilot_actions_total{{result="error"}}[{p.w("30m")}])) >= 3',
            p.for_(60),
            "warning",
            "servepilot cannot change {{ $labels.knob }} in {{ $labels.pod }}",
            "At least 3 actions on {{ $labels.knob }} failed in 30 minutes; the knob is stuck at its last "
            "value and servepilot cannot react.",
        ),
        _alert(
            "ServepilotBrainFailing",
            f"sum by ({BY}, policy) (increase(servepilot_policy_errors_total[{p.w('30m')}])) >= 3\n"
            f"or sum by ({BY}, detector) (increase(servepilot_detector_errors_total[{p.w('30m')}])) >= 3",
            p.for_(300),
            "warning",
            "servepilot {{ with $labels.policy }}policy {{ . }}{{ else }}detector {{ $labels.detector }}"
            "{{ end }} keeps failing in {{ $labels.pod }}",
            "It raised at least 3 times in 30 minutes, and on each such tick it decided nothing: a failing "
            "policy proposes no change (a failing breaker does not shed load), a failing detector raises "
            "no finding. The sidecar's log has the traceback.",
        ),
        _alert(
            "ServepilotActuationPaused",
            f"max by ({BY}) (servepilot_actuation_paused) == 1\n"
            f'and on ({BY}) max by ({BY}) (servepilot_actuation_mode{{mode="act"}}) == 1',
            p.for_(21600),
            "warning",
            "servepilot in {{ $labels.pod }} has been paused for 6 hours in act mode",
            "An operator paused actuation (POST /api/admin/pause) 6 hours ago and nobody resumed it: the "
            "policies still decide, but nothing is applied, so the breaker, the SLO guard and the energy "
            "policy do not act. A pause meant for an incident is easy to forget.",
        ),
        _alert(
            "ServepilotGpuActuatorWaiting",
            f"max by ({BY}, actuator) (servepilot_actuator_waiting) == 1\n"
            f'and on ({BY}) max by ({BY}) (servepilot_actuation_mode{{mode="act"}}) == 1',
            p.for_(1800),
            "warning",
            "servepilot in {{ $labels.pod }} does not know which GPUs to drive",
            "The GPU actuator sees several GPUs, none is named in actuators.gpus, and for 30 minutes the "
            "allocator probe has not named the engine's among them (or named GPUs this container does not "
            "see): nothing is set, so the energy policy saves nothing.",
        ),
        _alert(
            "ServepilotEngineControlUnavailable",
            f"max by ({BY}) (servepilot_engine_control_up) == 0",
            p.for_(900),
            "warning",
            "servepilot has no control of the engine in {{ $labels.pod }}",
            "control.enabled is set but the engine's control API has not been found for 15 minutes; the "
            "engine's own knobs (token budget, batch cap, clock) are not being tuned.",
        ),
        _alert(
            "ServepilotConfigReloadFailed",
            f"max by ({BY}) (servepilot_config_last_reload_successful) == 0",
            p.for_(600),
            "warning",
            "servepilot in {{ $labels.pod }} refused its edited config",
            "The last config reload was refused (invalid, or a change that needs a restart) 10 minutes ago "
            "and none has succeeded since; the sidecar runs on its previous config, not the file.",
        ),
        _alert(
            "ServepilotTlsFilesNotLoaded",
            f"min by ({BY}, file) (servepilot_tls_files_current) == 0",
            p.for_(900),
            "warning",
            "servepilot in {{ $labels.pod }} cannot load the renewed TLS files {{ $labels.file }}",
            "For 15 minutes the TLS files next to {{ $labels.file }} changed on disk but do not load (a "
            "certificate without its key, not PEM) or cannot be read; the old certificate serves on, "
            "until it expires.",
        ),
        _alert(
            "ServepilotAccessLogDropping",
            f"sum by ({BY}) (increase(servepilot_gate_access_log_dropped_total[{p.w('30m')}])) > 0",
            p.for_(300),
            "warning",
            "the gate in {{ $labels.pod }} is losing access log lines",
            "Lines of the gate's access log were dropped over the last 30 minutes: its writer falls behind "
            "(a stalled stdout, a slow disk) or cannot write (a full disk). Requests are served; their "
            "per-request record is lost.",
        ),
        _alert(
            "ServepilotWebhookDeliveryFailing",
            f"max by ({BY}, sink) (servepilot_webhook_oldest_pending_age_seconds) > 300\n"
            f"or sum by ({BY}, sink) (increase(servepilot_webhook_deliveries_total"
            f'{{outcome=~"dropped|expired|evicted"}}[{p.w("30m")}])) > 0',
            p.for_(300),
            "warning",
            "servepilot webhooks to {{ $labels.sink }} are failing",
            "Alert messages from {{ $labels.pod }} to {{ $labels.sink }} are waiting for more than 5 minutes "
            "or were dropped; the receiver may miss servepilot's own alerts.",
        ),
    ]


def build(p: Profile = PRODUCTION) -> dict[str, Any]:
    """The rules file as a mapping, ready for ``yaml.safe_dump``."""
    return {
        "groups": [
            {"name": "servepilot.recording", "rules": recording(p)},
            {"name": "servepilot.alerts", "rules": alerts(p)},
        ]
    }


class _Dumper(yaml.SafeDumper):
    """Writes multi-line PromQL as literal blocks, so the file reads like hand-written rules."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def _header(p: Profile) -> str:
    """The command that wrote the file, with the options that make it differ from the default."""
    options = ""
    if p.ttft_slo_le != PRODUCTION.ttft_slo_le:
        options += f" --ttft-slo-s {p.ttft_slo_le}"
    if p.error_budget != PRODUCTION.error_budget:
        options += f" --error-budget {p.error_budget:g}"
    return f"# Generated by `python -m dashboards.rules{options}`; edit dashboards/rules.py, not this file.\n"


def render(p: Profile = PRODUCTION) -> str:
    header = _header(p)
    return header + yaml.dump(build(p), Dumper=_Dumper, sort_keys=False, width=110, allow_unicode=True)


def render_operator(p: Profile = PRODUCTION) -> str:
    """The same groups as a Prometheus Operator ``PrometheusRule`` resource."""
    resource = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "servepilot",
            "labels": {"app.kubernetes.io/name": "servepilot", "release": "prometheus"},
        },
        "spec": build(p),
    }
    header = _header(p)
    return header + yaml.dump(resource, Dumper=_Dumper, sort_keys=False, width=110, allow_unicode=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dashboards.rules",
        description="Write (or check) servepilot's Prometheus rules and Alertmanager inhibition rules.",
    )
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed file is stale")
    parser.add_argument("--output", type=Path, default=RULES_FILE)
    parser.add_argument("--operator-output", type=Path, default=OPERATOR_FILE)
    parser.add_argument(
        "--ttft-slo-s",
        type=float,
        default=float(PRODUCTION.ttft_slo_le),
        help="the time to first token the pod-wide burn alerts judge by: a bucket bound of both engines' "
        "histograms (0.5, 1, 2.5, 5 ...; default %(default)g); match it to policies.ttft_slo_s",
    )
    parser.add_argument(
        "--error-budget",
        type=float,
        default=PRODUCTION.error_budget,
        help="the share of answers that may miss their targets (default %(default)g: a 99%% objective)",
    )
    args = parser.parse_args(argv)
    try:
        le = slo_bound(args.ttft_slo_s)
    except ValueError as error:
        parser.error(f"--ttft-slo-s: {error}")
    if not 0 < args.error_budget < 1 / FAST_BURN:  # a fast-burn threshold of 100% or more never fires
        parser.error(f"--error-budget must be in (0, {1 / FAST_BURN:.4f}), got {args.error_budget:g}")
    profile = replace(PRODUCTION, ttft_slo_le=le, error_budget=args.error_budget)
    outputs = {
        args.output: render(profile),
        args.operator_output: render_operator(profile),
        inhibit.FRAGMENT_FILE: inhibit.render_fragment(),
        inhibit.OPERATOR_FILE: inhibit.render_operator(),
    }
    if args.check:
        stale = [
            str(path)
            for path, text in outputs.items()
            if not path.exists() or path.read_text("utf-8") != text
        ]
        if stale:
            print(f"stale (run python -m dashboards.rules): {', '.join(stale)}", file=sys.stderr)
            return 1
        return 0
    for path, text in outputs.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
