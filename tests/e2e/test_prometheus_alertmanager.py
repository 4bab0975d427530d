"""End to end with a real Prometheus and Alertmanager (Debian packages), all on loopback, free ports.

The demo is scraped by Prometheus every second with servepilot's rules loaded in the FAST profile (same
expressions, seconds instead of minutes). The demo is the full product, not an observer (started from a
config file, which the test edits and reloads once, as an operator raising a rate would): the trace load
goes through the admission gate in front of the simulated engine; the auto policy set (batch + breaker)
drives the gate's in-flight limit in ``act`` mode, audited, with a simulated GPU power-limit actuator
bound (its value is a knob; no policy in the auto set moves it); a GPU price makes cost per token; the
simulator runs with allocator fragmentation so the fragmentation detector raises a finding; and
forecasts are on. A live forecaster needs closed minutes of history before it can
fit (days for the seasonal models), so the test writes the state file the agent restores at start
(:mod:`tests.dashboards.forecast_seed`: 4 hours of per-minute rates of the bundled trace, ``last_value``
model) -- the path a restarted agent takes. Checks:

1. every dashboard query returns data (``QUIET`` lists exceptions with the reason; it is empty), the
   annotations' events included: a config reload, and an engine restart as its ``/metrics`` tells it (a
   new ``process_start_time_seconds``);
2. a fault in the simulator (``/metrics`` slower than the agent's deadline) makes
   ``ServepilotEngineDown`` fire in Prometheus, reach Alertmanager and arrive at a webhook receiver;
3. the agent's own signed webhook reaches a verifying receiver that was down when the alert fired
   (nothing lost), followed by the resolution once the fault is cleared.

Skipped locally when ``prometheus``/``prometheus-alertmanager`` are missing; a failure when CI=true.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from aiohttp import web
from aiohttp.test_utils import TestServer

from agent import config
from agent.demo_runner import bundled_trace
from agent.engines.launcher import free_port as _free_port
from agent.loadgen import LoadGenerator
from agent.preflight import check_webhooks
from agent.sidecar import Sidecar
from agent.webhooks.receiver import build_receiver_app
from agent.webhooks.signing import decode_secret
from dashboards import generate, inhibit, queries, rules, series
from simulator.engine import make_core
from simulator.server import SimServer
from simulator.specdec import SpecDecodeConfig
from tests.dashboards.forecast_seed import minute_rates, write_forecast_state
from tests.e2e.processes import binaries, process, until

ROOT = Path(__file__).resolve().parents[2]
SECRET = "whsec_c2VydmVwaWxvdC1lMmUtc2VjcmV0LWtleS0zMmJ5dGVzIQ=="
RATE_WINDOW = "15s"
#: Queries allowed to be empty, beyond those naming planned series: (substring, why). None today: the
#: demo drives knobs, raises a finding and restores forecasts (see the module docstring).
QUIET: dict[str, str] = {}


@contextlib.asynccontextmanager
async def _site(app: web.Application, port: int) -> AsyncIterator[TestServer]:
    server = TestServer(app, host="127.0.0.1", port=port)
    await server.start_server()
    try:
        yield server
    finally:
        await server.close()


def _prometheus_config(tmp: Path, agent_port: int, engine_port: int, am_port: int) -> Path:
    (tmp / "rules.yaml").write_text(rules.render(rules.FAST), encoding="utf-8")
    labels = {"namespace": "e2e", "pod": "demo-0"}
    cfg = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "900ms", "evaluation_interval": "1s"},
        "rule_files": [str(tmp / "rules.yaml")],
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
        "scrape_configs": [
            {
                "job_name": "servepilot",
                "static_configs": [{"targets": [f"127.0.0.1:{agent_port}"], "labels": labels}],
            },
            {
                "job_name": "vllm",
                "static_configs": [{"targets": [f"127.0.0.1:{engine_port}"], "labels": labels}],
            },
        ],
    }
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def _alertmanager_config(tmp: Path, receiver_port: int) -> Path:
    cfg = {
        "route": {
            "receiver": "hook",
            "group_by": ["alertname", "pod"],
            "group_wait": "1s",
            "group_interval": "1s",
            "repeat_interval": "1h",
        },
        "receivers": [
            {
                "name": "hook",
                "webhook_configs": [{"url": f"http://127.0.0.1:{receiver_port}/am", "send_resolved": True}],
            }
        ],
        "inhibit_rules": inhibit.inhibit_rules(),  # what we ship: it must load in the real Alertmanager
    }
    path = tmp / "alertmanager.yml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def _agent_config(
    tmp: Path, agent_port: int, engine_port: int, am_port: int, hook_port: int, gate_port: int
) -> config.Config:
    data = yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text(encoding="utf-8"))
    engine = f"http://127.0.0.1:{engine_port}"
    data["agent"]["listen_port"] = agent_port
    data["engine"]["url"] = engine
    data["nvml"]["simulated_url"] = engine
    # simulator, gate, load generator and agent share one event loop on a small CI runner: a simulated
    # NVML read can wait behind the gate's relays for longer than the default 0.5 s
    data["nvml"]["simulated_timeout_s"] = 3.0
    data["probe"]["url"] = f"{engine}/sim/probe/metrics"
    data["gate"] = {
        "enabled": True,
        "listen_port": gate_port,
        "upstreams": {"primary": engine},
        "split": {"primary": 1.0},
        "max_in_flight": 4,  # far below the offered load: the auto policy raises it (actions)
        "default_requests_per_min": 1e6,
        # a line with a share (no traffic of its own): its waiting gauge is a dashboard query with data;
        # and one allowed a request a minute, low priority: what the gate turns away has data too
        "lines": {
            "batch": {"max_in_flight_share": 0.5},
            "capped": {"requests_per_min": 1, "burst_ratio": 1, "priority": "low"},
        },
    }
    data["actuators"] = {
        "mode": "act",
        "gpu": "power_limit",
        "gpu_backend": "simulated",
        "gpu_state_file": str(tmp / "gpu.json"),
    }
    data["audit"] = {"path": str(tmp / "audit.jsonl")}
    data["policies"] = {"set": "auto", "batch_min": 4, "initial_batch": 4, "batch_max": 64}
    data["cost"] = {"price_per_gpu_hour_usd": 2.5, "window_s": 10}
    state = write_forecast_state(tmp / "forecast.json", time.time(), minute_rates(bundled_trace(), speed=4.0))
    data["forecast"] = {"enabled": True, "state_path": str(state)}
    (tmp / "secret").write_text(SECRET, encoding="utf-8")
    data["webhooks"] = {
        "enabled": True,
        "alertmanager_url": f"http://127.0.0.1:{am_port}",
        "generic_url": f"http://127.0.0.1:{hook_port}/hook",
        "secret_file": str(tmp / "secret"),
        "queue_path": str(tmp / "outbox.sqlite"),
        "source_down_after_s": 2,
        "resend_s": 5,
        "backoff_base_s": 0.2,
        "resolve_after_s": 2,
        "backoff_max_s": 1.0,
        "labels": {"namespace": "e2e", "pod": "demo-0"},
    }
    # `servepilot run` always has a config file, and the test reloads it (the reload annotation's data)
    (tmp / "servepilot.yaml").write_text(yaml.safe_dump(data), encoding="utf-8")
    return config.load(tmp / "servepilot.yaml")


def _quiet_reason(expr: str) -> str | None:
    for name in queries.metric_names(expr):
        if name in series.ALL and series.ALL[name].source == "planned":
            return f"planned: {name}"
    return next((why for key, why in QUIET.items() if key in expr), None)


async def _dashboard_results(
    instant: Callable[[str], Awaitable[list[dict[str, Any]]]],
) -> tuple[int, dict[str, str], list[str]]:
    """(queries with data, quiet queries with their reason, queries without data and without reason)."""
    with_data, quiet, empty = 0, {}, []
    for name in generate.ALL:
        for query in queries.dashboard_queries(generate.load(name)):
            expr = queries.substitute(query.expr, {"$__rate_interval": RATE_WINDOW, "$__range": "1m"})
            if await instant(expr):
                with_data += 1
            elif reason := _quiet_reason(query.expr):
                quiet[query.where] = reason
            else:
                empty.append(f"{query.where}: {expr}")
    return with_data, quiet, empty


async def test_dashboards_alerts_and_webhooks_against_real_prometheus_and_alertmanager(
    tmp_path: Path,
) -> None:
    prom_bin, am_bin = binaries()
    agent_port, engine_port, prom_port, am_port, am_hook_port, hook_port, gate_port = (
        _free_port() for _ in range(7)
    )
    started = time.monotonic()

    # drafting 3 tokens (accepted 0.7 each), so the speculative-decoding panel has data too
    sim = SimServer(make_core("a100-80g", "llama-2-7b", spec=SpecDecodeConfig(3)), speed=1.0)
    sim_runner = web.AppRunner(sim.app(), access_log=None, handle_signals=False)
    await sim_runner.setup()
    await web.TCPSite(sim_runner, "127.0.0.1", engine_port).start()

    cfg = _agent_config(tmp_path, agent_port, engine_port, am_port, hook_port, gate_port)
    sidecar = Sidecar(cfg, config_path=str(tmp_path / "servepilot.yaml"))
    hooks = sidecar.webhooks  # the sidecar wires, starts and stops its dispatcher
    assert hooks is not None, "webhooks.enabled is set in the test config"
    await sidecar.start()
    stop_load = asyncio.Event()
    gate_url = f"http://127.0.0.1:{gate_port}"
    gen = LoadGenerator(gate_url, bundled_trace(), model=sim.model_name, speed=4.0, max_in_flight=64)
    load: asyncio.Task[None] | None = None

    am_received: list[dict[str, Any]] = []

    async def am_hook(request: web.Request) -> web.Response:
        am_received.append(await request.json())
        return web.json_response({})

    am_app = web.Application()
    am_app.router.add_post("/am", am_hook)
    hook_app, hook_log = build_receiver_app(decode_secret(SECRET))
    prom_args = [
        prom_bin,
        f"--config.file={_prometheus_config(tmp_path, agent_port, engine_port, am_port)}",
        f"--storage.tsdb.path={tmp_path / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{prom_port}",
        "--enable-feature=exemplar-storage",  # the gate's request ids on its latency histograms
    ]
    am_args = [
        am_bin,
        f"--config.file={_alertmanager_config(tmp_path, am_hook_port)}",
        f"--storage.path={tmp_path / 'am'}",
        f"--web.listen-address=127.0.0.1:{am_port}",
        "--cluster.listen-address=",
    ]
    prom_url, am_url = f"http://127.0.0.1:{prom_port}", f"http://127.0.0.1:{am_port}"
    try:
        with (
            process(prom_args, tmp_path / "prometheus.log"),
            process(am_args, tmp_path / "alertmanager.log"),
        ):
            async with _site(am_app, am_hook_port), aiohttp.ClientSession() as http:

                async def instant(expr: str) -> list[dict[str, Any]]:
                    async with http.get(f"{prom_url}/api/v1/query", params={"query": expr}) as r:
                        body = await r.json()
                    assert body["status"] == "success", f"{expr}: {body}"
                    return list(body["data"]["result"])

                # -- 1. every dashboard query returns data ------------------------------------------
                # The load starts once Prometheus has the knobs' starting values: the auto policy raises
                # the gate's limit within seconds of the first queue, and Prometheus must see the change.
                await until(lambda: instant("servepilot_knob_value"), 30, "knob values in Prometheus")
                load = asyncio.create_task(gen.run(stop_load))
                await until(
                    lambda: instant("rate(vllm:generation_tokens_total[15s]) > 0"), 60, "tokens in Prometheus"
                )
                # Fragmentation in the engine's allocator: the detector raises a finding.
                async with http.post(
                    f"http://127.0.0.1:{engine_port}/sim/faults", json={"fragmentation_ratio": 0.5}
                ) as r:
                    assert r.status == 200
                await until(
                    lambda: instant("namespace_pod:servepilot_energy_joules_per_token:ratio_rate5m"),
                    30,
                    "energy per token",
                )
                await until(lambda: instant("servepilot_finding_score"), 30, "a finding")
                await until(lambda: instant("increase(servepilot_actions_total[2m]) > 0"), 30, "actions")
                await until(lambda: instant("changes(servepilot_knob_value[2m]) > 0"), 30, "a knob change")
                # An operator raises the default line's rate: a reload applies it without a restart.
                edited = yaml.safe_load((tmp_path / "servepilot.yaml").read_text(encoding="utf-8"))
                edited["gate"]["default_requests_per_min"] = 2e6
                (tmp_path / "servepilot.yaml").write_text(yaml.safe_dump(edited), encoding="utf-8")
                assert sidecar.reload("e2e").result == "applied"
                await until(
                    lambda: instant('increase(servepilot_config_reloads_total{result="applied"}[2m]) > 0'),
                    30,
                    "a config reload",
                )
                # The engine restarts, as its /metrics tells it: a new process start time (the engine
                # restarts annotation's data; the sidecar's windows start over, its detectors say why)
                await until(lambda: instant("servepilot_engine_process_start_time_seconds"), 30, "start time")
                sim.engine_metrics.started_at = time.time()
                await until(
                    lambda: instant("changes(servepilot_engine_process_start_time_seconds[2m]) > 0"),
                    30,
                    "an engine restart",
                )
                refused = []
                # one fits the capped line's bucket and the rest are turned away (429); or, low behind the
                # load at the gate's limit, they wait out the queue deadline (503, the bucket refunded)
                for _ in range(3):
                    async with http.post(
                        gate_url + "/v1/completions",
                        json={"model": sim.model_name, "prompt": "hello", "max_tokens": 2},
                        headers={"x-servepilot-line": "capped"},
                    ) as r:
                        refused.append((r.status, await r.text()))
                assert sum(status in (429, 503) for status, _ in refused) >= 2, refused
                turned_away = 'servepilot_gate_requests_total{line="capped", outcome=~"rejected|expired"}'
                await until(  # two scrapes of it in the panel's window
                    lambda: instant(f"rate({turned_away}[{RATE_WINDOW}])"), 30, "the refusals in Prometheus"
                )

                # the gate's TTFT buckets carry request ids as exemplars (OpenMetrics, which Prometheus
                # asks for): from a slow bucket to that request's access line and the engine's log
                async def exemplars() -> list[dict[str, Any]]:
                    now = time.time()
                    params = {"query": "servepilot_gate_ttft_seconds_bucket", "start": now - 300, "end": now}
                    async with http.get(f"{prom_url}/api/v1/query_exemplars", params=params) as r:
                        body = await r.json()
                    assert body["status"] == "success", body
                    return [e for series in body["data"] for e in series["exemplars"]]

                found = await until(exemplars, 30, "exemplars in Prometheus")
                assert all(len(e["labels"]["request_id"]) == 32 for e in found), found[:3]
                with_data, quiet, empty = await _dashboard_results(instant)
                assert empty == [], "dashboard queries without data:\n" + "\n".join(empty)
                assert with_data > 2 * len(quiet), (with_data, quiet)
                print(f"dashboard queries: {with_data} with data, {len(quiet)} quiet: {quiet}")

                # -- 2. a fault fires an alert through Prometheus and Alertmanager ------------------
                async with http.post(
                    f"http://127.0.0.1:{engine_port}/sim/faults", json={"metrics_delay_s": 5}
                ) as r:
                    assert r.status == 200
                await until(
                    lambda: instant('ALERTS{alertname="ServepilotEngineDown", alertstate="firing"}'),
                    30,
                    "alert firing",
                )

                async def in_alertmanager() -> bool:
                    async with http.get(f"{am_url}/api/v2/alerts") as r:
                        alerts = await r.json()
                    return any(a["labels"].get("alertname") == "ServepilotEngineDown" for a in alerts)

                await until(in_alertmanager, 20, "alert in Alertmanager")
                # `servepilot check` reaches the real Alertmanager, and finds the generic receiver down
                rows = {row.name: row for row in await check_webhooks(cfg)}
                assert rows["webhook alertmanager"].status == "ok", rows
                assert rows["webhook alertmanager"].detail.startswith("Alertmanager 0."), rows
                assert rows["webhook generic"].status == "error", rows  # its receiver starts in part 3
                delivered = await until(
                    lambda: asyncio.sleep(
                        0,
                        [
                            a
                            for m in am_received
                            for a in m["alerts"]
                            if a["labels"]["alertname"] == "ServepilotEngineDown" and a["status"] == "firing"
                        ],
                    ),
                    20,
                    "Alertmanager webhook delivery",
                )
                assert delivered[0]["labels"]["severity"] == "critical"
                assert delivered[0]["labels"]["pod"] == "demo-0"

                # -- 3. the agent's own signed webhook survives a receiver outage -------------------
                await until(
                    lambda: asyncio.sleep(
                        0,
                        hooks.outbox.pending("generic") > 0
                        and any(
                            a.labels.get("alertname") == "ServepilotSourceDown"
                            for a in hooks.tracker.active.values()
                        ),
                    ),
                    20,
                    "queued agent webhook for the engine outage",
                )
                await until(
                    lambda: asyncio.sleep(
                        0, hooks.metrics.deliveries.labels("generic", "retry")._value.get() >= 2
                    ),
                    20,
                    "failed attempts while the receiver is down",
                )

                def source_down(status: str) -> list[dict[str, Any]]:
                    # the fragmentation finding sends its own messages; this check is about the outage
                    return [
                        m
                        for m in hook_log.messages
                        if m["status"] == status
                        and any(a["labels"]["alertname"] == "ServepilotSourceDown" for a in m["alerts"])
                    ]

                async with _site(hook_app, hook_port):
                    firing = await until(
                        lambda: asyncio.sleep(0, source_down("firing")), 20, "agent webhook after the outage"
                    )
                    alert = next(
                        a for a in firing[0]["alerts"] if a["labels"]["alertname"] == "ServepilotSourceDown"
                    )
                    assert alert["labels"]["source"] == "engine"
                    async with http.post(
                        f"http://127.0.0.1:{engine_port}/sim/faults", json={"metrics_delay_s": 0}
                    ) as r:
                        assert r.status == 200
                    await until(lambda: asyncio.sleep(0, source_down("resolved")), 30, "resolution webhook")
                assert hook_log.rejected == []
                assert hook_log.messages.index(source_down("firing")[0]) < hook_log.messages.index(
                    source_down("resolved")[0]
                )

                # the agent's alerts also reached Alertmanager through its v2 API
                async with http.get(
                    f"{am_url}/api/v2/alerts", params={"active": "true", "silenced": "false"}
                ) as r:
                    names = {a["labels"]["alertname"] for a in await r.json()}
                assert "ServepilotSourceDown" in names or any(
                    a["labels"]["alertname"] == "ServepilotSourceDown"
                    for m in am_received
                    for a in m["alerts"]
                )
    finally:
        stop_load.set()
        with contextlib.suppress(Exception):
            if load is not None:
                await asyncio.wait_for(load, timeout=3)
        await sidecar.stop()
        await sim_runner.cleanup()
    assert time.monotonic() - started < 180
