"""The shipped inhibition rules (dashboards/inhibit.py) in a real Alertmanager: alerts posted to its API
as Prometheus would send them, then read back with what mutes each.

A hung engine in pod llm-0 fires its stall alert, its TTFT burn alerts, its breaker level and its gate's
upstream for it out (named ``vllm`` here: the ``role="engine"`` label, not the name, marks it); pod llm-1
burns its budget for its own reason and its engine answers 503s, so its breaker has degraded; pod llm-2's
engine is down, so its gate retries that engine's errors elsewhere; pod llm-3's breaker has degraded while
only its fp8 upstream fails, and its high class burns its own budget fast and slowly. Only the consequences
are muted (llm-0's, llm-1's breaker and class burns, llm-2's 503s, llm-3's high class's slow burn); the
stall and down alerts themselves, another upstream out or failing, one without a role (a gate older than
the role series), llm-1's fast burn, llm-3's breaker and its low class's slow burn stay visible.
"""

from __future__ import annotations

import datetime
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from agent.engines.launcher import free_port
from dashboards import inhibit
from tests.e2e.processes import binaries, process, until

MUTED = {
    ("ServepilotTTFTBudgetBurnFast", "llm-0", ""),
    ("ServepilotTTFTBudgetBurnSlow", "llm-0", ""),
    ("ServepilotBreakerDegraded", "llm-0", ""),
    ("ServepilotGateShedsHighPriority", "llm-0", ""),  # nothing is served while it hangs
    ("ServepilotClassSloBurnFast", "llm-0", "high"),
    ("ServepilotClassSloBurnSlow", "llm-0", "low"),
    ("ServepilotClassSloBurnFast", "llm-1", "high"),  # the whole pod burns: its fast burn pages instead
    ("ServepilotClassSloBurnSlow", "llm-1", "normal"),
    ("ServepilotClassSloBurnSlow", "llm-3", "high"),  # its own class's fast burn pages instead
    ("ServepilotGateUpstreamOut", "llm-0", "vllm"),
    ("ServepilotGateUpstreamFailing", "llm-2", "vllm"),  # its engine is down: the 503s follow
    ("ServepilotTTFTBudgetBurnSlow", "llm-1", ""),  # its own fast burn pages instead
    ("ServepilotBreakerDegraded", "llm-1", ""),  # its engine's 503s page instead
}
"""What the rules must mute: everything else posted stays visible (the stall and down alerts, the fp8
and role-less upstreams, the memory leak, llm-1's fast burn and its engine's 503s, llm-3's breaker, which
a failing fp8 upstream does not explain, llm-1's shed high-priority requests, its engine being up,
llm-3's high class burning its own SLO, with nothing pod-wide to explain it, and llm-3's low class
burning slowly: another class than the one paging)."""


def _alert(name: str, pod: str, **labels: str) -> dict[str, Any]:
    now = datetime.datetime.now(datetime.UTC)
    return {
        "labels": {"alertname": name, "namespace": "ml", "pod": pod, "severity": "warning", **labels},
        "annotations": {"summary": name},
        "startsAt": now.isoformat(),
        "endsAt": (now + datetime.timedelta(minutes=10)).isoformat(),
    }


async def test_a_hung_engine_pages_once_and_the_rest_of_its_pod_is_muted(tmp_path: Path) -> None:
    _, am_bin = binaries()
    cfg = {
        "route": {"receiver": "null", "group_wait": "1s"},
        "receivers": [{"name": "null"}],
        "inhibit_rules": inhibit.inhibit_rules(),
    }
    config_path = tmp_path / "alertmanager.yml"
    config_path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    amtool = Path(am_bin).with_name("amtool")  # Debian's prometheus-alertmanager ships it beside
    check = subprocess.run([str(amtool), "check-config", str(config_path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    port = free_port()
    args = [
        am_bin,
        f"--config.file={config_path}",
        f"--storage.path={tmp_path / 'am'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--cluster.listen-address=",
    ]
    url = f"http://127.0.0.1:{port}/api/v2/alerts"
    hung = [
        _alert("ServepilotEngineStalled", "llm-0", severity="critical"),
        _alert("ServepilotTTFTBudgetBurnFast", "llm-0", severity="critical"),
        _alert("ServepilotTTFTBudgetBurnSlow", "llm-0"),
        _alert("ServepilotBreakerDegraded", "llm-0"),
        _alert("ServepilotGateShedsHighPriority", "llm-0"),
        _alert("ServepilotClassSloBurnFast", "llm-0", severity="critical", priority="high"),
        _alert("ServepilotClassSloBurnSlow", "llm-0", priority="low"),
        _alert("ServepilotGateUpstreamOut", "llm-0", upstream="vllm", role="engine"),
        _alert("ServepilotGateUpstreamOut", "llm-0", upstream="fp8", role="other"),
        _alert("ServepilotGateUpstreamOut", "llm-0", upstream="primary"),
        _alert("ServepilotMemoryLeak", "llm-0", signal="engine.gpu_memory"),
    ]
    other = [
        _alert("ServepilotTTFTBudgetBurnFast", "llm-1", severity="critical"),
        _alert("ServepilotTTFTBudgetBurnSlow", "llm-1"),
        _alert("ServepilotGateUpstreamFailing", "llm-1", upstream="vllm", role="engine"),  # engine up
        _alert("ServepilotBreakerDegraded", "llm-1"),
        _alert("ServepilotGateShedsHighPriority", "llm-1"),
        _alert("ServepilotClassSloBurnFast", "llm-1", severity="critical", priority="high"),
        _alert("ServepilotClassSloBurnSlow", "llm-1", priority="normal"),
        _alert("ServepilotEngineDown", "llm-2", severity="critical"),
        _alert("ServepilotGateUpstreamFailing", "llm-2", upstream="vllm", role="engine"),
        _alert("ServepilotGateUpstreamFailing", "llm-2", upstream="fp8", role="other"),
        _alert("ServepilotGateUpstreamFailing", "llm-3", upstream="fp8", role="other"),
        _alert("ServepilotBreakerDegraded", "llm-3"),
        _alert("ServepilotClassSloBurnFast", "llm-3", severity="critical", priority="high"),
        _alert("ServepilotClassSloBurnSlow", "llm-3", priority="high"),
        _alert("ServepilotClassSloBurnSlow", "llm-3", priority="low"),
    ]
    with process(args, tmp_path / "alertmanager.log"):
        async with aiohttp.ClientSession() as http:

            async def post() -> bool:
                async with http.post(url, json=hung + other) as response:
                    return response.status == 200

            await until(post, 20, "Alertmanager to take the alerts")

            seen: dict[tuple[str, str, str], list[str]] = {}

            async def muted_as_expected() -> bool:
                """Inhibition is worked out apart from the API: read until the muted set is the expected one
                (``seen`` holds the last read, for the failure message)."""
                async with http.get(url) as response:
                    alerts = await response.json()
                seen.clear()
                for a in alerts:
                    labels = a["labels"]
                    which = labels.get("upstream") or labels.get("priority", "")  # upstream or class
                    seen[labels["alertname"], labels["pod"], which] = a["status"]["inhibitedBy"]
                return len(seen) == len(hung + other) and {key for key, by in seen.items() if by} == MUTED

            try:
                await until(muted_as_expected, 20, "the expected alerts muted")
            except AssertionError as error:
                raise AssertionError(f"{error}; last read: {seen}") from None
