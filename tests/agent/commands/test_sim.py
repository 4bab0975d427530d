"""``servepilot sim`` argument handling (the server itself is tested in tests/simulator)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from agent.commands import sim


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sim.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["sim", *argv])


def test_defaults_match_vllm() -> None:
    args = _parse()
    assert (args.host, args.port, args.max_num_seqs, args.speed) == ("127.0.0.1", 8000, 256, 1.0)


def test_flags_are_parsed() -> None:
    args = _parse(
        "--gpu",
        "h100-sxm",
        "--precision",
        "fp8",
        "--max-num-seqs",
        "32",
        "--seed",
        "3",
        "--speed",
        "10",
        "--fault-error-rate",
        "0.1",
    )
    assert (args.gpu, args.precision, args.max_num_seqs, args.seed, args.speed) == (
        "h100-sxm",
        "fp8",
        32,
        3,
        10.0,
    )
    assert args.fault_error_rate == 0.1


def test_the_scheduling_policy_is_vllms_flag_with_its_default() -> None:
    assert _parse().scheduling_policy == "fcfs"
    assert _parse("--scheduling-policy", "priority").scheduling_policy == "priority"
    with pytest.raises(SystemExit):
        _parse("--scheduling-policy", "lifo")


def test_registering_imports_neither_the_simulator_nor_aiohttp() -> None:
    code = (
        "import argparse, sys; from agent.commands import sim; "
        "sim.register(argparse.ArgumentParser().add_subparsers()); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('simulator', 'aiohttp')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_bad_fault_value_is_a_usage_error() -> None:
    from agent.cli import UsageError

    with pytest.raises(UsageError, match="error_rate must be in"):
        sim.run(_parse("--fault-error-rate", "3"))


def test_a_node_with_fewer_gpus_than_the_engine_is_a_usage_error() -> None:
    from agent.cli import UsageError

    assert _parse().node_gpus is None and _parse("--node-gpus", "4").node_gpus == 4
    with pytest.raises(UsageError, match=r"^--node-gpus must be at least the engine's 4 GPU\(s\), got 2$"):
        sim.run(_parse("--gpu", "4xa100-80g-tp", "--model", "llama-3-70b", "--node-gpus", "2"))


def test_model_that_does_not_fit_is_a_usage_error() -> None:
    from agent.cli import UsageError

    with pytest.raises(UsageError, match="does not fit"):
        sim.run(_parse("--model", "llama-3-70b"))


def test_event_loop_defaults_to_auto_and_asyncio_is_the_standard_loop() -> None:
    assert _parse().event_loop == "auto"
    loop = sim._new_loop("asyncio")
    try:
        assert type(loop).__module__.startswith("asyncio")
    finally:
        loop.close()


def test_auto_takes_uvloop_where_it_imports() -> None:
    loop = sim._new_loop("auto")
    try:
        assert type(loop).__module__.startswith("uvloop")
    finally:
        loop.close()


def test_uvloop_asked_for_but_missing_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from agent.cli import UsageError

    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now raises ImportError
    with pytest.raises(UsageError, match="--event-loop is uvloop"):
        sim._new_loop("uvloop")
    loop = sim._new_loop("auto")  # auto falls back to the standard loop
    try:
        assert type(loop).__module__.startswith("asyncio")
    finally:
        loop.close()
