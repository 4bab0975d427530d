"""What the gate reads of an OpenAI request body (agent/gate/openai.py), and what it refuses with a 400."""

from __future__ import annotations

import json

import pytest

from agent.gate.openai import BadRequest, RequestInfo, parse_request


def _info(path: str, doc: object) -> RequestInfo:
    return parse_request(path, json.dumps(doc).encode())


def test_text_is_estimated_by_its_utf8_bytes() -> None:
    """4 bytes a token: 4 characters of English, 0.75 of a token per CJK character (3 bytes), as
    recent BPE vocabularies take about 1 to 1.5 such characters a token. Counted 4 characters a token, a
    Chinese prompt was about a third of its length. Escaped or not in the body, the same text counts the
    same, and a lone surrogate (which JSON can carry) is counted, not a crash."""
    assert _info("/v1/completions", {"prompt": "你好世界" * 1000}).prompt_tokens == 3000.0
    raw = json.dumps({"prompt": "日本語のテキスト"}, ensure_ascii=False).encode()
    assert parse_request("/v1/completions", raw).prompt_tokens == 6.0  # 8 characters, 24 bytes
    chat = {"messages": [{"role": "user", "content": "résumé, naïve"}]}  # 13 characters, 16 bytes
    assert _info("/v1/chat/completions", chat).prompt_tokens == 4.0
    assert _info("/v1/completions", {"prompt": "a\ud800b"}).prompt_tokens == 1.25


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
    # a batch of prompts is a batch of answers, each n times; one list of token ids is one prompt
    assert _info("/v1/completions", {"prompt": ["a", "b", "c"], "n": 2}).choices == 6
    assert _info("/v1/completions", {"prompt": [[1, 2], [3]]}).choices == 2
    assert _info("/v1/completions", {"prompt": [1, 2, 3]}).choices == 1


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


def test_llamacpp_native_completion_is_read_for_prompt_n_predict_and_its_counts() -> None:
    from agent.gate.openai import usage_from_json, usage_from_sse_tail

    info = parse_request("/completion", b'{"prompt": "' + b"x" * 40 + b'", "n_predict": 16, "stream": true}')
    assert info == RequestInfo(True, 10.0, 16.0, "", 1)
    assert parse_request("/completions", b'{"prompt": [1, 2, 3]}') == RequestInfo(False, 3.0, 0.0, "", 1)
    assert parse_request("/completion", b'{"prompt": "p", "n_predict": -1}').max_tokens == 0.0  # to the end
    assert parse_request("/completion", b'{"prompt": ["aaaa", "bb"]}').choices == 2  # two prompts
    with pytest.raises(BadRequest, match="'n_predict' must be a number"):
        parse_request("/completion", b'{"prompt": "p", "n_predict": "8"}')
    # the shapes llama.cpp's server sends (tests/e2e/test_llamacpp.py checks them against a real one)
    plain = b'{"content": "abc", "stop": true, "tokens_predicted": 5, "tokens_evaluated": 11}'
    assert usage_from_json(plain) == (11.0, 5.0)
    assert usage_from_json(b'{"content": "abc"}') is None
    stream = (
        b'data: {"index":0,"content":"a","stop":false,"tokens_predicted":1,"tokens_evaluated":11}\n\n'
        b'data: {"index":0,"content":"","stop":true,"tokens_predicted":5,"tokens_evaluated":11}\n\n'
    )
    assert usage_from_sse_tail(stream) == (11.0, 5.0)
    assert usage_from_sse_tail(stream[-40:]) is None  # its event cut off: the events are counted instead


def test_a_batch_counts_its_prompts_so_one_prompt_s_length_is_known() -> None:
    listed = _info("/v1/completions", {"prompt": ["a" * 400, "b" * 400, "c" * 400], "n": 2})
    assert (listed.prompts, listed.choices, listed.prompt_tokens, listed.prompt_length) == (
        3,
        6,
        300.0,
        100.0,
    )
    chats = [[{"role": "user", "content": "a" * 40}], [{"role": "user", "content": "b" * 40}]]
    batch = _info("/v1/chat/completions/batch", {"messages": chats})
    assert (batch.prompts, batch.prompt_length) == (2, 10.0)
    sglang = _info("/generate", {"text": ["a" * 80, "b" * 80], "sampling_params": {"n": 3}})
    assert (sglang.prompts, sglang.choices, sglang.prompt_length) == (2, 6, 20.0)
    llamacpp = _info("/completion", {"prompt": ["a" * 8] * 4})
    assert (llamacpp.prompts, llamacpp.prompt_length) == (4, 2.0)
    single = _info("/v1/completions", {"prompt": "a" * 400, "n": 4})
    assert (single.prompts, single.prompt_length) == (1, 100.0)  # n answers one prompt


def test_a_list_of_inputs_to_embed_or_score_is_as_many_prompts_and_sequences() -> None:
    """An embeddings batch of short inputs is short inputs, for its bucket and its pool, and as many
    sequences in the engine (vLLM and llama.cpp run each input as a request of its own)."""
    embed = _info("/v1/embeddings", {"input": ["a" * 40] * 10})
    assert (embed.prompts, embed.prompt_length, embed.choices) == (10, 10.0, 10)
    assert _info("/v1/embeddings", {"input": "a" * 40, "n": 3}).choices == 1  # n means nothing here
    assert _info("/v1/embeddings", {"input": [1, 2, 3]}).prompts == 1  # token ids: one input
    rerank = _info("/rerank", {"query": "q" * 40, "documents": ["d" * 40] * 4})
    assert (rerank.prompts, rerank.prompt_length, rerank.choices) == (4, 12.5, 4)  # a pair each
