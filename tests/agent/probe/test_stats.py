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
