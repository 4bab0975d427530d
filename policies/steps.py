"""What a step is made of: the decode share of its tokens, and when a smaller batch cannot shorten it.

An engine step carries one new token for each running sequence and, with chunked prefill, prompt tokens up
to its token budget. Over a window the prompt and generated token rates (``engine.prompt_tokens_per_second``,
``generation_tokens_per_second``) are in the same proportion as those two parts of a step, so::

    decode_share = gen_tps / (gen_tps + prompt_tps)

is the share of a step's tokens that the batch size decides (independent of the batch). Steps that carry a
prompt chunk are compute-bound, and their time follows their tokens; so when ``decode_share`` is small the
inter-token latency is the prompt chunks' and a smaller batch cannot bring it down. It only queues requests,
whose prompts then arrive later at the same rate: the steps stay as long.

Measured on the Azure 2024 coding week with the 2023 code trace's lengths (prompts ~2,000 tokens, outputs
~28: about 1% decode) at 8 requests/s on the simulated A100 with the engine's 2,048-token budget: every
``max_num_seqs`` from 32 to 256 met the 0.1 s ITL target for 40-44% of requests (16: 91%, with first tokens
waiting minutes). The batch controller, chasing the ITL, cut its limit from 256 to 8-20, and the queue grew
to 895 requests; the breaker then escalated to the fp8 upstream, whose weight-only kernels prefill slower on
an A100, and the queue grew to 7,000. Only a smaller token budget shortens those steps (the token budget
controller, where the engine lets it be set at run time). Below :data:`DECODE_SHARE_MIN` neither the batch
controller nor the breaker acts on the inter-token latency.

The rates are smoothed over ``tau_s`` (30 s): a tick's prompt tokens come in bursts of whole chunks.

Only the prompt tokens a step computes count. vLLM's ``prompt_tokens_total`` counts every prompt token,
the prefix cache's hits included (its ``PromptTokenStats.total``; prefix caching is on by default), and a
hit costs a step nothing: a chat service whose long histories mostly hit the cache would read as
prefill-bound by the total while its steps are mostly decodes, and the batch controller would not cut
for ITL where a cut helps. So vLLM's cached tokens are taken off
(``engine.prompt_tokens_computed_per_second``, from ``vllm:prompt_tokens_cached_total``), and SGLang's
(``sglang:cached_tokens_total``, counted with its ``prompt_tokens_total`` as each request finishes);
llama.cpp's prompt counter leaves its cache hits out already.
"""

from __future__ import annotations

from dataclasses import dataclass

from detectors.snapshot import Snapshot
from policies import knobs
from policies.windows import smoothed

#: Below this decode share of a step's tokens, a smaller batch cannot shorten the step (module docstring).
DECODE_SHARE_MIN = 0.05
TAU_S = 30.0


def computed_prompt_tps(snapshot: Snapshot) -> float:
    """The prompt tokens/s the engine's steps computed: without the prefix cache's hits where the engine
    says them apart (vLLM), else all of them (see the module docstring)."""
    computed = snapshot.get(knobs.PROMPT_COMPUTED_TPS)  # a cache hit costs a step nothing
    return (computed if computed is not None else snapshot.get(knobs.PROMPT_TPS)) or 0.0


@dataclass(frozen=True)
class TokenMix:
    """The engine's prompt and generated tokens/s, smoothed; immutable, kept in a policy's state."""

    prompt_tps: float = 0.0
    gen_tps: float = 0.0
    at: float | None = None

    def update(self, snapshot: Snapshot, now: float, tau_s: float = TAU_S) -> TokenMix:
        """The mix with this tick's rates in; the first tick's rates are taken as they are (a policy on its
        first tick must not judge the steps by a mix of nothing)."""
        prompt = computed_prompt_tps(snapshot)
        gen = snapshot.get(knobs.GEN_TPS) or 0.0
        if self.at is None:
            return TokenMix(prompt, gen, now)
        return TokenMix(
            smoothed(self.prompt_tps, self.at, now, prompt, tau_s),
            smoothed(self.gen_tps, self.at, now, gen, tau_s),
            now,
        )

    @property
    def decode_share(self) -> float:
        """The decode share of a step's tokens; 1 before any token was seen (nothing says otherwise)."""
        total = self.gen_tps + self.prompt_tps
        return self.gen_tps / total if total > 0 else 1.0

    def prefill_bound(self, share_min: float = DECODE_SHARE_MIN) -> bool:
        """Whether the prompt chunks make the steps long, beyond what the batch can change."""
        return self.decode_share < share_min
