"""Which of an engine's routes the gate admits, read from the engine's own ``/openapi.json``. Pure.

The gate admits the routes it knows (:data:`~agent.gate.openai.ADMITTED_PATHS`) and ``gate.admit_paths``;
anything else passes straight through, unlimited. Engines add routes from release to release (vLLM
0.32 serves Anthropic's ``/v1/messages``, a batch chat and structured decisions at ``/v1/systemone``,
all admitted since), and one that runs the
model but is not admitted lets its clients past the in-flight limit and the buckets without anyone
noticing. ``servepilot check`` lists what each upstream serves in three groups: admitted, passed through
on purpose (:data:`NOT_MODEL_RUNS`: tokenizers, health, cache resets, weight updates, pause/sleep...), and
the rest: POST routes nobody has judged, which an operator should look at and, if they run the model,
add to ``gate.admit_paths``. vLLM and SGLang (FastAPI) serve ``/openapi.json``; llama.cpp does not.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from agent.gate.openai import ADMITTED_PATHS

NOT_MODEL_RUNS = frozenset(
    {
        # tokenizers, health, discovery
        "/tokenize", "/detokenize", "/v1/tokenize", "/v1/detokenize", "/ping", "/health", "/health_generate",
        "/v1/messages/count_tokens",
        # cache and engine state (vLLM; the sleep and pause levers, docs/levers.md)
        "/reset_prefix_cache", "/reset_mm_cache", "/reset_encoder_cache", "/release_kv_cache_memory",
        "/sleep", "/wake_up", "/pause", "/resume", "/abort_requests", "/collective_rpc",
        "/scale_elastic_ep", "/is_scaling_elastic_ep", "/start_profile", "/stop_profile",
        # weights and adapters
        "/init_weight_transfer_engine", "/shutdown_weight_transfer_engine", "/start_weight_update",
        "/start_draft_weight_update", "/update_weights", "/finish_weight_update", "/update_weight_version",
        "/weight_checker", "/load_lora_adapter", "/unload_lora_adapter", "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        # SGLang's runtime endpoints (agent/control/sglang.py)
        "/flush_cache", "/abort_request", "/set_internal_state", "/get_internal_state", "/get_server_info",
        "/update_weights_from_disk", "/update_weights_from_tensor", "/update_weights_from_distributed",
        "/init_weights_update_group", "/release_memory_occupation", "/resume_memory_occupation",
        "/configure_logging", "/open_session", "/close_session", "/pause_generation", "/continue_generation",
        "/slow_down", "/freeze_gc", "/start_expert_distribution_record", "/stop_expert_distribution_record",
        "/dump_expert_distribution_record",
    }
)  # fmt: skip
"""POST routes that do not run the model over a request (or only as an operator's action): the gate
passes them through unlimited on purpose."""


@dataclass(frozen=True)
class Routes:
    """An engine's POST routes, as the gate treats them."""

    admitted: tuple[str, ...]
    passed: tuple[str, ...]
    """Passed through on purpose (:data:`NOT_MODEL_RUNS`)."""
    unjudged: tuple[str, ...]
    """Passed through, unlimited, and not known to be harmless: to look at."""

    def summary(self) -> str:
        text = f"{len(self.admitted)} admitted ({', '.join(self.admitted) or 'none'})"
        text += f", {len(self.passed)} control routes passed through"
        if self.unjudged:
            text += (
                f"; passed through unlimited, not known to the gate: {', '.join(self.unjudged)}"
                " (add to gate.admit_paths those that run the model)"
            )
        return text


def classify(openapi: Any, admit_paths: Collection[str] = ()) -> Routes:
    """The POST routes of an OpenAPI document (``paths`` -> method -> ...), sorted; ValueError when it
    has no ``paths`` object."""
    paths = openapi.get("paths") if isinstance(openapi, dict) else None
    if not isinstance(paths, dict):
        raise ValueError("the OpenAPI document has no 'paths' object")
    posted = sorted(p for p, ops in paths.items() if isinstance(ops, dict) and "post" in ops)
    admitted = [p for p in posted if p in ADMITTED_PATHS or p in admit_paths]
    passed = [p for p in posted if p not in admitted and _harmless(p)]
    unjudged = [p for p in posted if p not in admitted and p not in passed]
    return Routes(tuple(admitted), tuple(passed), tuple(unjudged))


def _harmless(path: str) -> bool:
    """Known not to run the model: listed, or an action on one stored response (``.../{id}/cancel``)."""
    return path in NOT_MODEL_RUNS or "{" in path
