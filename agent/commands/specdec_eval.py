"""``servepilot specdec-eval``: is a draft model worth deploying for speculative decoding?

Sends each prompt of ``--prompts`` to the target (greedy, top-k logprobs), has the draft score the
target's text (``echo``), and prints the distribution similarity, KL divergence and top-k overlap with a
verdict (:mod:`agent.specdec` holds the method and the math). Both upstreams are OpenAI-compatible
completions servers (vLLM, SGLang) that share a tokenizer.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "specdec-eval",
        help="compare a draft and a target model through their logprobs",
        description="Compare a draft and a target upstream on a prompt set (KL divergence, top-k overlap, "
        "distribution similarity) and say whether the draft is worth deploying for speculative decoding.",
    )
    parser.add_argument("--target", required=True, help="target upstream base URL")
    parser.add_argument("--draft", required=True, help="draft upstream base URL")
    parser.add_argument("--target-model", help="target model name (default: the upstream's first model)")
    parser.add_argument("--draft-model", help="draft model name (default: the upstream's first model)")
    parser.add_argument("--prompts", required=True, help="prompt file: one per line, or JSONL with 'prompt'")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens the target generates per prompt")
    parser.add_argument(
        "--top-k", type=int, default=5, help="logprobs per position (engines cap it, often 20)"
    )
    parser.add_argument("--draft-tokens", type=int, default=4, help="K, tokens drafted per step")
    parser.add_argument("--threshold", type=float, default=0.85, help="similarity needed to deploy")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="per-request timeout")
    parser.add_argument("--json", action="store_true", help="print the verdict as JSON")
    parser.set_defaults(func=run)


def read_prompts(path: str) -> list[str]:
    """Prompts from a text file (one per non-blank line) or JSONL (``{"prompt": ...}`` per line)."""
    from agent.cli import UsageError

    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"cannot read --prompts {path}: {error}") from None
    prompts: list[str] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if path.endswith(".jsonl"):
            try:
                doc = json.loads(line)
            except ValueError as error:
                raise UsageError(f"{path}:{number}: not JSON ({error})") from None
            if not isinstance(doc, dict) or not isinstance(doc.get("prompt"), str):
                raise UsageError(f"{path}:{number}: needs a string 'prompt'")
            prompts.append(doc["prompt"])
        else:
            prompts.append(line)
    if not prompts:
        raise UsageError(f"--prompts {path} holds no prompt")
    return prompts


def run(args: argparse.Namespace) -> int:
    import asyncio

    import aiohttp

    from agent.cli import UsageError

    for name in ("target", "draft"):
        if not getattr(args, name).startswith(("http://", "https://")):
            raise UsageError(f"--{name} must be an http(s) URL, got {getattr(args, name)!r}")
    if (
        not 1 <= args.top_k <= 20
        or args.max_tokens < 1
        or args.draft_tokens < 1
        or not 0 < args.threshold < 1
    ):
        raise UsageError(
            "--top-k must be in [1, 20], --max-tokens and --draft-tokens >= 1, --threshold in (0, 1)"
        )
    prompts = read_prompts(args.prompts)
    try:
        result = asyncio.run(_evaluate(args, prompts))
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as error:
        print(f"servepilot specdec-eval: {type(error).__name__}: {error}")
        return 1
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(
            f"prompts {result.prompts}, positions {result.positions} (skipped {result.skipped_positions})\n"
            f"similarity {result.similarity:.3f}  KL {result.kl_mean:.3f} nats  "
            f"top-{args.top_k} overlap {result.topk_overlap:.2f}\n"
            f"{'DEPLOY' if result.deploy else 'DO NOT DEPLOY'}: {result.reason}"
        )
    return 0


async def _evaluate(args: argparse.Namespace, prompts: list[str]) -> Any:
    import aiohttp

    from agent.specdec import pair_positions, target_positions, verdict

    timeout = aiohttp.ClientTimeout(total=args.timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        target_model = args.target_model or await _first_model(session, args.target)
        draft_model = args.draft_model or await _first_model(session, args.draft)
        pairs, skipped = [], 0
        for prompt in prompts:
            common = {"temperature": 0, "logprobs": args.top_k}
            target = await _complete(
                session,
                args.target,
                {**common, "model": target_model, "prompt": prompt, "max_tokens": args.max_tokens},
            )
            text = target.get("text", "")
            draft = await _complete(
                session, args.draft,
                {**common, "model": draft_model, "prompt": prompt + text, "max_tokens": 1, "echo": True},
            )  # fmt: skip
            got, missed = pair_positions(target_positions(target), target_positions(draft))
            pairs.extend(got)
            skipped += missed
    return verdict(pairs, len(prompts), skipped, args.threshold, args.draft_tokens)


async def _first_model(session: Any, base: str) -> str:
    async with session.get(base.rstrip("/") + "/v1/models") as resp:
        resp.raise_for_status()
        data = (await resp.json()).get("data") or []
    if not data or not isinstance(data[0], dict) or "id" not in data[0]:
        raise ValueError(f"{base}/v1/models lists no model")
    return str(data[0]["id"])


async def _complete(session: Any, base: str, body: dict[str, Any]) -> dict[str, Any]:
    async with session.post(base.rstrip("/") + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise ValueError(f"{base} answered HTTP {resp.status}: {(await resp.text())[:200]}")
        doc = await resp.json()
    choices = doc.get("choices") if isinstance(doc, dict) else None
    if not choices or not isinstance(choices[0], dict):
        raise ValueError(f"{base} returned no choices")
    return dict(choices[0])
