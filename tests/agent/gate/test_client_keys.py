"""The gate as the clients' door (``gate.require_api_key``), and the engine's own key
(``gate.upstream_api_key_file``): clients hold the gate's keys, each naming its business line; the
engine, started with ``--api-key``, is sent its own key in their place. Against real vLLM:
tests/e2e/test_vllm_tls.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from agent.config import ConfigError, GateConfig, GateLineConfig, build
from agent.gate.upstreams import upstream_auth
from tests.agent.gate.parked import ParkedEngine, serving
from tests.engines.client import gate_for

TIMEOUT = 5.0
KEYS = {"sk-chat-1": "chat", "sk-batch-1": "batch"}


class Keyed(ParkedEngine):
    """``/v1/completions`` (admitted) and ``/tokenize`` (passed through), answered at once; keeps the
    ``Authorization`` each request came with."""

    path = "/v1/completions"
    more_paths = ("/tokenize",)

    def __init__(self) -> None:
        super().__init__()
        self.go.set()
        self.auth: list[str | None] = []

    async def answer(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        self.auth.append(request.headers.get("Authorization"))
        return web.json_response(
            {"choices": [{"text": "a"}], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
        )


@pytest.fixture
async def engine() -> AsyncIterator[Keyed]:
    async for served in serving(Keyed()):
        yield served


async def _post(base: str, path: str, key: str | None) -> tuple[int, Any, str | None]:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
        client.post(f"{base}{path}", json={"prompt": "hi", "max_tokens": 1}, headers=headers) as resp,
    ):
        return resp.status, await resp.json(), resp.headers.get("WWW-Authenticate")


async def test_without_a_known_key_every_path_is_refused_before_the_engine(engine: Keyed) -> None:
    async with gate_for(engine.url, api_keys=KEYS, require_api_key=True) as (_, base, registry):
        refused = [
            await _post(base, path, key)
            for path in ("/v1/completions", "/tokenize")
            for key in (None, "sk-nope")
        ]
        passed = [await _post(base, path, "sk-chat-1") for path in ("/v1/completions", "/tokenize")]
        ok = {"line": "chat", "priority": "normal", "outcome": "ok"}
        tally = registry.get_sample_value("servepilot_gate_requests_total", ok)
    assert [(status, doc["error"]["code"], challenge) for status, doc, challenge in refused] == [
        (401, "invalid_api_key", "Bearer")
    ] * 4
    assert all("sk-nope" not in doc["error"]["message"] for _, doc, _ in refused)  # never echoed
    assert [status for status, _, _ in passed] == [200, 200]
    assert engine.auth == ["Bearer sk-chat-1"] * 2  # the refused never reached it
    assert registry.get_sample_value("servepilot_gate_unauthorized_total") == 4
    assert tally == 1  # the admitted one, on its key's line


async def test_a_browsers_cors_preflight_passes_without_a_key(engine: Keyed) -> None:
    """Browsers send it without credentials before a cross-origin POST; the engine answers it. It runs
    nothing: through llama.cpp it was admitted as a request until 2026-12-06, charged to its line's
    bucket (x-ratelimit-remaining-requests 1999 of 2000) and timed as a 0-token answer."""
    async with (
        gate_for(engine.url, api_keys=KEYS, require_api_key=True) as (gate, base, registry),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
    ):
        async with client.options(
            f"{base}/v1/completions", headers={"Origin": "https://app.example"}
        ) as resp:
            assert (
                resp.status == 405
            )  # the fake engine serves no OPTIONS (aiohttp says so), not the gate: 401
            assert "x-ratelimit-remaining-requests" not in resp.headers
        counted = [
            s
            for m in registry.collect()
            if m.name == "servepilot_gate_requests"
            for s in m.samples
            if s.value
        ]
        assert counted == [] and gate.admission.in_flight == 0


async def test_without_require_api_key_an_unknown_key_goes_to_the_default_line(engine: Keyed) -> None:
    async with gate_for(engine.url, api_keys=KEYS) as (_, base, registry):
        assert (await _post(base, "/v1/completions", "sk-nope"))[0] == 200
    ok = {"line": "default", "priority": "normal", "outcome": "ok"}
    assert registry.get_sample_value("servepilot_gate_requests_total", ok) == 1


async def test_the_engine_gets_its_own_key_in_place_of_the_clients(engine: Keyed, tmp_path: Path) -> None:
    key_file = tmp_path / "engine-key"
    key_file.write_text("engine-secret-1\n")
    settings = {"api_keys": KEYS, "require_api_key": True, "upstream_api_key_file": str(key_file)}
    async with gate_for(engine.url, **settings) as (_, base, _registry):
        for path in ("/v1/completions", "/tokenize"):
            assert (await _post(base, path, "sk-batch-1"))[0] == 200
    assert engine.auth == ["Bearer engine-secret-1"] * 2


def test_require_api_key_needs_keys_to_pass() -> None:
    with pytest.raises(ConfigError, match="require_api_key needs api_keys or api_keys_file"):
        build({"gate": {"enabled": True, "require_api_key": True}})
    assert GateConfig(require_api_key=True, api_keys=KEYS).require_api_key


def test_an_empty_keys_file_refuses_everyone_rather_than_the_config(tmp_path: Path) -> None:
    """Every key revoked is a change an operator may make; the config stays valid."""
    empty = tmp_path / "keys.yaml"
    empty.write_text("")
    cfg = build({"gate": {"enabled": True, "require_api_key": True, "api_keys_file": str(empty)}})
    assert cfg.gate.api_keys == {}


@pytest.mark.parametrize(
    ("content", "why"),
    [(None, "cannot read it"), ("", "must hold one key"), ("s3cr3t words", "must hold one key")],
)
def test_an_unusable_engine_key_file_is_a_config_error_naming_the_field(
    tmp_path: Path, content: str | None, why: str
) -> None:
    path = tmp_path / "engine-key"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=why) as caught:
        upstream_auth(GateConfig(upstream_api_key_file=str(path)))
    assert caught.value.field == "gate.upstream_api_key_file"
    assert "s3cr3t" not in str(caught.value)  # never the content


async def test_a_line_cannot_ask_for_a_class_above_its_cap(engine: Keyed) -> None:
    """Any client may send the priority header; a tenant's line capped at ``low`` is served as low
    whatever it asks, while an uncapped line gets the class it asks for."""
    lines = {"batch": GateLineConfig(priority="low", max_priority="low"), "chat": GateLineConfig()}
    async with (
        gate_for(engine.url, api_keys=KEYS, lines=lines) as (_, base, registry),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
    ):
        for key in ("sk-batch-1", "sk-chat-1"):
            headers = {"Authorization": f"Bearer {key}", "x-servepilot-priority": "high"}
            async with client.post(f"{base}/v1/completions", json={"prompt": "hi"}, headers=headers) as resp:
                assert resp.status == 200

    def served(line: str, priority: str) -> float | None:
        labels = {"line": line, "priority": priority, "outcome": "ok"}
        return registry.get_sample_value("servepilot_gate_requests_total", labels)

    assert (served("batch", "low"), served("batch", "high")) == (1.0, None)
    assert served("chat", "high") == 1.0


def test_a_lines_own_class_cannot_be_above_its_cap() -> None:
    with pytest.raises(ConfigError, match="priority 'normal' is above max_priority 'low'"):
        build({"gate": {"lines": {"batch": {"max_priority": "low"}}}})
