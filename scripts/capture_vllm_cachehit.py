"""Capture the prefix-cache fixtures: real vLLM ``/metrics`` before and after prompts that hit its cache.

Starts the cached vLLM CPU engine (``bash scripts/engines.sh vllm``; prefix caching is on by default),
sends one completion whose prompt is a chat-like history of about 480 tokens, saves ``/metrics``, sends
three more with the same history and a new last question, and saves it again::

    .venv/bin/python scripts/capture_vllm_cachehit.py tests/fixtures/expo/vllm-0.32-cpu

Between the two files vLLM's ``prompt_tokens_total`` grows by every prompt token and
``prompt_tokens_cached_total`` by those its prefix cache served (whole 16-token blocks of the shared
history), which ``tests/agent/collectors/test_engine_metrics.py`` reads. Prints the prompt counters.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from pathlib import Path

from agent.engines.launcher import SERVED_MODEL, LaunchOptions, start

TURN = "turn {i}: the user asked about item {i} and the assistant answered it."
HISTORY = " ".join(TURN.format(i=i) for i in range(12))
QUESTIONS = ("first question?", "second question?", "third question?", "fourth question?")
COUNTERS = ("vllm:prompt_tokens_total", "vllm:prompt_tokens_cached_total", "vllm:prefix_cache_hits_total")


def _complete(url: str, prompt: str) -> None:
    body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        response.read()


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        return str(response.read().decode())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="where the .prom files go")
    args = parser.parse_args(argv)
    with start("vllm", opts=LaunchOptions()) as engine:
        engine.wait_ready(900)
        _complete(engine.url, f"{HISTORY} {QUESTIONS[0]}")
        before = _scrape(engine.url)
        for question in QUESTIONS[1:]:
            _complete(engine.url, f"{HISTORY} {question}")
        after = _scrape(engine.url)
    for name, text in (("before", before), ("after", after)):
        (args.folder / f"vllm-0.32.0-cpu-cachehit-metrics_{name}.prom").write_text(text, encoding="utf-8")
        print(name, [line for line in text.splitlines() if line.startswith(COUNTERS)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
