"""Allocator stats: conversion of torch.cuda.memory_stats() dicts, and the real (torch) source."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from agent.probe import stats

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "probe"


def worker_stats() -> dict[str, Any]:
    data: dict[str, dict[str, Any]] = json.loads((FIXTURES / "memory_stats_tp2.json").read_text())
    return data["1"]


def test_device_stats_reads_the_current_and_peak_counters() -> None:
    dev = stats.device_stats(1, worker_stats())
    assert dev.allocated_bytes == 70387482624
    assert dev.reserved_bytes == 71974961152
    assert dev.inactive_split_bytes == 1044381696
    assert dev.peak_reserved_bytes == 72729935872
    assert (dev.alloc_retries, dev.ooms) == (2, 1)


def test_missing_and_odd_counters_count_as_zero() -> None:
    dev = stats.device_stats(0, {"num_ooms": float("nan"), "num_alloc_retries": "x", "max_split_size": -1})
    assert (dev.ooms, dev.alloc_retries, dev.reserved_bytes) == (0.0, 0.0, 0.0)


def test_fragmentation_is_unused_share_of_reserved() -> None:
    assert stats.fragmentation(75.0, 100.0) == pytest.approx(0.25)


def test_fragmentation_is_zero_when_nothing_is_reserved() -> None:
    assert stats.fragmentation(0.0, 0.0) == 0.0


def test_no_cuda_in_use_without_torch_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert stats.cuda_in_use() is False
    assert stats.torch_stats() is None


def test_cpu_only_torch_gives_no_stats() -> None:
    import torch

    assert not torch.cuda.is_initialized()
    assert stats.torch_stats() is None
    assert stats.torch_version() == torch.__version__


def _fake_torch(per_device: dict[int, dict[str, Any]], current: int) -> types.ModuleType:
    cuda = types.SimpleNamespace(
        is_initialized=lambda: True,
        current_device=lambda: current,
        device_count=lambda: len(per_device),
        memory_stats=lambda index: per_device[index],
    )
    module = types.ModuleType("torch")
    module.cuda = cuda  # type: ignore[attr-defined]
    return module


def test_torch_stats_reports_only_devices_this_process_used(monkeypatch: pytest.MonkeyPatch) -> None:
    used = worker_stats()
    untouched = {"reserved_bytes.all.peak": 0, "reserved_bytes.all.current": 0}
    fake = _fake_torch({0: untouched, 1: used, 2: untouched, 3: {"reserved_bytes.all.peak": 1}}, current=2)
    monkeypatch.setitem(sys.modules, "torch", fake)
    assert sorted(stats.torch_stats() or {}) == [1, 2, 3]


def test_nvml_style_uuid_prefixes_torch_s_bare_hex() -> None:
    assert (
        stats.nvml_style_uuid("5D0F2B7E-1c3a-4e7b-9a53-0b1e7c4d2f10")
        == "GPU-5d0f2b7e-1c3a-4e7b-9a53-0b1e7c4d2f10"
    )
    assert stats.nvml_style_uuid("GPU-5d0f2b7e") == "GPU-5d0f2b7e"
    assert stats.nvml_style_uuid(" mig-1a2b ") == "MIG-1a2b"


def test_torch_device_uuids_reads_each_device_once(monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[int] = []

    def properties(device: int) -> types.SimpleNamespace:
        reads.append(device)
        if device == 3:
            raise RuntimeError("torch built without device UUIDs")
        return types.SimpleNamespace(uuid=f"0000000{device}-1c3a-4e7b-9a53-0b1e7c4d2f10")

    fake = _fake_torch({0: {}, 1: {}}, current=1)
    fake.cuda.get_device_properties = properties  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", fake)
    monkeypatch.setattr(stats, "_uuid_cache", {})
    assert stats.torch_device_uuids([1, 3]) == {1: "GPU-00000001-1c3a-4e7b-9a53-0b1e7c4d2f10"}
    assert stats.torch_device_uuids([1]) == {1: "GPU-00000001-1c3a-4e7b-9a53-0b1e7c4d2f10"}
    assert reads == [1, 3]


def test_torch_device_uuids_is_empty_without_cuda() -> None:
    assert stats.torch_device_uuids([0]) == {}
