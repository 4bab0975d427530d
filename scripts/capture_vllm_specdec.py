"""Capture the spec-decode fixtures: real vLLM ``/metrics`` with n-gram speculative decoding.

Starts the cached vLLM CPU engine (``bash scripts/engines.sh vllm``) with 3 draft tokens by n-gram prompt
lookup (``LaunchOptions.speculative_ngram``), sends 16 greedy completions, saves ``/metrics``, then 16
sampled ones (temperature 1.0) and saves it again::

    .venv/bin/python scripts/capture_vllm_specdec.py tests/fixtures/expo/vllm-0.32-cpu

The tiny random-weight model repeats itself when greedy, so n-gram drafts are mostly accepted; sampled,
its output has no n-grams to look up and acceptance falls to a few percent. The difference of the two
files is a real acceptance drop, which ``tests/agent/collectors/test_engine_metrics.py`` and the
spec-decode detector's tests read. Prints each phase's acceptance and per-position acceptance.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from agent.engines.launcher import SERVED_MODEL, LaunchOptions, start

DRAFT_TOKENS = 3
PHASES = (("greedy", 0.0), ("sampled", 1.0))


def _complete(url: str, prompt: str, temperature: float) -> None:
    body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 96, "temperature": temperature, "seed": 7}
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        response.read()


def _spec_counters(text: str) -> dict[str, float]:
    counters = {}
    for line in text.splitlines():
        if line.startswith("vllm:spec_decode_num_") and "_total" in line:
            key, value = line.rsplit(" ", 1)
            counters[key] = float(value)
    return counters


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="where the .prom files go")
    args = parser.parse_args(argv)
    rng = random.Random(11)
    with start("vllm", opts=LaunchOptions(speculative_ngram=DRAFT_TOKENS)) as engine:
        engine.wait_ready(900)
        before: dict[str, float] = {}
        for phase, temperature in PHASES:
            prompts = [" ".join(rng.choice("abcdefgh") for _ in range(24)) for _ in range(16)]
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(lambda p, t=temperature: _complete(engine.url, p, t), prompts))
            with urllib.request.urlopen(engine.url + "/metrics", timeout=10) as response:
                text = response.read().decode()
            path = args.folder / f"vllm-0.32.0-cpu-ngram{DRAFT_TOKENS}-metrics_{phase}.prom"
            path.write_text(text, encoding="utf-8")
            now = _spec_counters(text)
            delta = {k.split("{")[0] + k[k.find("position") :] * ("position" in k): v - before.get(k, 0.0)
                     for k, v in now.items()}  # fmt: skip
            drafts = delta["vllm:spec_decode_num_drafts_total"]
            accepted = delta["vllm:spec_decode_num_accepted_tokens_total"]
            drafted = delta["vllm:spec_decode_num_draft_tokens_total"]
            positions = [round(v / drafts, 3) for k, v in sorted(delta.items()) if "position" in k]
            print(
                f"{path}: {drafts:.0f} drafts, acceptance {accepted / drafted:.3f}, by position {positions}"
            )
            before = now
    return 0


if __name__ == "__main__":
    sys.exit(main())
