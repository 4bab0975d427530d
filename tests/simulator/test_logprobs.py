"""Echo + logprobs on /v1/completions: deterministic per token, shifted in fp8, in the spec's shape."""

from __future__ import annotations

import math
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from simulator import openai_api
from simulator.engine import make_core
from simulator.server import SimServer
from tests.simulator.conftest import ClientFactory, FakeClock
from tests.simulator.test_openapi import check

PROBE = {
    "prompt": "The quick brown fox jumps over the lazy dog.",
    "echo": True,
    "max_tokens": 1,
    "logprobs": 1,
}


async def _served(aiohttp_client: ClientFactory, precision: str, **kwargs: Any) -> TestClient[Any, Any]:
    clock = FakeClock()
    server = SimServer(
        make_core("a100-80g", "llama-2-7b", precision, 64), clock=clock, sleep=clock.sleep, **kwargs
    )
    return await aiohttp_client(server.app())


async def _logprobs(client: TestClient[Any, Any], body: dict[str, Any] = PROBE) -> dict[str, Any]:
    response = await client.post("/v1/completions", json=body)
    assert response.status == 200
    answer: dict[str, Any] = await response.json()
    return answer


async def test_echo_returns_the_prompt_tokens_with_a_null_first_logprob(sim: Any) -> None:
    answer = await _logprobs(sim)
    check(answer, "Completion")
    choice, prompt_tokens = answer["choices"][0], answer["usage"]["prompt_tokens"]
    values = choice["logprobs"]["token_logprobs"]
    assert choice["text"].startswith(PROBE["prompt"])
    assert len(values) == prompt_tokens + 1  # the prompt, then the one generated token
    assert values[0] is None
    assert all(isinstance(v, float) and v < 0 for v in values[1:])
    assert "".join(choice["logprobs"]["tokens"][:prompt_tokens]) == PROBE["prompt"]


async def test_logprobs_are_the_same_on_every_call(sim: Any) -> None:
    first = await _logprobs(sim)
    second = await _logprobs(sim)
    assert first["choices"][0]["logprobs"] == second["choices"][0]["logprobs"]


async def test_logprobs_without_echo_cover_only_the_generated_tokens(sim: Any) -> None:
    answer = await _logprobs(sim, {"prompt": "hello there", "max_tokens": 3, "logprobs": 1})
    logprobs = answer["choices"][0]["logprobs"]
    assert len(logprobs["token_logprobs"]) == 3
    assert None not in logprobs["token_logprobs"]
    assert answer["choices"][0]["text"] == "".join(logprobs["tokens"])


async def test_without_logprobs_the_answer_is_unchanged(sim: Any) -> None:
    answer = await _logprobs(sim, {"prompt": "hello there", "max_tokens": 2})
    assert answer["choices"][0]["logprobs"] is None
    assert not answer["choices"][0]["text"].startswith("hello")


@pytest.mark.parametrize("bad", [{"logprobs": -1}, {"logprobs": True}, {"echo": "yes"}])
async def test_a_malformed_logprobs_request_is_a_400(sim: Any, bad: dict[str, Any]) -> None:
    response = await sim.post("/v1/completions", json={"prompt": "hi", **bad})
    assert response.status == 400


@pytest.mark.parametrize(("delta", "precision"), [(0.003, "fp8"), (0.01, "fp8"), (0.01, "bf16")])
async def test_fp8_raises_each_token_surprisal_by_the_configured_share(
    aiohttp_client: ClientFactory, delta: float, precision: str
) -> None:
    base = await _served(aiohttp_client, "fp16", fp8_ppl_delta=delta)
    other = await _served(aiohttp_client, precision, fp8_ppl_delta=delta)
    reference = (await _logprobs(base))["choices"][0]["logprobs"]["token_logprobs"][1:]
    shifted = (await _logprobs(other))["choices"][0]["logprobs"]["token_logprobs"][1:]
    ratio = math.exp(sum(reference) / len(reference) - sum(shifted) / len(shifted))
    expected = 1.0 + delta if precision == "fp8" else 1.0  # bf16 scores like fp16
    assert ratio == pytest.approx(expected, rel=1e-9)


def test_token_logprob_depends_on_text_and_position() -> None:
    assert openai_api.token_logprob("abcd", 3) == openai_api.token_logprob("abcd", 3)
    assert openai_api.token_logprob("abcd", 3) != openai_api.token_logprob("abcd", 4)
    assert openai_api.token_logprob("abcd", 3) != openai_api.token_logprob("abce", 3)
    assert all(-5.0 <= openai_api.token_logprob(str(i), i) <= -0.5 for i in range(200))


def test_a_token_id_prompt_is_scored_per_id() -> None:
    assert openai_api.prompt_pieces([5, 6, 7]) == ("5", "6", "7")
    assert openai_api.prompt_pieces("abcdefghi") == ("abcd", "efgh", "i")
    assert len(openai_api.prompt_pieces("abcdefghi")) == openai_api.estimate_tokens("abcdefghi")


def test_an_out_of_range_fp8_delta_is_refused() -> None:
    with pytest.raises(ValueError, match="fp8_ppl_delta"):
        SimServer(make_core("a100-80g", "llama-2-7b", "fp16", 64), fp8_ppl_delta=1.5)


def test_the_sim_command_refuses_an_out_of_range_fp8_delta(capsys: pytest.CaptureFixture[str]) -> None:
    from agent.cli import main

    assert main(["sim", "--fp8-ppl-delta", "2"]) == 2
    assert "--fp8-ppl-delta must be in [0, 1), got 2.0" in capsys.readouterr().err
