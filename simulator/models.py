"""Model profiles: the architecture numbers that set bytes moved and FLOPs per token.

Values are from the models' published ``config.json`` (Llama 2 7B uses full multi-head attention; the
Llama 3 models use grouped-query attention with 8 KV heads, which is why their KV cache per token is a
quarter of Llama 2's at the same width).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

#: Bytes per weight and per KV element. fp8 here means FP8 weights *and* an FP8 KV cache
#: (``--quantization fp8 --kv-cache-dtype fp8``), the usual "fp8 variant" of a deployment.
BYTES_PER_ELEMENT: Mapping[str, int] = MappingProxyType({"fp16": 2, "bf16": 2, "fp8": 1})


@dataclass(frozen=True)
class ModelProfile:
    """A decoder-only transformer, described by what the roofline needs."""

    key: str
    served_name: str
    params: float
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_model_len: int

    def weight_bytes(self, precision: str) -> float:
        """Bytes of weights read once per forward pass (the whole model, all ranks together)."""
        return self.params * BYTES_PER_ELEMENT[precision]

    def kv_bytes_per_token(self, precision: str) -> float:
        """KV-cache bytes one token occupies: K and V, every layer, every KV head (all ranks together)."""
        return 2.0 * self.layers * self.kv_heads * self.head_dim * BYTES_PER_ELEMENT[precision]

    def linear_flops_per_token(self) -> float:
        """Matmul FLOPs per token through the weights: 2 per parameter (one multiply-add)."""
        return 2.0 * self.params

    def attention_flops_per_pair(self) -> float:
        """FLOPs for one (query token, context token) pair: QK^T and PV, 2 FLOPs per MAC, every head."""
        return 4.0 * self.layers * self.heads * self.head_dim


MODELS: Mapping[str, ModelProfile] = MappingProxyType(
    {
        "llama-2-7b": ModelProfile(
            key="llama-2-7b",
            served_name="meta-llama/Llama-2-7b-hf",
            params=6.74e9,
            layers=32,
            hidden=4096,
            heads=32,
            kv_heads=32,
            head_dim=128,
            vocab=32000,
            max_model_len=4096,
        ),
        "llama-3-8b": ModelProfile(
            key="llama-3-8b",
            served_name="meta-llama/Meta-Llama-3-8B-Instruct",
            params=8.03e9,
            layers=32,
            hidden=4096,
            heads=32,
            kv_heads=8,
            head_dim=128,
            vocab=128256,
            max_model_len=8192,
        ),
        "llama-3-70b": ModelProfile(
            key="llama-3-70b",
            served_name="meta-llama/Meta-Llama-3-70B-Instruct",
            params=70.6e9,
            layers=80,
            hidden=8192,
            heads=64,
            kv_heads=8,
            head_dim=128,
            vocab=128256,
            max_model_len=8192,
        ),
    }
)


def model_profile(key: str) -> ModelProfile:
    """Look a model up by key (``llama-2-7b``) or served name, case-insensitively."""
    wanted = key.lower()
    for model in MODELS.values():
        if wanted in (model.key, model.served_name.lower()):
            return model
    raise ValueError(f"unknown model {key!r}; known: {', '.join(MODELS)}")
