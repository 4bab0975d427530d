"""``servepilot specdec-eval`` against two small OpenAI-style upstreams on loopback."""

from __future__ import annotations

import argparse
import math
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from agent.cli import UsageError
from agent.commands.specdec_eval import _evaluate, read_prompts, register

TOKENS = ["a", "b", "c"]


def _tops(probs: list[tuple[float, float]]) -> list[dict[str, float]]:
    """Top-2 maps: the position's own token with probability p, and 'z' with q."""
    return [{tok: math.log(p), "z": math.log(q)} for tok, (p, q) in zip(TOKENS, probs, strict=True)]


class Engine:
    def __init__(self, probs: list[tuple[float, float]], model: str) -> None:
        self.probs, self.model = probs, model
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("echo"):  # the draft scoring prompt + target text, then one token
            tokens = ["<p>", *TOKENS, "d"]
            tops = [{}, *_tops(self.probs), {"d": -0.1}]
        else:
            tokens, tops = TOKENS, _tops(self.probs)
        logprobs = {"tokens": tokens, "top_logprobs": tops}
        return web.json_response({"choices": [{"text": "abc", "logprobs": logprobs}]})

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": self.model}]})

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"


@pytest.fixture
async def target() -> AsyncIterator[Engine]:
    engine = Engine([(0.9, 0.1)] * 3, "big")
    await engine.start()
    yield engine
    assert engine.runner is not None
    await engine.runner.cleanup()


def _args(tmp_path: Path, target: str, draft: str) -> argparse.Namespace:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\ntwo\n")
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())  # agent/cli.py lists the module once it is wired in
    return parser.parse_args(
        ["specdec-eval", "--target", target, "--draft", draft, "--prompts", str(prompts)]
    )


async def test_close_draft_is_worth_deploying(target: Engine, tmp_path: Path) -> None:
    draft = Engine([(0.88, 0.12)] * 3, "small")
    await draft.start()
    try:
        args = _args(tmp_path, target.url, draft.url)
        result = await _evaluate(args, read_prompts(args.prompts))
    finally:
        assert draft.runner is not None
        await draft.runner.cleanup()
    assert result.deploy and result.positions == 6 and result.similarity > 0.95


async def test_divergent_draft_is_refused(target: Engine, tmp_path: Path) -> None:
    draft = Engine([(0.3, 0.7)] * 3, "small")
    await draft.start()
    try:
        args = _args(tmp_path, target.url, draft.url)
        result = await _evaluate(args, read_prompts(args.prompts))
    finally:
        assert draft.runner is not None
        await draft.runner.cleanup()
    assert not result.deploy and result.similarity < 0.85 and result.kl_mean > 0.1


def test_jsonl_prompts_need_a_prompt_field(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"text": "x"}\n')
    with pytest.raises(UsageError, match="needs a string 'prompt'"):
        read_prompts(str(path))


def test_non_http_target_is_a_usage_error(tmp_path: Path) -> None:
    args = _args(tmp_path, "ftp://x", "http://127.0.0.1:1")
    with pytest.raises(UsageError, match="--target must be an http"):
        args.func(args)
