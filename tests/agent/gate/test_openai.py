"""What the gate reads of an OpenAI request body (agent/gate/openai.py), and what it refuses with a 400."""

from __future__ import annotations

import json

import pytest

from agent.gate.openai import BadRequest, RequestInfo, parse_request


def _info(path: str, doc: object) -> RequestInfo:
    return parse_request(path, json.dumps(doc).encode())


def test_stream_tokens_model_and_choices_of_each_path() -> None:
    info = _info("/v1/completions", {"model": "m", "prompt": "x" * 40, "max_tokens": 64, "stream": True})
    assert info == RequestInfo(stream=True, prompt_tokens=10.0, max_tokens=64.0, model="m", choices=1)
    chat = {"messages": [{"role": "user", "content": "y" * 8}], "max_completion_tokens": 5, "n": 3}
    assert _info("/v1/chat/completions", chat) == RequestInfo(False, 2.0, 5.0, "", 3)
    # best_of generates that many answers and returns n of them: the larger one bounds the tokens
    assert _info("/v1/completions", {"prompt": "p", "n": 2, "best_of": 4}).choices == 4
    for odd in (0, -1, 1.5, True, "2", None):  # the engine refuses these; the gate counts one answer
        assert _info("/v1/completions", {"prompt": "p", "n": odd}).choices == 1
    assert _info("/v1/embeddings", {"input": "z" * 12}) == RequestInfo(False, 3.0, 0.0, "", 1)
    assert parse_request("/v1/models", b"") == RequestInfo()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{", "request body is not valid JSON"),
        (b"[1]", "request body must be a JSON object"),
        (b'{"messages": "hi"}', "'messages' must be a list"),
        (b'{"prompt": "p", "max_tokens": -1}', "'max_tokens' must be a number in [0,"),
        (b'{"prompt": "p", "max_tokens": NaN}', "request body is not valid JSON"),
    ],
)
def test_bad_bodies_are_a_bad_request_naming_what_is_wrong(body: bytes, message: str) -> None:
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    with pytest.raises(BadRequest, match=message.replace("[", r"\[")):
        parse_request(path, body)
