"""OpenAI request parsing and token estimation."""

from __future__ import annotations

import pytest

from simulator.openai_api import ApiError, parse

MODEL = "meta-llama/Llama-2-7b-hf"


def test_text_prompt_is_about_four_characters_per_token() -> None:
    assert parse("completion", {"prompt": "x" * 401}, MODEL).prompt_tokens == 101


def test_token_id_prompt_counts_exactly() -> None:
    assert parse("completion", {"prompt": [1, 2, 3]}, MODEL).prompt_tokens == 3


def test_chat_adds_template_tokens_per_message() -> None:
    body = {"messages": [{"role": "system", "content": "x" * 40}, {"role": "user", "content": "y" * 40}]}
    assert parse("chat", body, MODEL).prompt_tokens == 20 + 8


def test_completion_defaults_to_16_tokens_like_openai() -> None:
    assert parse("completion", {"prompt": "hi"}, MODEL).max_tokens == 16


@pytest.mark.parametrize(
    "body",
    [
        [],
        {"prompt": "a", "max_tokens": 0},
        {"prompt": "a", "stream": "yes"},
        {"prompt": ["a", 3]},
        {"prompt": []},
        {},
    ],
)
def test_malformed_bodies_are_400(body: object) -> None:
    with pytest.raises(ApiError) as error:
        parse("completion", body, MODEL)
    assert error.value.status == 400


def test_other_model_is_404() -> None:
    with pytest.raises(ApiError) as error:
        parse("completion", {"prompt": "a", "model": "gpt-9"}, MODEL)
    assert error.value.status == 404
