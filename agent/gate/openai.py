"""What the gate needs to know about an OpenAI-style request body, and its JSON error bodies. Pure.

Besides OpenAI's paths, SGLang's native ``/generate`` (``text`` or ``input_ids``, one prompt or a batch,
``sampling_params.max_new_tokens``; each answer's ``meta_info`` counts its tokens) is read too: it is
what SGLang's own clients, router and RL frameworks send. So is llama.cpp's native ``/completion``
(``prompt``, ``n_predict``; each event counts ``tokens_evaluated`` and ``tokens_predicted``), and its
``/infill`` (the same, with the code around the cursor in ``input_prefix``/``input_suffix``/``input_extra``).
vLLM's Anthropic-compatible ``/v1/messages``, its batch chat (``/v1/chat/completions/batch``) and the
SageMaker route ``/invocations`` it serves are admitted like chat.

The engines' other model-running routes are admitted too (:data:`POOLING_PATHS`, :data:`AUDIO_PATHS`):
a rerank or score request runs a forward pass over every document, and a transcription decodes like a
chat, so passed straight through they took engine capacity past the in-flight limit and the buckets.
Their bodies are read for what prompt they carry, by field name (:func:`_by_field`); an audio upload
is a multipart form, admitted unread. Paths named in ``gate.admit_paths`` are read the same way.

The gate does not tokenize (that would cost more than the proxying itself): prompt length is estimated
at 4 bytes of UTF-8 per token, or counted exactly when the prompt is already token ids. In English that
is 4 characters per token, OpenAI's rule of thumb; a Chinese, Japanese or Korean character (3 bytes)
counts 0.75 of a token, where recent BPE vocabularies take about 1 to 1.5 such characters a token
(4 characters per token, as the gate counted until 2026-12-06, made a Chinese prompt a third of its
length: a 6,000-token prompt under a 4,096-token long-pool threshold). The estimate only picks a length
bucket and the long pool, and reserves a token budget; the usage the engine reports, which the gate
asks streams for, replaces it in the request's record.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, TypeGuard

BYTES_PER_TOKEN = 4.0
"""UTF-8 bytes of prompt text per estimated token."""
RESPONSES_PATH = "/v1/responses"
"""OpenAI's Responses API (vLLM and SGLang serve it): generation like chat, with its own body and events."""
SGLANG_GENERATE_PATH = "/generate"
"""SGLang's native generation API."""
LLAMACPP_COMPLETION_PATHS = frozenset({"/completion", "/completions"})
"""llama.cpp's native completion API (``/completions`` is its alias)."""
LLAMACPP_INFILL_PATH = "/infill"
"""llama.cpp's code infill: a completion whose prompt is the code around the cursor."""
CHAT_PATHS = frozenset({"/v1/chat/completions", "/chat/completions"})
"""OpenAI's chat, and llama.cpp's alias of it without the ``/v1``."""
MESSAGES_PATH = "/v1/messages"
"""Anthropic's Messages API (vLLM serves it, for clients written against Anthropic's SDK): ``messages``,
``system`` and a required ``max_tokens``; ``usage`` counts ``input_tokens`` and ``output_tokens``."""
MESSAGES_TOKEN_EVENT = b'"content_block_delta"'
"""In a Messages stream, what marks an event that carries generated tokens (``message_start``,
``content_block_start``, ``message_delta`` and the rest carry none; the last ``message_delta`` has the
usage). Generated text cannot forge it: inside a JSON string its quotes are escaped."""
CHAT_BATCH_PATH = "/v1/chat/completions/batch"
"""vLLM's batch chat: ``messages`` is a list of conversations, each answered (``n`` times) in one reply."""
STRUCTURED_DECISION_PATH = "/v1/systemone"
"""vLLM's structured decisions (since 0.32): a ``state`` (text or JSON), ``questions`` (id to
``{type, instructions, criteria}``) and ``instructions``, answered in one JSON reply by a model that
supports it (501 otherwise), under the engine's ``priority``: model work with no stream and no
generation bound, judged as one output against the TTFT SLO."""
SAGEMAKER_PATH = "/invocations"
"""SageMaker's route, which vLLM serves: a completion, chat, embedding... body, told apart by its fields."""
POOLING_PATHS = frozenset(
    {
        "/pooling", "/classify", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank",  # vLLM
        "/generative_scoring",  # vLLM: the probabilities of label tokens after a query and each item
        STRUCTURED_DECISION_PATH,  # vLLM: one JSON answer to questions about a state (_decision)
        "/encode", "/v1/classify",  # SGLang (which serves /classify, /v1/rerank and /v1/score too)
        "/embedding", "/embeddings", "/reranking", "/v1/reranking",  # llama.cpp
    }
)  # fmt: skip
"""Routes that run the model over their input without generating: pooling, classification, scoring and
reranking (cross-encoders read every query-document pair), embeddings by the engines' native names."""
EMBEDDINGS_PATH = "/v1/embeddings"
NON_GENERATING_PATHS = POOLING_PATHS | {EMBEDDINGS_PATH}
"""Routes whose answer is one output, not tokens: its latency is judged against the TTFT SLO."""
AUDIO_PATHS = frozenset({"/v1/audio/transcriptions", "/v1/audio/translations"})
"""OpenAI's speech-to-text API (vLLM serves it for Whisper-like models): a multipart upload, read by no
one but the engine; the gate admits it without a token estimate."""
AUDIO_STREAM_FIELD = b'name="stream"\r\n\r\ntrue'
"""A multipart form's ``stream`` field set to true, as clients (OpenAI's, aiohttp, ``curl -F``) write it."""
#: Paths whose requests are admitted through the queue; anything else is passed straight through.
ADMITTED_PATHS = frozenset(
    {"/v1/completions", *CHAT_PATHS, EMBEDDINGS_PATH, RESPONSES_PATH, SGLANG_GENERATE_PATH}
    | LLAMACPP_COMPLETION_PATHS
    | {LLAMACPP_INFILL_PATH, MESSAGES_PATH, CHAT_BATCH_PATH, SAGEMAKER_PATH}
    | POOLING_PATHS
    | AUDIO_PATHS
)
PROMPT_FIELDS = (
    "prompt", "messages", "input", "instructions", "text", "input_ids", "content", "query", "documents",
    "text_1", "text_2", "queries", "items", "data_1", "data_2", "input_prefix", "input_suffix", "input_extra",
)  # fmt: skip
"""Where the routes read by field name (:func:`_by_field`) carry their input: OpenAI's (``prompt``,
``messages``, ``input``), SGLang's (``text``, ``input_ids``), llama.cpp's (``content``, the infill
parts), and the scoring APIs' (``query`` and ``documents`` for rerank; ``text_1``/``text_2``, or
``queries``/``items`` and ``data_1``/``data_2`` in later vLLM releases, for score)."""
RESPONSES_TOKEN_EVENT = b'.delta"'
"""In a Responses stream, what marks an event that carries generated tokens: its ``type`` ends in
``.delta`` (``response.output_text.delta``, ``response.reasoning_text.delta``, a tool call's arguments);
``response.created`` and the other lifecycle events carry none. Inside a JSON string a quote is escaped,
so generated text cannot forge it."""
TOKEN_EVENTS = {RESPONSES_PATH: RESPONSES_TOKEN_EVENT, MESSAGES_PATH: MESSAGES_TOKEN_EVENT}
"""The APIs whose streams have events that carry no tokens, and what marks those that do."""


@dataclass(frozen=True, slots=True)
class RequestInfo:
    stream: bool = False
    prompt_tokens: float = 0.0
    max_tokens: float = 0.0
    model: str = ""
    choices: int = 1
    """Answers generated per request (``n``, or ``best_of`` when larger): each may run to ``max_tokens``."""
    token_event: bytes = b""
    """In a stream, the bytes that mark an event carrying tokens; empty when every event carries some
    (completions, chat). The first such event is the first token (TTFT), the gaps between them the ITL,
    and without a ``usage`` their count is the output token count."""
    prompts: int = 1
    """Prompts in it (a list of prompts, vLLM's batch chat, SGLang's batch): ``prompt_tokens`` is their
    sum, so a prompt's own length, which picks its length bucket and its pool, is the share of one."""

    @property
    def prompt_length(self) -> float:
        """The estimated tokens of one of its prompts (all of them for a single prompt)."""
        return self.prompt_tokens / self.prompts


class BadRequest(ValueError):
    """The body is not what the path needs; the gate answers 400 without bothering the engine."""


def _text_tokens(value: Any) -> float:
    if isinstance(value, str):  # isascii() reads a flag: ASCII text costs nothing more than len()
        size = len(value) if value.isascii() else len(value.encode("utf-8", "surrogatepass"))
        return size / BYTES_PER_TOKEN
    if isinstance(value, list):
        if value and all(isinstance(v, int) for v in value):
            return float(len(value))  # already token ids
        return sum(_text_tokens(v) for v in value)
    if isinstance(value, dict):  # a content part {"type": "text", "text": ...}, or a Responses input item
        for key in ("text", "content", "output"):  # (a message's content, a tool call's output)
            if key in value:
                return _text_tokens(value[key])
    return 0.0


MAX_TOKENS_LIMIT = 2**31 - 1


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_request(path: str, body: bytes) -> RequestInfo:
    """Stream flag, estimated prompt tokens and ``max_tokens`` of a completion/chat/embedding/Responses body.

    Hostile bodies get a :class:`BadRequest` (400), never an unexpected exception: NaN/Infinity literals
    are refused (they would poison a token bucket), and so is nesting deep enough to hit the recursion
    limit while parsing or counting tokens.
    """
    if path not in ADMITTED_PATHS or not body:
        return RequestInfo()
    if path in AUDIO_PATHS:  # a form: only whether it streams (vLLM's ``stream`` field) is read
        return RequestInfo(stream=AUDIO_STREAM_FIELD in body)
    try:
        return _parse(path, body)
    except RecursionError:
        raise BadRequest("request body is nested too deeply") from None


def parse_any(body: bytes) -> RequestInfo:
    """A body of a path the operator admits (``gate.admit_paths``), read by field name (:func:`_by_field`).
    Such a path may carry anything, so a body that is not a JSON object (a form, an upload, a NaN) is
    admitted as it is, with no estimate, rather than refused: the engine behind it is the judge."""
    try:
        return _by_field(_load(body)) if body else RequestInfo()
    except BadRequest:
        return RequestInfo()
    except RecursionError:
        raise BadRequest("request body is nested too deeply") from None


def _by_field(doc: dict[str, Any]) -> RequestInfo:
    """The prompt in any of :data:`PROMPT_FIELDS`, and the generation bound by any of its names (OpenAI's
    ``max_completion_tokens``/``max_tokens``/``max_output_tokens``, llama.cpp's ``n_predict``, SGLang's
    ``sampling_params.max_new_tokens``); a bound that is not a plain count is no bound (0)."""
    prompt = sum(_text_tokens(doc[key]) for key in PROMPT_FIELDS if key in doc)
    params = doc.get("sampling_params")
    bounds = (
        doc.get("max_completion_tokens"),
        doc.get("max_tokens"),
        doc.get("max_output_tokens"),
        doc.get("n_predict"),
        params.get("max_new_tokens") if isinstance(params, dict) else None,
    )
    max_tokens = next((float(b) for b in bounds if _count(b) and b <= MAX_TOKENS_LIMIT), 0.0)
    model = doc.get("model")
    # a list of inputs (embeddings, documents to rerank, items to score): each is a sequence of its own in
    # the engine, and one prompt's length is a share of the whole
    prompts = max((_prompt_count(doc[key]) for key in PROMPT_FIELDS if key in doc), default=1)
    stream = doc.get("stream") is True
    model_name = model if isinstance(model, str) else ""
    return RequestInfo(stream, prompt, max_tokens, model_name, choices=prompts, prompts=prompts)


def _load(body: bytes) -> dict[str, Any]:
    """``body`` as a JSON object, NaN and Infinity refused; :class:`BadRequest` otherwise."""
    try:
        doc = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as error:
        raise BadRequest(f"request body is not valid JSON: {error}") from None
    if not isinstance(doc, dict):
        raise BadRequest("request body must be a JSON object")
    return doc


def _prompt_count(prompt: Any) -> int:
    """Prompts in a completions ``prompt``: a list of strings or of token-id lists is a batch, each
    answered (``n`` times); a string or one list of token ids is one."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return len(prompt)
    return 1


def _decision(doc: dict[str, Any]) -> RequestInfo:
    """A structured decision's prompt: its ``state`` and ``questions`` as the model reads them, text or
    JSON (a JSON state's size in bytes: it is serialised into the prompt), and its ``instructions``. Its
    images, audio and videos are not text: a data URL's base64 would count as thousands of tokens."""
    prompt = _text_tokens(doc.get("instructions") or "")
    for key in ("state", "questions"):
        value = doc.get(key)
        if isinstance(value, str):
            prompt += _text_tokens(value)
        elif value is not None:
            prompt += (
                len(json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")) / BYTES_PER_TOKEN
            )
    model = doc.get("model")
    return RequestInfo(prompt_tokens=prompt, model=model if isinstance(model, str) else "")


def _parse(path: str, body: bytes) -> RequestInfo:
    doc = _load(body)
    if path == STRUCTURED_DECISION_PATH:
        return _decision(doc)
    if path in POOLING_PATHS or path == SAGEMAKER_PATH:
        return _by_field(doc)
    choices = max((v for v in (doc.get("n"), doc.get("best_of")) if _count(v)), default=1)
    prompts = 1
    if path in CHAT_PATHS or path in (CHAT_BATCH_PATH, MESSAGES_PATH):
        messages = doc.get("messages")
        if not isinstance(messages, list):
            raise BadRequest("'messages' must be a list")
        if path == CHAT_BATCH_PATH:  # a list of conversations
            prompts = max(1, len(messages))
            choices *= prompts
            messages = [
                m for conversation in messages if isinstance(conversation, list) for m in conversation
            ]
        prompt = sum(_text_tokens(m.get("content", "")) for m in messages if isinstance(m, dict))
        if path == MESSAGES_PATH:
            prompt += _text_tokens(doc.get("system") or "")
    elif path == "/v1/completions":
        prompt = _text_tokens(doc.get("prompt", ""))
        prompts = _prompt_count(doc.get("prompt"))
        choices *= prompts
    elif path == RESPONSES_PATH:
        prompt = _text_tokens(doc.get("input", "")) + _text_tokens(doc.get("instructions") or "")
    elif path == SGLANG_GENERATE_PATH:
        return _parse_generate(doc)
    elif path in LLAMACPP_COMPLETION_PATHS or path == LLAMACPP_INFILL_PATH:
        return _parse_llamacpp(doc)
    else:  # embeddings: a list of inputs is that many prompts, each embedded as a sequence of its own
        prompt = _text_tokens(doc.get("input", ""))
        prompts = choices = _prompt_count(doc.get("input"))
    if path == RESPONSES_PATH:
        max_tokens = doc.get("max_output_tokens") or 0
    else:
        max_tokens = doc.get("max_completion_tokens", doc.get("max_tokens")) or 0
    _check_max_tokens(max_tokens)
    model = doc.get("model")
    return RequestInfo(
        bool(doc.get("stream", False)),
        prompt,
        float(max_tokens),
        model if isinstance(model, str) else "",
        choices,
        TOKEN_EVENTS.get(path, b""),
        prompts,
    )


def _check_max_tokens(max_tokens: Any, name: str = "max_tokens") -> None:
    if (
        not isinstance(max_tokens, int | float)
        or isinstance(max_tokens, bool)
        or not 0 <= max_tokens <= MAX_TOKENS_LIMIT
    ):
        raise BadRequest(f"'{name}' must be a number in [0, {MAX_TOKENS_LIMIT}]")


def _parse_generate(doc: dict[str, Any]) -> RequestInfo:
    """SGLang's ``/generate``: ``text`` (a prompt or a list of them) or ``input_ids`` (a list of ids, or
    a list of such lists); a batch is as many answers, each ``sampling_params.n`` times.
    ``sampling_params`` is one object for every prompt, or a list of them, one per prompt (SGLang takes
    both); with a list, each prompt is bounded by its own ``max_new_tokens``, and the request by the
    largest."""
    text, ids = doc.get("text"), doc.get("input_ids")
    if text is not None:
        prompts = text if isinstance(text, list) else [text]
    elif isinstance(ids, list) and ids and all(isinstance(i, list) for i in ids):
        prompts = ids
    else:
        prompts = [ids] if ids is not None else []
    count = max(1, len(prompts))
    params = doc.get("sampling_params")
    if params is None or isinstance(params, dict):
        params = [params or {}]  # one object for every prompt
    elif not isinstance(params, list) or not all(isinstance(p, dict) for p in params):
        raise BadRequest("'sampling_params' must be an object, or a list of objects (one per prompt)")
    elif len(params) not in (1, count):
        raise BadRequest(
            f"'sampling_params' must be an object, or a list of objects, one per prompt ({count})"
        )
    each_applies_to = count // len(params)  # prompts each object stands for: all of them, or its own
    max_tokens, choices = 0, 0
    for each in params:
        bound = each.get("max_new_tokens") or 0
        _check_max_tokens(bound, "sampling_params.max_new_tokens")
        max_tokens = max(max_tokens, bound)
        n = each.get("n")
        choices += each_applies_to * (n if _count(n) else 1)
    stream = bool(doc.get("stream", False))
    return RequestInfo(stream, _text_tokens(prompts), float(max_tokens), "", choices, prompts=count)


def _parse_llamacpp(doc: dict[str, Any]) -> RequestInfo:
    """llama.cpp's ``/completion``: ``prompt`` (text, token ids, or a list of prompts: as many answers)
    and ``n_predict`` (-1, its default, runs to the context's end: no bound the gate can use); its
    ``/infill`` adds the code around the cursor (``input_prefix``, ``input_suffix``, and ``input_extra``:
    other files' chunks, ``{"filename", "text"}`` each)."""
    prompt = doc.get("prompt", "")
    many = isinstance(prompt, list) and bool(prompt) and all(isinstance(p, str | list) for p in prompt)
    n_predict = doc.get("n_predict", -1)
    if isinstance(n_predict, int) and not isinstance(n_predict, bool) and n_predict < 0:
        n_predict = 0
    _check_max_tokens(n_predict, "n_predict")
    tokens = _text_tokens(prompt) + sum(
        _text_tokens(doc[key]) for key in ("input_prefix", "input_suffix", "input_extra") if key in doc
    )
    count = len(prompt) if many else 1
    return RequestInfo(bool(doc.get("stream", False)), tokens, float(n_predict), "", count, prompts=count)


def _count(value: Any) -> TypeGuard[int]:
    """A plain positive integer (what ``n``/``best_of`` must be; anything else is the engine's to refuse)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def error_body(message: str, kind: str, code: str) -> dict[str, Any]:
    """OpenAI's error shape, so clients that already handle OpenAI errors handle the gate's."""
    return {"error": {"message": message, "type": kind, "code": code}}


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """Anthropic's Messages API error, ``{"type": "error", "error": {"type", "message"}}``, with the type
    its API gives ``status`` (:data:`ANTHROPIC_ERROR_TYPES`; ``api_error`` for any other)."""
    kind = ANTHROPIC_ERROR_TYPES.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def stream_error_event(path: str, message: str, code: str, status: int) -> bytes:
    """The SSE event that ends a started stream with an error, in the shape its API's clients raise on:
    for Anthropic's Messages (:data:`MESSAGES_PATH`) an event named ``error`` carrying
    ``{"type": "error", "error": {"type", "message"}}`` (Anthropic's SDK raises on that name and passes
    over unnamed events, so an OpenAI-shaped one would let it read a cut answer as whole); for every
    other API an unnamed event with OpenAI's error shape (:func:`error_body`), which the OpenAI SDK
    raises on, as vLLM writes it. ``code``: the gate's reason, e.g. ``bad_gateway``; ``status``: the
    one a refusal before the stream began would have had (504 for a hung upstream, 502 a broken one)."""
    if path == MESSAGES_PATH:
        return b"event: error\ndata: " + json.dumps(anthropic_error(status, message)).encode() + b"\n\n"
    return b"data: " + json.dumps(error_body(message, "upstream_error", code)).encode() + b"\n\n"


EVENT_ENDS = (b"\n\n", b"\r\n\r\n")
"""How an SSE event ends."""

STREAM_ENDS = (b"data: [DONE]", b"event: message_stop", b"event: response.completed")
"""How a whole stream's last event starts: ``[DONE]`` (OpenAI's chat and completions), Anthropic's
``message_stop``, the Responses API's ``response.completed``."""


def stream_finished(tail: bytes) -> bool:
    """Whether a stream's ``tail`` ends with its end event (:data:`STREAM_ENDS`), whole, so that a
    connection that breaks after it lost the client nothing."""
    if not tail.endswith(EVENT_ENDS):  # cut inside an event: its end may be missing
        return False
    last = tail.rstrip(b"\r\n")
    at = max(last.rfind(b"\n\n"), last.rfind(b"\r\n\r\n"))
    return last[at + 1 :].lstrip(b"\r\n").startswith(STREAM_ENDS)


def _usage(usage: Any) -> tuple[float, float] | None:
    """``(prompt, completion)`` tokens from a ``usage`` object: chat/completions (and SGLang's
    ``meta_info``) name them ``prompt_tokens``/``completion_tokens``, the Responses API
    ``input_tokens``/``output_tokens``, llama.cpp's answers ``tokens_evaluated``/``tokens_predicted``.
    In Anthropic's Messages shape the prompt is ``input_tokens`` plus the cache's
    ``cache_read_input_tokens`` and ``cache_creation_input_tokens`` (llama.cpp's ``/v1/messages`` answers
    51 prompt tokens as 1 + 50 read from its cache), as the other APIs count it."""
    if not isinstance(usage, dict):
        return None
    prompt = usage.get("prompt_tokens", usage.get("input_tokens", usage.get("tokens_evaluated")))
    completion = usage.get("completion_tokens", usage.get("output_tokens", usage.get("tokens_predicted", 0)))
    if not isinstance(prompt, int | float) or not isinstance(completion, int | float):
        return None
    if isinstance(prompt, bool) or isinstance(completion, bool):
        return None
    if "prompt_tokens" not in usage:  # Anthropic's shape: input_tokens leaves out what the cache served
        for key in ("cache_read_input_tokens", "cache_creation_input_tokens"):
            extra = usage.get(key)
            if isinstance(extra, int | float) and not isinstance(extra, bool) and extra > 0:
                prompt += extra
    return float(prompt), float(completion)


#: The header naming a request across the client, the gate's access log and the engine (vLLM's request id)
REQUEST_ID = "X-Request-Id"
#: Characters of a client's request id kept (a longer one is cut, not refused)
MAX_REQUEST_ID = 128

USAGE_EVENT = b'"choices":[]'
"""What marks a stream's usage event (``stream_options.include_usage``), after its last token: no
choices, as vLLM and llama.cpp write it (recorded in tests/fixtures/gate), and SGLang too (its
serving_chat writes the event with pydantic's ``model_dump_json``: no spaces)."""

STREAM_ERROR = b'data: {"error"'
"""What starts an error event in a stream: a failure after the answer's 200 went, which can only be
said in the stream. vLLM 0.32 writes ``{"error": {"message", "type", "param", "code"}}`` and then
``[DONE]`` (its ``create_streaming_error_response``; the gate's own for a hung upstream has the same
shape); SGLang, and older vLLM releases, write ``{"error": {"object": "error", ...}}`` with ``json.dumps``'s
spaces, which starts the same way. Generated text cannot forge it: an event's own JSON starts there,
where text is a string."""

NAMED_ERRORS = (b"event: error\n", b"event: response.failed\n")
"""SSE event names that say a stream failed: Anthropic's Messages streams end so (vLLM and SGLang write
``{"type": "error", "error": {"type", "message"}}`` under it, llama.cpp its own ``{"code", "message",
"type"}``), and OpenAI's Responses streams (``error``; ``response.failed`` with the error in its
``response``). The name stands at a line's start and the line ends after it; generated text cannot forge
that, as a JSON string holds no raw newline."""

ERROR_TYPE_STATUS = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "permission_error": 403,
    "not_found_error": 404,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "overloaded_error": 529,
}
"""The HTTP status each of Anthropic's error types is answered with, for an error event with no code."""

ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",  # Anthropic's own overload is 529 (:data:`ERROR_TYPE_STATUS`); the gate's 503
    504: "timeout_error",
}
"""The Anthropic error type of each status the gate answers a Messages client with."""

#: Stream events that carry no token, as the engines write them (without spaces): the end, ``[DONE]``, and
#: in a chat stream a sequence's opening event, its role alone (vLLM: content ""; llama.cpp: null; both
#: recorded in tests/fixtures/gate; an engine that writes it otherwise is counted as before),
#: and llama.cpp's closing one, an empty delta beside its finish reason; the usage event
#: (:data:`USAGE_EVENT`), and an error event (:data:`STREAM_ERROR`). Not counted as tokens, nor timed
#: as arrivals: timed, each added a gap (about 0 where it comes with a token) to the answer's ITL, and the
#: chat ones a token to every chat answer without usage.
NO_TOKEN = (
    b"data: [DONE]",
    b'"delta":{"role":"assistant","content":""}',
    b'"delta":{"role":"assistant","content":null}',
    b'"delta":{}',
    USAGE_EVENT,
    STREAM_ERROR,
)


def usage_from_json(body: bytes) -> tuple[float, float] | None:
    """``(prompt_tokens, completion_tokens)`` from a non-streamed response's ``usage``, if any."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if isinstance(doc, dict):
        if "usage" in doc or "meta_info" in doc:
            return _usage(doc["usage"] if "usage" in doc else doc["meta_info"])
        return _usage(doc) if "tokens_predicted" in doc else None  # llama.cpp: the counts in the answer
    if isinstance(doc, list) and doc:  # SGLang's answer to a batch: one object per prompt
        each = [_usage(item.get("meta_info")) if isinstance(item, dict) else None for item in doc]
        if any(u is None for u in each):
            return None
        return sum(u[0] for u in each if u), sum(u[1] for u in each if u)
    return None


def usage_from_sse_tail(tail: bytes) -> tuple[float, float] | None:
    """The last ``usage`` object in a stream's tail, if any: a chat or completion stream's last chunk
    (``stream_options.include_usage``), or the Responses API's ``response.completed`` event, whose
    ``response`` repeats the whole answer before its ``usage`` (so the event can be longer than the tail
    the gate keeps: the object is decoded where it starts, not from the start of its event), or an SGLang
    ``/generate`` stream's last ``meta_info`` (its counts are cumulative; in a batched stream it is the
    last answer's alone)."""
    at, key = max((tail.rfind(key), key) for key in (b'"usage"', b'"meta_info"'))
    if at < 0:
        return _llamacpp_usage(tail)
    rest = tail[at + len(key) :].lstrip()
    return _usage(_json_at(rest[1:])) if rest.startswith(b":") else None


def stream_error(tail: bytes) -> int | None:
    """The status of the last error event a stream's tail holds, None when it holds none: an event
    whose data starts ``{"error"`` (:data:`STREAM_ERROR`), or one named ``error`` or ``response.failed``
    (:data:`NAMED_ERRORS`). The status is the error's own ``code`` where that is an HTTP error status,
    else the one its Anthropic ``type`` stands for (:data:`ERROR_TYPE_STATUS`), else 500."""
    at = tail.rfind(STREAM_ERROR)
    named = max(_named_event_at(tail, name) for name in NAMED_ERRORS)
    if at < 0 and named < 0:
        return None
    if named > at:
        at = tail.find(b"data:", named)
        doc = _json_at(tail[at + len(b"data:") :]) if at >= 0 else None
    else:
        doc = _json_at(tail[at + len(b"data:") :])
    return _error_status(doc)


def _named_event_at(tail: bytes, name: bytes) -> int:
    """Where the last event named by ``name`` (``event: ...\\n``) starts in ``tail``, or -1."""
    at = tail.rfind(name)
    while at > 0 and tail[at - 1] != 0x0A:  # not at a line's start: something else ends so
        at = tail.rfind(name, 0, at)
    return at


def _error_status(doc: Any) -> int:
    """The HTTP status an error event's data ``doc`` says (see :func:`stream_error`)."""
    if not isinstance(doc, dict):
        return 500  # cut short by the tail's start or end: an error all the same
    error = doc.get("error")
    response = doc.get("response")
    if error is None and isinstance(response, dict):  # Responses' response.failed
        error = response.get("error")
    for holder in (error, doc):
        code = holder.get("code") if isinstance(holder, dict) else None
        if isinstance(code, int) and not isinstance(code, bool) and 400 <= code <= 599:
            return code
    kind = error.get("type") if isinstance(error, dict) else None
    return ERROR_TYPE_STATUS.get(kind, 500) if isinstance(kind, str) else 500


def _llamacpp_usage(tail: bytes) -> tuple[float, float] | None:
    """A llama.cpp stream's counts, if its last event is in the tail: a ``/completion`` stream's own
    ``tokens_evaluated`` and ``tokens_predicted`` (cumulative), or an OpenAI-shaped stream's ``timings``,
    which llama.cpp adds to its last event whether usage was asked for or not: ``predicted_n`` tokens
    generated, ``prompt_n`` prompt tokens computed and ``cache_n`` taken from its cache."""
    at = tail.rfind(b'"tokens_predicted"')
    start = tail.rfind(b"data:", 0, at) if at >= 0 else -1
    if start >= 0:
        return _usage(_json_at(tail[start + 5 :]))
    at = tail.rfind(b'"timings"')
    rest = tail[at + len(b'"timings"') :].lstrip() if at >= 0 else b""
    timings = _json_at(rest[1:]) if rest.startswith(b":") else None
    if not isinstance(timings, dict):
        return None
    counts = [timings.get(key, 0) for key in ("prompt_n", "cache_n", "predicted_n")]
    if "predicted_n" not in timings or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts
    ):
        return None
    return float(counts[0] + counts[1]), float(counts[2])


_DECODER = json.JSONDecoder()


def _json_at(data: bytes) -> Any:
    """The JSON value ``data`` starts with (after whitespace), ignoring what follows it; None when it is
    cut short or not JSON."""
    try:
        value, _ = _DECODER.raw_decode(data.decode("utf-8", "replace").lstrip())
    except ValueError:
        return None
    return value
