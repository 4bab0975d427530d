"""The three servepilot dashboards: overview, per-GPU and energy.

Panels prefer the agent's ``servepilot_`` series (engine-agnostic: the agent maps vLLM, SGLang and
llama.cpp names to one table) and use the engine's own histograms where Prometheus must do the math
over its own windows (SLO miss ratios, quantiles per model). Some series exist only when a feature is on
(the gate, forecasts, actions); :mod:`dashboards.series` says which component exports each.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard

from dashboards.panels import DS, base, expand, q, single, tab, ts, up, variables


def overview() -> dashboard.Dashboard:
    board = variables(
        base("servepilot-overview", "servepilot / overview", "What servepilot sees and does, per engine pod.")
    )
    board = (
        board.annotation(
            dashboard.AnnotationQuery()
            .name("Knob changes")
            .datasource(DS)
            .enable(True)
            .icon_color("orange")
            .expr(expand("changes(servepilot_knob_value{@POD}[2m]) > 0"))
        )
        .annotation(
            dashboard.AnnotationQuery()
            .name("Actions")
            .datasource(DS)
            .enable(True)
            .icon_color("purple")
            .expr(expand("increase(servepilot_actions_total{@POD}[2m]) > 0"))
        )
        .annotation(
            dashboard.AnnotationQuery()
            .name("Config reloads")
            .datasource(DS)
            .enable(True)
            .icon_color("blue")
            .expr(expand('increase(servepilot_config_reloads_total{@POD, result!="unchanged"}[2m]) > 0'))
        )
        .annotation(  # a cold engine explains what moves after it (docs/detectors.md)
            dashboard.AnnotationQuery()
            .name("Engine restarts")
            .datasource(DS)
            .enable(True)
            .icon_color("red")
            .expr(expand("changes(servepilot_engine_process_start_time_seconds{@POD}[2m]) > 0"))
        )
    )
    board = (
        board.with_row(dashboard.Row("Health"))
        .with_panel(up("Engine up", q("min(servepilot_engine_up{@POD})"), "no agent"))
        .with_panel(up("GPU telemetry up", q("min(servepilot_nvml_up{@POD})"), "off (nvml.backend)"))
        .with_panel(
            single("Active findings", "none", q("count(servepilot_finding_active{@POD}) or vector(0)"), 1)
        )
        .with_panel(single("Breaker level", "none", q("max(servepilot_breaker_level{@POD})"), 2))
        .with_panel(
            single(
                "TTFT SLO miss (1 h)",
                "percentunit",
                q("max(namespace_pod:engine_ttft_slo_miss:ratio_rate1h{@POD})"),
                0.01,
            )
        )
        .with_panel(
            single(
                "Tick p99",
                "s",
                q(
                    "histogram_quantile(0.99, sum by (le) "
                    "(rate(servepilot_tick_duration_seconds_bucket{@POD}[$__rate_interval])))"
                ),
            )
        )
        .with_panel(
            ts(
                "Collectors",
                "s",
                q("servepilot_collector_data_age_seconds{@POD}", "{{pod}} {{collector}} data age"),
                q("servepilot_collector_success{@POD}", "{{pod}} {{collector}} ok", "B"),
                q(
                    'sum by (pod, status) (servepilot_collector_status{@POD, status!="ok"})',
                    "{{pod}} collectors {{status}}",
                    "C",
                ),
                q(
                    "sum by (pod, policy) (increase(servepilot_policy_errors_total{@POD}[$__rate_interval]))",
                    "{{pod}} policy {{policy}} errors",
                    "D",
                ),
                q(
                    "sum by (pod, detector) "
                    "(increase(servepilot_detector_errors_total{@POD}[$__rate_interval]))",
                    "{{pod}} detector {{detector}} errors",
                    "E",
                ),
                desc="Staleness of each source, whether its last fetch returned data (1), and how many "
                "collectors answered with nothing yet (no_data: a forecast warming up) or failed (error); "
                "policies and detectors that raised (each skipped that tick: ServepilotBrainFailing).",
                w=24,
            )
        )
        .with_row(dashboard.Row("Engine"))
        .with_panel(
            ts(
                "Requests running and waiting",
                "short",
                q("servepilot_engine_requests_running{@POD}", "{{pod}} running"),
                q("servepilot_engine_requests_waiting{@POD}", "{{pod}} waiting", "B"),
            )
        )
        .with_panel(
            ts("KV cache usage", "percentunit", q("servepilot_engine_kv_cache_usage_ratio{@POD}", "{{pod}}"))
        )
        .with_panel(
            ts(
                "Tokens per second",
                "short",
                q("servepilot_engine_generation_tokens_per_second{@POD}", "{{pod}} generated"),
                q("servepilot_engine_prompt_tokens_per_second{@POD}", "{{pod}} prompt", "B"),
            )
        )
        .with_panel(
            ts(
                "Effective batch",
                "short",
                q(
                    'servepilot_knob_value{@POD, knob=~"batch.max_in_flight|.*max_num_seqs"}',
                    "{{pod}} {{knob}}",
                ),
                q("servepilot_gate_limit{@POD}", "{{pod}} gate limit", "B"),
                q("servepilot_engine_requests_running{@POD}", "{{pod}} running", "C"),
                desc="The in-flight limit servepilot sets against what the engine runs.",
            )
        )
        .with_panel(
            ts(
                "Speculative decoding",
                "percentunit",
                q("servepilot_engine_spec_acceptance_ratio{@POD}", "{{pod}} accepted / drafted tokens"),
                q(
                    "servepilot_engine_spec_accepted_by_position_per_second{@POD}\n"
                    "/ ignoring (position) group_left servepilot_engine_spec_drafts_per_second{@POD}",
                    "{{pod}} drafts with token {{position}} accepted",
                    "B",
                ),
                desc="Empty unless the engine drafts. The share of drafts whose token at each position "
                "(0 = the first drafted) was accepted: a position accepted in few drafts costs more than "
                "it saves, and the spec_decode detector advises a shorter draft (docs/levers.md).",
                w=24,
            )
        )
        .with_row(dashboard.Row("Latency vs SLO"))
        .with_panel(
            ts(
                "TTFT quantiles (agent window)",
                "s",
                q("servepilot_engine_ttft_seconds{@POD}", "{{pod}} p{{quantile}}"),
                q("servepilot_slo_ttft_seconds{@POD}", "SLO", "B"),
            )
        )
        .with_panel(
            ts(
                "TTFT p99 per model (engine histogram)",
                "s",
                q(
                    "histogram_quantile(0.99, sum by (le, model_name) "
                    "(rate(vllm:time_to_first_token_seconds_bucket{@MODEL}[$__rate_interval])))\n"
                    "or histogram_quantile(0.99, sum by (le, model_name) "
                    "(rate(sglang:time_to_first_token_seconds_bucket{@MODEL}[$__rate_interval])))",
                    "{{model_name}}",
                ),
            )
        )
        .with_panel(
            ts(
                "TTFT p99 per request-length bucket (gate)",
                "s",
                q(
                    "histogram_quantile(0.99, sum by (le, bucket) "
                    "(rate(servepilot_gate_ttft_seconds_bucket{@POD}[$__rate_interval])))",
                    "{{bucket}}",
                ).exemplar(True),  # request ids: from a slow point to its access line and engine log
                q("servepilot_slo_ttft_seconds{@POD}", "SLO", "B"),
                desc="Dots are exemplars (Prometheus with --enable-feature=exemplar-storage): a request of "
                "that latency, by its X-Request-Id, to find in the gate's access log and the engine's log.",
            )
        )
        .with_panel(
            ts(
                "Inter-token latency",
                "s",
                q("servepilot_engine_itl_seconds{@POD}", "{{pod}} p{{quantile}}"),
                q("servepilot_slo_itl_seconds{@POD}", "SLO (mean)", "B"),
                q("servepilot_policy_itl_target_seconds{@POD}", "{{pod}} policies' target", "C"),
                desc="The engine's ITL against the configured SLO (a mean target) and the target the "
                "policies steer to: the SLO, or with policies.itl_steering served_classes the tightest "
                "target of the priority classes served lately.",
            )
        )
        .with_panel(
            ts(
                "End-to-end latency p99 per model (engine histogram)",
                "s",
                q(
                    "histogram_quantile(0.99, sum by (le, model_name) "
                    "(rate(vllm:e2e_request_latency_seconds_bucket{@MODEL}[$__rate_interval])))\n"
                    "or histogram_quantile(0.99, sum by (le, model_name) "
                    "(rate(sglang:e2e_request_latency_seconds_bucket{@MODEL}[$__rate_interval])))",
                    "{{model_name}}",
                ),
                w=24,
            )
        )
        .with_row(dashboard.Row("Admission gate"))
        .with_panel(
            ts(
                "Requests by business line and outcome",
                "reqps",
                q(
                    "sum by (line, outcome) (rate(servepilot_gate_requests_total{@POD}[$__rate_interval]))",
                    "{{line}} {{outcome}}",
                ),
                desc="What the gate answered, per business line: ok, rejected (429: over the line's rate "
                "or a full queue), expired (503: waited past the queue deadline), upstream_error, "
                "disconnected. Rates and lines change with a config reload (docs/gate.md).",
                w=8,
            )
        )
        .with_panel(
            ts(
                "Queue wait p99 by priority",
                "s",
                q(
                    "histogram_quantile(0.99, sum by (le, priority) "
                    "(rate(servepilot_gate_queue_wait_seconds_bucket{@POD}[$__rate_interval])))",
                    "{{priority}}",
                ),
                q(
                    "histogram_quantile(0.99, sum by (le) "
                    "(rate(servepilot_gate_held_seconds_bucket{@POD}[$__rate_interval])))",
                    "held by the gate itself",
                    "B",
                ),
                desc="Admission wait of the requests the gate let through, by the class they arrived in (a "
                "request waiting over gate.aging_s is promoted one class and still counted in its own); "
                "and what the gate itself held them for before sending them upstream, the wait aside "
                "(reading and parsing the body, the buckets, admission).",
                w=8,
            )
        )
        .with_panel(
            ts(
                "Gate in flight and queued",
                "short",
                q("servepilot_gate_in_flight{@POD}", "{{pod}} sequences in flight"),
                q("servepilot_gate_queue_depth{@POD}", "{{pod}} queued", "B"),
                q("servepilot_gate_limit{@POD}", "{{pod}} limit", "C"),
                q("servepilot_gate_line_waiting{@POD}", "{{pod}} {{line}} waiting for its share", "D"),
                desc="Sequences at the engine now (a request for n takes n), requests queued for "
                "slots, and the limit (the batch knob). A line "
                "with a share of the gate (gate.lines.<name>.max_in_flight_share) that has used it waits "
                "in its own queue (503 line_share_full at the deadline), shown per line: one tenant "
                "held at its cap, not the gate full.",
                w=8,
            )
        )
        .with_panel(
            ts(
                "Upstreams",
                "short",
                q("servepilot_gate_split_ratio{@POD}", "{{pod}} {{upstream}} split"),
                q("servepilot_gate_upstream_up{@POD}", "{{pod}} {{upstream}} in", "B"),
                q("servepilot_gate_late_requests{@POD}", "{{pod}} {{upstream}} late", "C"),
                q(
                    "increase(servepilot_gate_upstream_ejections_total{@POD}[$__rate_interval])",
                    "{{pod}} {{upstream}} ejected as hung",
                    "D",
                ),
                q(
                    "increase(servepilot_gate_resent_total{@POD}[$__rate_interval])",
                    "{{pod}} {{upstream}} requests taken back",
                    "E",
                ),
                q(
                    "sum by (pod, upstream) "
                    "(increase(servepilot_gate_retried_total{@POD}[$__rate_interval]))",
                    "{{pod}} {{upstream}} error answers retried",
                    "F",
                ),
                desc="Each upstream's share of the split (the breaker and the canary move it); whether it "
                "is in (1: its health check passes and it is not ejected as hung); the requests it holds "
                "that will miss the SLO whatever comes next; its ejections as hung; the requests it "
                "hung on before any byte, sent to another upstream instead; and its 502/503/504 answers "
                "the gate dropped and asked of the next upstream (docs/gate.md).",
                w=8,
            )
        )
        .with_panel(
            ts(
                "Answers missing the SLO (gate)",
                "percentunit",
                q(
                    "sum by (pod, priority) (rate(servepilot_gate_slo_bad_total{@POD}[$__rate_interval]))\n"
                    "/ sum by (pod, priority) (rate(servepilot_gate_answered_total{@POD}[$__rate_interval]))",
                    "{{pod}} {{priority}}",
                ),
                desc="The share of the gate's answers that failed (5xx) or missed the latency SLO: TTFT "
                "and time per output token for a stream, and for an answer in one piece whether it came "
                "by ttft_slo_s + itl_slo_s x (tokens - 1), by the class the request arrived in (a class "
                "of policies.slo_by_priority by its own targets). The verdict the breaker's burn rate and "
                "the canary use (docs/gate.md).",
                w=8,
            )
        )
        .with_panel(
            ts(
                "Turned away by priority",
                "reqps",
                q(
                    "sum by (priority, outcome) (rate(servepilot_gate_requests_total"
                    '{@POD, outcome=~"rejected|expired"}[$__rate_interval]))',
                    "{{priority}} {{outcome}}",
                ),
                q(
                    "sum (rate(servepilot_gate_unauthorized_total{@POD}[$__rate_interval]))",
                    "no API key (401)",
                    "B",
                ),
                q(
                    "sum by (line, reason) (rate(servepilot_gate_refused_total{@POD}[$__rate_interval]))",
                    "{{line}}: {{reason}}",
                    "C",
                ),
                desc="Requests the gate refused, by the class they arrived in: rejected (429: over the "
                "line's rate, a full queue, or shed from it for a higher class) and expired (503: no slot "
                "within the queue deadline). Low goes first; high turned away means the high class alone "
                "asks for more than the pod serves (ServepilotGateShedsHighPriority, docs/alerts.md). "
                "And those without a valid API key, where gate.require_api_key asks for one (401). By "
                "business line and why: request_rate or token_rate (its buckets), queue_full, shed, "
                "queue_timeout, line_share_full; and what it could not read: request_too_large, "
                "unsupported_content_encoding, bad_request (a client sending malformed requests).",
                w=8,
            )
        )
        .with_panel(
            ts(
                "Tokens by business line",
                "short",
                q(
                    "sum by (line, kind) (rate(servepilot_gate_tokens_total{@POD}[$__rate_interval]))",
                    "{{line}} {{kind}}",
                ),
                desc="Prompt and output tokens per second the gate relayed, per business line: as the "
                "engine counted them (the gate asks streams for their usage, gate.stream_usage), else a "
                "stream's token events; a stream cut short by the tokens relayed until then. What a "
                "line's tokens_per_min budget is paid with (docs/gate.md).",
                w=16,
            )
        )
        .with_panel(
            ts(
                "Realtime sessions, shared rates",
                "short",
                q("servepilot_gate_websockets{@POD}", "{{pod}} WebSocket sessions open"),
                q("servepilot_gate_peers{@POD}", "{{pod}} gates sharing the lines' rates", "B"),
                q(
                    "sum by (pod, upstream) "
                    "(increase(servepilot_gate_stream_usage_refused_total{@POD}[$__rate_interval]))",
                    "{{pod}} {{upstream}} streams refused for stream_options",
                    "C",
                ),
                desc="The WebSocket sessions the gate relays now (the engines' realtime APIs); how many "
                "gates share the business lines' rates, each enforcing 1/N of them (gate.peers_dns; 1 "
                "without it: each gate its whole rate); and streams an upstream refused for the "
                "stream_options the gate adds to count tokens, each sent again without it (docs/gate.md).",
                w=8,
            )
        )
        .with_row(dashboard.Row("Forecast and findings"))
        .with_panel(
            ts(
                "Request rate: forecast vs actual",
                "reqps",
                q(
                    "sum by (pod) (rate(vllm:request_success_total{@MODEL}[$__rate_interval]))",
                    "{{pod}} actual",
                ),
                q('servepilot_forecast_requests_per_second{@POD, quantile="0.5"}', "{{pod}} forecast", "B"),
                q('servepilot_forecast_requests_per_second{@POD, quantile="0.1"}', "{{pod}} 10 %", "C"),
                q('servepilot_forecast_requests_per_second{@POD, quantile="0.9"}', "{{pod}} 90 %", "D"),
                q("servepilot_forecast_capacity_requests_per_second{@POD}", "{{pod}} capacity", "E"),
                w=24,
            )
        )
        .with_panel(tab("Active findings", q("servepilot_finding_score{@POD}")))
        .with_panel(
            ts(
                "Findings raised and suppressed per hour, by detector",
                "short",
                q(
                    "sum by (detector, severity) (increase(servepilot_findings_raised_total"
                    '{@POD, severity=~"warning|critical"}[1h]))',
                    "{{detector}} {{severity}}",
                ),
                q(
                    "sum by (detector) (increase(servepilot_findings_suppressed_total{@POD}[1h]))",
                    "{{detector}} suppressed",
                    "B",
                ),
                desc="Warning and critical findings are what the webhooks send (webhooks.min_severity). On a "
                "healthy engine a detector raises a few a day; a detector that raises many, or whose alarm "
                "budget suppresses many, is either seeing a standing problem or needs tuning "
                "(docs/detectors.md).",
                w=24,
            )
        )
        .with_panel(
            tab(
                "Versions (pods per servepilot version, Python and event loop)",
                q("count by (version, python_version, event_loop) (servepilot_build_info{@POD})"),
            )
        )
    )
    return board


def per_gpu() -> dashboard.Dashboard:
    board = variables(
        base("servepilot-gpu", "servepilot / per GPU", "NVML telemetry sampled every 100 ms by servepilot."),
        with_model=False,
    )
    return (
        board.with_panel(
            ts(
                "Utilisation",
                "percentunit",
                q('servepilot_gpu_utilization_ratio{@POD, agg="mean"}', "{{pod}} gpu{{gpu}}"),
            )
        )
        .with_panel(
            ts(
                "Memory bandwidth utilisation",
                "percentunit",
                q(
                    'servepilot_gpu_memory_bandwidth_utilization_ratio{@POD, agg="mean"}',
                    "{{pod}} gpu{{gpu}}",
                ),
            )
        )
        .with_panel(
            ts(
                "Clocks",
                "hertz",
                q('servepilot_gpu_sm_clock_hz{@POD, agg="mean"}', "{{pod}} gpu{{gpu}} SM"),
                q('servepilot_gpu_memory_clock_hz{@POD, agg="mean"}', "{{pod}} gpu{{gpu}} memory", "B"),
            )
        )
        .with_panel(
            ts(
                "Power vs limit",
                "watt",
                q('servepilot_gpu_power_watts{@POD, agg="mean"}', "{{pod}} gpu{{gpu}} mean"),
                q('servepilot_gpu_power_watts{@POD, agg="max"}', "{{pod}} gpu{{gpu}} max", "B"),
                q("servepilot_gpu_power_limit_watts{@POD}", "{{pod}} gpu{{gpu}} limit", "C"),
            )
        )
        .with_panel(
            ts(
                "Temperature",
                "celsius",
                q('servepilot_gpu_temperature_celsius{@POD, agg="max"}', "{{pod}} gpu{{gpu}}"),
            )
        )
        .with_panel(
            ts(
                "Throttle reasons active",
                "short",
                q("servepilot_gpu_throttle_active{@POD}", "{{pod}} gpu{{gpu}} {{reason}}"),
                desc="1 while a clock-event reason (power cap, thermal, idle, ...) was seen during the tick.",
            )
        )
        .with_panel(
            ts(
                "Memory",
                "bytes",
                q("servepilot_gpu_memory_used_bytes{@POD}", "{{pod}} gpu{{gpu}} used"),
                q("servepilot_gpu_memory_total_bytes{@POD}", "{{pod}} gpu{{gpu}} total", "B"),
                q(
                    'servepilot_allocator_reserved_bytes{@POD, device!="all"}',
                    "{{pod}} dev{{device}} torch reserved",
                    "C",
                ),
                w=24,
            )
        )
    )


def energy() -> dashboard.Dashboard:
    board = variables(
        base(
            "servepilot-energy",
            "servepilot / energy",
            "Joules per token and the clock/power settings behind them.",
        )
    )
    return (
        board.with_panel(
            ts(
                "Energy per generated token",
                "J",
                q("namespace_pod:servepilot_energy_joules_per_token:ratio_rate5m{@POD}", "{{pod}}"),
                desc="GPU energy (NVML counter) divided by generated tokens, both over 5 minutes.",
            )
        )
        .with_panel(
            ts(
                "Energy per token (live)",
                "J",
                q(
                    "sum by (pod) (rate(servepilot_gpu_energy_joules{@POD}[$__rate_interval]))\n"
                    "  / sum by (pod) (servepilot_engine_generation_tokens_per_second{@POD} > 0)",
                    "{{pod}}",
                ),
            )
        )
        .with_panel(
            ts(
                "GPU power",
                "watt",
                q("namespace_pod:servepilot_gpu_power_watts:sum{@POD}", "{{pod}} total"),
                q("sum by (pod) (servepilot_gpu_power_limit_watts{@POD})", "{{pod}} limit", "B"),
            )
        )
        .with_panel(
            ts(
                "Settings: clocks and power limits",
                "short",
                q('servepilot_knob_value{@POD, knob=~".*clock.*|.*power.*"}', "{{pod}} {{knob}}"),
                q('servepilot_gpu_sm_clock_hz{@POD, agg="last"} / 1e6', "{{pod}} gpu{{gpu}} SM MHz", "B"),
            )
        )
        .with_panel(
            ts(
                "Energy used",
                "joule",
                q("sum by (pod) (increase(servepilot_gpu_energy_joules{@POD}[$__range]))", "{{pod}}"),
                w=24,
            )
        )
    )


ALL = {"overview": overview, "gpu": per_gpu, "energy": energy}
