"""The engines' other model-running routes through the gate: pooling, scoring, reranking, audio, infill,
and the paths an operator adds (``gate.admit_paths``).

Until these were admitted, a reranker's ``/v1/rerank`` or a Whisper model's transcriptions went straight
past the in-flight limit, the line buckets and the priorities: a flood of them filled the engine while the
gate showed it idle. The bodies here are the shapes vLLM's docs give for each route (``query`` and
``documents``; ``text_1``/``text_2``; ``input`` or chat ``messages``; a multipart upload) and llama.cpp's
server README gives for ``/infill``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from agent.config import ConfigError, build
from agent.gate.openai import (
    ADMITTED_PATHS,
    NON_GENERATING_PATHS,
    BadRequest,
    RequestInfo,
    parse_any,
    parse_request,
)
from tests.agent.gate.parked import ParkedEngine, serving, settled
from tests.engines.client import ONE_AT_A_TIME, gate_for

TIMEOUT = 5.0


def _info(path: str, doc: object) -> RequestInfo:
    return parse_request(path, json.dumps(doc).encode())


def test_a_rerank_counts_the_query_and_every_document() -> None:
    body = {"model": "bge-reranker", "query": "q" * 40, "documents": ["d" * 40, {"text": "e" * 80}]}
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        assert _info(path, body) == RequestInfo(False, 10.0 + 10.0 + 20.0, 0.0, "bge-reranker", 1)


def test_score_pooling_and_classify_bodies_are_read_by_field_name() -> None:
    assert _info("/score", {"text_1": "a" * 8, "text_2": ["b" * 8, "c" * 8]}).prompt_tokens == 6.0
    assert _info("/v1/score", {"queries": "a" * 4, "items": ["b" * 4]}).prompt_tokens == 2.0
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x" * 16}]}]}
    assert _info("/pooling", chat).prompt_tokens == 4.0
    assert _info("/classify", {"input": ["x" * 8, "y" * 8]}).prompt_tokens == 4.0
    assert _info("/encode", {"text": "x" * 12}).prompt_tokens == 3.0  # SGLang
    assert _info("/embedding", {"content": [1, 2, 3]}).prompt_tokens == 3.0  # llama.cpp, token ids
    with pytest.raises(BadRequest, match="not valid JSON"):  # a known route's body must be JSON
        parse_request("/v1/rerank", b"query=x")
    with pytest.raises(BadRequest, match="not valid JSON"):
        parse_request("/score", b'{"text_1": NaN}')


def test_a_structured_decision_counts_its_state_questions_and_instructions_not_its_images() -> None:
    """vLLM 0.32's ``/v1/systemone`` (its request schema, StructuredDecisionRequest): model work answered
    in one JSON reply, so admitted and judged as one output. A JSON state is serialised into the prompt;
    an image's base64 data URL is not text."""
    questions = {"q1": {"type": "yes_no", "instructions": "Is the sky blue?"}}
    body = {"model": "m", "state": {"sky": "blue"}, "questions": questions, "instructions": "x" * 8}
    sized = len(json.dumps({"sky": "blue"})) + len(json.dumps(questions)) + 8
    info = _info("/v1/systemone", {**body, "images": ["data:image/png;base64," + "A" * 40_000]})
    assert info == RequestInfo(False, sized / 4, 0.0, "m", 1)
    assert _info("/v1/systemone", {"state": "s" * 40, "questions": {}}).prompt_tokens == (40 + 2) / 4
    assert "/v1/systemone" in ADMITTED_PATHS and "/v1/systemone" in NON_GENERATING_PATHS


def test_llamacpp_infill_counts_the_code_around_the_cursor() -> None:
    body = {
        "input_prefix": "def f(x):\n" * 4,
        "input_suffix": "    return y\n" * 2,
        "input_extra": [{"filename": "util.py", "text": "z" * 40}],
        "prompt": "    y = ",
        "n_predict": 32,
        "stream": True,
    }
    info = _info("/infill", body)
    assert (info.stream, info.max_tokens) == (True, 32.0)
    assert info.prompt_tokens == (40 + 26 + 40 + 8) / 4


def test_an_audio_upload_is_admitted_unread_but_for_its_stream_field() -> None:
    form = b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\nRIFF\r\n--b--\r\n'
    streamed = form.replace(
        b"--b--", b'--b\r\nContent-Disposition: form-data; name="stream"\r\n\r\ntrue\r\n--b--'
    )
    for path in ("/v1/audio/transcriptions", "/v1/audio/translations"):
        assert path in ADMITTED_PATHS
        assert parse_request(path, form) == RequestInfo()
        assert parse_request(path, streamed) == RequestInfo(stream=True)


def test_an_operators_path_takes_any_body_and_reads_what_it_can() -> None:
    doc = {"prompt": "x" * 40, "sampling_params": {"max_new_tokens": 9}, "stream": True, "model": "m"}
    assert parse_any(json.dumps(doc).encode()) == RequestInfo(True, 10.0, 9.0, "m", 1)
    bounded = {"input": "x" * 4, "max_output_tokens": 5, "max_tokens": "many"}  # not a count: skipped
    assert parse_any(json.dumps(bounded).encode()).max_tokens == 5.0
    for body in (b"", b"plain text", b"[1, 2]", b'{"prompt": NaN}', b"\xff\xfe"):
        assert parse_any(body) == RequestInfo(), body  # admitted with no estimate, never refused
    with pytest.raises(BadRequest, match="nested too deeply"):
        parse_any(b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")


@pytest.mark.parametrize("path", ["v1/rerank", "/v1/rerank?x=1", "/v1/*", "/v1/re rank"])
def test_a_bad_admit_path_is_a_config_error_naming_the_field(path: str) -> None:
    with pytest.raises(ConfigError, match=r"^gate\.admit_paths each must be a path such as /v1/rerank"):
        build({"gate": {"enabled": True, "admit_paths": ["/ok", path]}})
    assert build({"gate": {"admit_paths": ["/ok", "/ok"]}}).gate.admit_paths == ("/ok",)


class AnyEngine(ParkedEngine):
    """A reranker's route, a transcription route, an operator's custom route and an unlisted one, each
    answering once ``go`` is set; the rerank answer carries vLLM's ``usage``."""

    path = "/v1/rerank"
    more_paths = ("/v1/audio/transcriptions", "/custom/generate", "/unlisted")

    def __init__(self) -> None:
        super().__init__()
        self.bodies: list[Any] = []

    async def answer(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        self.bodies.append(body)
        await self.go.wait()
        if request.path == "/v1/rerank":
            results = [{"index": 0, "relevance_score": 0.9}]
            return web.json_response({"results": results, "usage": {"prompt_tokens": 17, "total_tokens": 17}})
        return web.json_response({"text": "ok"})


@pytest.fixture
async def upstream() -> AsyncIterator[AnyEngine]:
    async for engine in serving(AnyEngine()):
        yield engine


async def test_reranks_uploads_and_admitted_custom_paths_are_held_to_the_limit(upstream: AnyEngine) -> None:
    upload = aiohttp.FormData()
    upload.add_field("file", b"RIFF....WAVE", filename="a.wav", content_type="audio/wav")
    upload.add_field("model", "whisper")
    rerank = {"query": "q" * 40, "documents": ["d" * 40]}
    async with (
        gate_for(upstream.url, **ONE_AT_A_TIME, admit_paths=("/custom/generate",)) as (gate, base, registry),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
    ):
        tasks = [
            asyncio.create_task(client.post(f"{base}/v1/rerank", json=rerank)),
            asyncio.create_task(client.post(f"{base}/v1/audio/transcriptions", data=upload)),
            asyncio.create_task(client.post(f"{base}/custom/generate", data=b"opaque")),
        ]
        # one at the engine, two waiting: the limit holds on every one of them
        await settled(lambda: gate.admission.queue_depth == 2 and upstream.running == 1)
        assert gate.admission.queue_depth == 2 and upstream.running == 1
        # a path neither built in nor listed passes straight through, past the limit
        unlisted = asyncio.create_task(client.post(f"{base}/unlisted", json={}))
        await settled(lambda: upstream.running == 2)
        assert upstream.running == 2 and gate.admission.queue_depth == 2
        upstream.go.set()
        answers = [await task for task in [*tasks, unlisted]]
        texts = [await resp.text() for resp in answers]
    assert [resp.status for resp in answers] == [200, 200, 200, 200], texts
    assert upstream.peak == 2  # the three admitted one at a time, beside the unlisted one
    forms = [body["raw"] for body in upstream.bodies if "raw" in body]
    assert any(b'filename="a.wav"' in form and b"RIFF....WAVE" in form for form in forms)  # relayed whole
    assert b"opaque" in forms
    done = {"line": "default", "priority": "normal", "outcome": "ok"}
    assert registry.get_sample_value("servepilot_gate_requests_total", done) == 3
    prompt = registry.get_sample_value("servepilot_gate_tokens_total", {"line": "default", "kind": "prompt"})
    assert prompt == 17  # the rerank's usage; the upload and the opaque body add none
