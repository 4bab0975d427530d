"""GPU and model profile look-ups."""

from __future__ import annotations

import pytest

from simulator.hardware import gpu_profile
from simulator.models import model_profile


def test_gpu_lookup_is_case_insensitive() -> None:
    assert gpu_profile("H100-SXM").tp == 1


def test_unknown_gpu_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="known: a100-80g"):
        gpu_profile("v100")


def test_fp8_is_native_on_hopper_only() -> None:
    assert gpu_profile("h100-sxm").supports_native("fp8")
    assert not gpu_profile("a100-80g").supports_native("fp8")
    assert gpu_profile("a100-80g").flops("fp8") == gpu_profile("a100-80g").flops("fp16")


def test_model_lookup_accepts_the_served_name() -> None:
    assert model_profile("meta-llama/Meta-Llama-3-8B-Instruct").key == "llama-3-8b"


def test_gqa_model_has_a_quarter_of_the_kv_per_token() -> None:
    assert model_profile("llama-3-8b").kv_bytes_per_token("fp16") * 4 == model_profile(
        "llama-2-7b"
    ).kv_bytes_per_token("fp16")
