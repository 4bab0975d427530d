"""llama.cpp /slots: the pure parse on a saved real answer, older formats, and the collector over HTTP."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from agent.collectors.llamacpp_slots import LlamaCppSlotsCollector, parse
from agent.config import EngineConfig
from detectors.snapshot import SourceStatus

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures/expo/llamacpp/llama-server-b11434-slots_busy.json"
ServerFactory = Callable[[web.Application], Awaitable[TestServer]]


def _real() -> list[dict[str, object]]:
    doc: list[dict[str, object]] = json.loads(FIXTURE.read_text(encoding="utf-8"))
    return doc


def test_real_busy_answer_counts_four_busy_slots_of_2048_tokens() -> None:
    values = parse(FIXTURE.read_text(encoding="utf-8"))
    assert values["engine.slots_total"] == 4
    assert values["engine.slots_busy"] == 4
    assert values["engine.slots_busy_ratio"] == 1.0
    assert values["engine.context_capacity_tokens"] == 4 * 2048


def test_context_used_is_prompt_plus_decoded_tokens_of_busy_slots() -> None:
    values = parse(FIXTURE.read_text(encoding="utf-8"))
    # each slot: 231 prompt tokens + 182 decoded
    assert values["engine.context_used_tokens"] == 4 * (231 + 182)
    assert values["engine.kv_cache_usage_ratio"] == pytest.approx(413 / 2048)
    assert values["engine.slot_context_usage_ratio.max"] == pytest.approx(413 / 2048)


def test_idle_slots_hold_no_context_even_with_a_previous_prompt() -> None:
    slots = _real()
    slots[1]["is_processing"] = False
    slots[3]["is_processing"] = False
    values = parse(json.dumps(slots))
    assert values["engine.slots_busy"] == 2
    assert values["engine.context_used_tokens"] == 2 * 413


def test_older_format_with_state_and_next_token_object_is_read() -> None:
    old = [
        {"id": 0, "n_ctx": 1024, "state": 1, "n_prompt_tokens": 100, "next_token": {"n_decoded": 24}},
        {"id": 1, "n_ctx": 1024, "state": 0, "n_prompt_tokens": 7, "next_token": {"n_decoded": 3}},
    ]
    values = parse(json.dumps(old))
    assert values["engine.slots_busy"] == 1
    assert values["engine.context_used_tokens"] == 124


def test_a_slot_never_counts_more_than_its_context() -> None:
    slots = _real()[:1]
    slots[0]["n_prompt_tokens"] = 5000
    assert parse(json.dumps(slots))["engine.slot_context_usage_ratio.max"] == 1.0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("<html>502</html>", "not JSON"),
        ('{"error": "x"}', "expected a JSON list of slot objects, got dict"),
        ('[{"n_ctx": "big"}]', "slot[0].n_ctx must be a number, got 'big'"),
    ],
)
def test_bad_answers_are_one_line_errors(text: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse(text)
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


async def _collect(aiohttp_server: ServerFactory, status: int, body: str) -> tuple[SourceStatus, str | None]:
    async def slots(_request: web.Request) -> web.Response:
        return web.Response(status=status, text=body, content_type="application/json")

    app = web.Application()
    app.router.add_get("/slots", slots)
    server = await aiohttp_server(app)
    collector = LlamaCppSlotsCollector(EngineConfig(url=f"http://127.0.0.1:{server.port}"))
    reading = await collector.collect(now=5.0)
    await collector.close()
    assert reading.observed_at == 5.0
    return reading.status, reading.error


async def test_collector_reads_the_real_answer_over_http(aiohttp_server: ServerFactory) -> None:
    status, error = await _collect(aiohttp_server, 200, FIXTURE.read_text(encoding="utf-8"))
    assert (status, error) == (SourceStatus.OK, None)


async def test_disabled_slots_endpoint_is_no_data_with_the_reason(aiohttp_server: ServerFactory) -> None:
    status, error = await _collect(aiohttp_server, 501, '{"error": {"code": 501}}')
    assert status is SourceStatus.NO_DATA
    assert error is not None and error.endswith("is disabled (start the server with --slots)")


async def test_garbage_is_an_error_reading_not_an_exception(aiohttp_server: ServerFactory) -> None:
    status, error = await _collect(aiohttp_server, 200, "<html>bad gateway</html>")
    assert status is SourceStatus.ERROR
    assert error is not None and "bad answer from" in error and "not JSON" in error


async def test_unreachable_server_is_an_error_reading() -> None:
    collector = LlamaCppSlotsCollector(EngineConfig(url="http://127.0.0.1:9", timeout_s=1.0))
    reading = await collector.collect(now=1.0)
    await collector.close()
    assert reading.status is SourceStatus.ERROR
    assert reading.error is not None and reading.error.startswith(
        "cannot connect to http://127.0.0.1:9/slots"
    )
