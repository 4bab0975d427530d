"""Perplexity of a validation set through an upstream's OpenAI-compatible ``/v1/completions``.

The precision canary's quality gate (policies/canary.py) compares the perplexity of the primary
deployment with that of the fp8 candidate. Each text is sent once with ``echo: true, max_tokens: 1,
logprobs: 1, temperature: 0``; the answer's ``choices[0].logprobs.token_logprobs`` holds one value per
prompt token (the first is null: nothing precedes it) followed by the generated token, which
``usage.prompt_tokens`` slices off. Over all scored tokens of all texts (token-weighted, not a mean of
per-text perplexities)::

    PPL = exp(-(1/N) * sum_i log p(t_i | t_<i))

Fetching (:func:`measure`) is separate from the pure parts (:func:`load_validation_set`,
:func:`prompt_logprobs`, :func:`perplexity`), which tests call on plain data. Every bad answer raises one
:class:`PerplexityError` whose message names the upstream and what was wrong.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

COMPLETIONS_PATH = "/v1/completions"
MODELS_PATH = "/v1/models"


class PerplexityError(Exception):
    """A measurement that could not be made, as one line naming the upstream and the reason."""

    def __init__(self, upstream: str, message: str) -> None:
        super().__init__(f"perplexity on upstream {upstream!r}: {message}".replace("\n", " "))
        self.upstream = upstream


@dataclass(frozen=True)
class Measurement:
    """The perplexity of one upstream over a validation set, and how many tokens it was scored on."""

    upstream: str
    ppl: float
    tokens: int
    texts: int
    model: str


def load_validation_set(path: str | Path) -> tuple[str, ...]:
    """The texts in ``path``: one per line, or JSONL objects with a ``"text"`` field; blank lines skipped.

    ValueError (one line naming the file) when it is unreadable, empty, or a JSON line has no text."""
    path = Path(path)
    try:
        raw = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"validation set {str(path)!r} is not UTF-8 text (byte {error.start})") from None
    except OSError as error:
        raise ValueError(f"cannot read validation set {str(path)!r}: {error.strerror or error}") from None
    texts: list[str] = []
    for number, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                doc = json.loads(line)
            except ValueError:
                raise ValueError(f"validation set {str(path)!r} line {number} is not valid JSON") from None
            text = doc.get("text") if isinstance(doc, dict) else None
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f'validation set {str(path)!r} line {number} has no non-empty "text"')
            texts.append(text)
        else:
            texts.append(line)
    if not texts:
        raise ValueError(f"validation set {str(path)!r} holds no texts")
    return tuple(texts)


def prompt_logprobs(answer: Any, upstream: str = "upstream") -> list[float]:
    """The log-probabilities of the prompt tokens after the first, from one completions answer."""
    try:
        choice = answer["choices"][0]
        logprobs = choice["logprobs"]
        values = logprobs["token_logprobs"]
    except (KeyError, IndexError, TypeError):
        raise PerplexityError(
            upstream, "the answer has no choices[0].logprobs.token_logprobs (echo + logprobs unsupported?)"
        ) from None
    usage = answer.get("usage") if isinstance(answer, Mapping) else None
    prompt_tokens = usage.get("prompt_tokens") if isinstance(usage, Mapping) else None
    if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int) or prompt_tokens < 1:
        raise PerplexityError(upstream, f"the answer has no valid usage.prompt_tokens, got {prompt_tokens!r}")
    if not isinstance(values, list) or len(values) < prompt_tokens:
        count = len(values) if isinstance(values, list) else type(values).__name__
        raise PerplexityError(
            upstream, f"token_logprobs has {count} entries for {prompt_tokens} prompt tokens (no echo?)"
        )
    scored: list[float] = []
    for position, value in enumerate(values[1:prompt_tokens], start=1):
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise PerplexityError(upstream, f"prompt token {position} has log-probability {value!r}")
        if value > 1e-6:
            raise PerplexityError(upstream, f"prompt token {position} has a positive log-probability {value}")
        scored.append(float(value))
    return scored


def perplexity(logprobs: Sequence[float]) -> float:
    """``exp(-mean(logprobs))``; ValueError on an empty sequence."""
    if not logprobs:
        raise ValueError("no tokens to score")
    return math.exp(-math.fsum(logprobs) / len(logprobs))


def _excerpt(text: str, limit: int = 200) -> str:
    try:
        doc = json.loads(text)
        message = doc["error"]["message"] if isinstance(doc.get("error"), dict) else doc.get("error", text)
        text = str(message)
    except (ValueError, AttributeError, KeyError, TypeError):
        pass
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


async def _post_json(
    session: aiohttp.ClientSession, upstream: str, url: str, body: Mapping[str, Any] | None, timeout_s: float
) -> Any:
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        if body is None:
            request = session.get(url, timeout=timeout)
        else:
            request = session.post(url, json=body, timeout=timeout)
        async with request as response:
            text = await response.text()
            if response.status != 200:
                raise PerplexityError(upstream, f"HTTP {response.status} from {url}: {_excerpt(text)}")
    except TimeoutError:
        raise PerplexityError(upstream, f"no answer from {url} within {timeout_s:g} s") from None
    except aiohttp.ClientError as error:
        raise PerplexityError(upstream, f"request to {url} failed: {type(error).__name__}: {error}") from None
    try:
        # NaN/Infinity literals are not JSON: refuse them here instead of scoring them
        return json.loads(text, parse_constant=lambda name: _reject_constant(upstream, name))
    except ValueError:
        raise PerplexityError(upstream, f"the answer from {url} is not JSON: {_excerpt(text, 80)}") from None


def _reject_constant(upstream: str, name: str) -> Any:
    raise PerplexityError(upstream, f"the answer holds a non-finite number ({name})")


async def served_model(
    session: aiohttp.ClientSession, upstream: str, base_url: str, timeout_s: float = 10.0
) -> str:
    """The first model ``GET /v1/models`` lists."""
    doc = await _post_json(session, upstream, base_url.rstrip("/") + MODELS_PATH, None, timeout_s)
    try:
        model = doc["data"][0]["id"]
    except (KeyError, IndexError, TypeError):
        model = None
    if not isinstance(model, str) or not model:
        raise PerplexityError(upstream, f"{MODELS_PATH} lists no model")
    return model


async def measure(
    session: aiohttp.ClientSession,
    upstream: str,
    base_url: str,
    texts: Sequence[str],
    *,
    model: str | None = None,
    timeout_s: float = 30.0,
    concurrency: int = 4,
) -> Measurement:
    """The perplexity of ``texts`` on the upstream at ``base_url``. Each request is bounded by
    ``timeout_s``; at most ``concurrency`` are in flight. Raises :class:`PerplexityError`."""
    if not texts:
        raise PerplexityError(upstream, "the validation set is empty")
    if model is None:
        model = await served_model(session, upstream, base_url, timeout_s)
    url = base_url.rstrip("/") + COMPLETIONS_PATH
    limit = asyncio.Semaphore(max(1, concurrency))

    async def one(text: str) -> list[float]:
        body = {
            "model": model,
            "prompt": text,
            "echo": True,
            "max_tokens": 1,
            "logprobs": 1,
            "temperature": 0,
        }
        async with limit:
            answer = await _post_json(session, upstream, url, body, timeout_s)
        return prompt_logprobs(answer, upstream)

    tasks = [asyncio.ensure_future(one(text)) for text in texts]
    try:
        results = await asyncio.gather(*tasks)
    finally:
        for task in tasks:  # the first failure ends the measurement: stop the rest
            if task.done():
                if not task.cancelled():
                    task.exception()  # retrieved: a second failure is not logged as unhandled
            else:
                task.cancel()
    scored = [value for values in results for value in values]
    if not scored:
        raise PerplexityError(upstream, "no text in the validation set is longer than one token")
    return Measurement(upstream, perplexity(scored), len(scored), len(texts), model)
