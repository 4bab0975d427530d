"""Perplexity through /v1/completions (echo + logprobs): against the real simulator app on loopback, and
against small stand-in upstreams for each way an answer can be bad."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from agent.perplexity import (
    PerplexityError,
    load_validation_set,
    measure,
    perplexity,
    prompt_logprobs,
)
from simulator.engine import make_core
from simulator.server import SimServer
from tests.simulator.conftest import FakeClock

TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Perplexity is the exponential of the mean negative log-likelihood per token.",
    "Short one.",
)


async def _simulator(precision: str = "fp16", **kwargs: Any) -> TestServer:
    clock = FakeClock()
    core = make_core("a100-80g", "llama-2-7b", precision, 64)
    server = TestServer(SimServer(core, clock=clock, sleep=clock.sleep, **kwargs).app())
    await server.start_server()
    return server


async def _stand_in(handler: Callable[[web.Request], Any]) -> TestServer:
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    server = TestServer(app)
    await server.start_server()
    return server


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def _url(server: TestServer) -> str:
    return str(server.make_url("")).rstrip("/")


# -- the validation set -------------------------------------------------------------------------------
def test_a_validation_set_is_one_text_per_line_with_blank_lines_skipped(tmp_path: Path) -> None:
    path = tmp_path / "val.txt"
    path.write_text("first text\n\n   \nsecond text\n", encoding="utf-8")
    assert load_validation_set(path) == ("first text", "second text")


def test_a_validation_set_may_be_jsonl_with_a_text_field(tmp_path: Path) -> None:
    path = tmp_path / "val.jsonl"
    path.write_text('{"text": "one", "id": 1}\n\n{"text": "two"}\n', encoding="utf-8")
    assert load_validation_set(path) == ("one", "two")


def test_an_empty_validation_set_is_a_one_line_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.txt"
    path.write_text("\n \n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"validation set '.*empty\.txt' holds no texts"):
        load_validation_set(path)


def test_an_unreadable_validation_set_is_a_one_line_error_naming_the_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"cannot read validation set '.*missing\.txt'") as caught:
        load_validation_set(tmp_path / "missing.txt")
    assert "\n" not in str(caught.value)


def test_a_json_line_without_text_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "val.jsonl"
    path.write_text('{"text": "ok"}\n{"prompt": "no text"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match="line 2 has no non-empty"):
        load_validation_set(path)


# -- the pure parts -----------------------------------------------------------------------------------
def _answer(values: list[Any], prompt_tokens: int) -> dict[str, Any]:
    return {
        "choices": [{"text": "x", "logprobs": {"token_logprobs": values}}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 1},
    }


def test_prompt_logprobs_drop_the_first_token_and_the_generated_one() -> None:
    assert prompt_logprobs(_answer([None, -1.0, -2.0, -9.0], 3)) == [-1.0, -2.0]


def test_perplexity_is_exp_of_the_mean_negative_logprob() -> None:
    assert perplexity([-1.0, -3.0]) == pytest.approx(math.exp(2.0))
    with pytest.raises(ValueError):
        perplexity([])


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        ({"choices": [{"text": "x", "logprobs": None}], "usage": {"prompt_tokens": 2}}, "no choices"),
        (_answer([None, -1.0], 0), "usage.prompt_tokens"),
        (_answer([None, -1.0], 5), "2 entries for 5 prompt tokens"),
        (_answer([None, None, -1.0], 3), "prompt token 1 has log-probability None"),
        (_answer([None, float("nan"), -1.0], 3), "prompt token 1 has log-probability nan"),
        (_answer([None, 0.5, -1.0], 3), "positive log-probability"),
    ],
)
def test_a_bad_answer_is_one_readable_error(answer: dict[str, Any], why: str) -> None:
    with pytest.raises(PerplexityError, match=r"upstream 'fp8'") as caught:
        prompt_logprobs(answer, "fp8")
    assert why in str(caught.value)


# -- against the simulator ----------------------------------------------------------------------------
async def test_the_simulator_has_a_finite_perplexity_that_repeats(http: aiohttp.ClientSession) -> None:
    server = await _simulator()
    try:
        first = await measure(http, "primary", _url(server), TEXTS)
        second = await measure(http, "primary", _url(server), TEXTS)
    finally:
        await server.close()
    assert math.isfinite(first.ppl) and first.ppl > 1.0
    assert first.ppl == second.ppl
    assert first.model == "meta-llama/Llama-2-7b-hf"  # asked of /v1/models
    # one scored token fewer than the prompt per text (the first has no logprob)
    assert first.tokens == sum(math.ceil(len(t) / 4) - 1 for t in TEXTS)


@pytest.mark.parametrize("delta", [0.003, 0.01])
async def test_fp8_perplexity_is_higher_by_the_configured_delta(
    http: aiohttp.ClientSession, delta: float
) -> None:
    primary = await _simulator("fp16", fp8_ppl_delta=delta)
    fp8 = await _simulator("fp8", fp8_ppl_delta=delta)
    try:
        reference = await measure(http, "primary", _url(primary), TEXTS)
        candidate = await measure(http, "fp8", _url(fp8), TEXTS)
    finally:
        await primary.close()
        await fp8.close()
    assert candidate.ppl / reference.ppl - 1.0 == pytest.approx(delta, rel=1e-6)


async def test_an_upstream_answering_500_is_a_readable_error(http: aiohttp.ClientSession) -> None:
    server = await _simulator()
    try:
        faults = await http.post(f"{_url(server)}/sim/faults", json={"error_rate": 1.0, "error_status": 500})
        assert faults.status == 200
        with pytest.raises(PerplexityError) as caught:
            await measure(http, "fp8", _url(server), TEXTS, model="meta-llama/Llama-2-7b-hf")
    finally:
        await server.close()
    message = str(caught.value)
    assert "upstream 'fp8'" in message and "HTTP 500" in message and "injected fault" in message


async def test_an_upstream_without_logprobs_is_a_readable_error(http: aiohttp.ClientSession) -> None:
    async def no_logprobs(request: web.Request) -> web.Response:
        return web.json_response(
            {"choices": [{"text": "hi", "logprobs": None}], "usage": {"prompt_tokens": 3}}
        )

    server = await _stand_in(no_logprobs)
    try:
        with pytest.raises(PerplexityError, match=r"upstream 'fp8'.*no choices\[0\]\.logprobs"):
            await measure(http, "fp8", _url(server), TEXTS, model="m")
    finally:
        await server.close()


async def test_a_nan_in_the_answer_is_a_readable_error(http: aiohttp.ClientSession) -> None:
    async def nan(request: web.Request) -> web.Response:
        text = '{"choices": [{"logprobs": {"token_logprobs": [null, NaN]}}], "usage": {"prompt_tokens": 2}}'
        return web.Response(text=text, content_type="application/json")

    server = await _stand_in(nan)
    try:
        with pytest.raises(PerplexityError, match=r"upstream 'fp8'.*non-finite number \(NaN\)"):
            await measure(http, "fp8", _url(server), TEXTS, model="m")
    finally:
        await server.close()


async def test_a_silent_upstream_times_out_within_the_bound(http: aiohttp.ClientSession) -> None:
    never = asyncio.Event()

    async def silent(request: web.Request) -> web.Response:
        await never.wait()
        return web.Response()

    server = await _stand_in(silent)
    try:
        with pytest.raises(PerplexityError, match=r"upstream 'fp8'.*no answer .* within 0\.05 s"):
            await measure(http, "fp8", _url(server), TEXTS, model="m", timeout_s=0.05)
    finally:
        never.set()
        await server.close()
