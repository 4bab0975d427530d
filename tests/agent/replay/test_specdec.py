"""Replays with speculative decoding: the snapshot reads ITL per token as the live collector reads vLLM's,
and the summary says what the drafts did."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.cli import main
from agent.replay.runner import ReplaySpec, run_summary
from agent.replay.signals import CoreSignals
from detectors.snapshot import Snapshot
from simulator.engine import EngineCore, make_core
from simulator.specdec import SpecDecodeConfig

OUTPUT = 129  # each request's tokens: its first, then 128


def _sixteen_decoded(spec: SpecDecodeConfig | None) -> tuple[EngineCore, Snapshot]:
    """A core that decoded sixteen requests of :data:`OUTPUT` tokens, and the snapshot after them over a
    window that holds them all."""
    core = make_core("a100-80g", "llama-2-7b", max_num_seqs=16, spec=spec)
    signals = CoreSignals(core, window_s=600.0)
    signals.snapshot(0.0, {})
    for i in range(16):
        core.submit(f"r{i}", 200, OUTPUT, 0.0)
    while core.has_work():
        core.step(core.time, max_steps=64)
    return core, signals.snapshot(core.time + 0.001, {})


def test_the_snapshot_itl_is_a_tokens_time_when_a_step_brings_several() -> None:
    """Sixteen requests of 129 tokens decoded with 3-token drafts: the simulator observes one ITL gap per
    step (as vLLM does), so the raw mean is a step's time; the snapshot's is a token's, which is what
    each request's own time per output token (the simulator's TPOT histogram) says."""
    core, snapshot = _sixteen_decoded(SpecDecodeConfig(3, 0.8))
    stats = core.stats
    per_step = stats.itl.sum / stats.itl.count
    per_token = stats.tpot.sum / stats.tpot.count  # every request is as long: the per-token mean too
    assert stats.tpot.count == 16
    assert per_step > 2 * per_token  # most drafts were accepted
    assert snapshot.values["engine.itl_seconds.mean"] == pytest.approx(per_token, rel=1e-9)
    assert snapshot.values["engine.itl_seconds.p99"] < per_step * 10


def test_without_drafts_the_snapshot_itl_is_the_histograms_own() -> None:
    core, snapshot = _sixteen_decoded(None)
    stats = core.stats
    assert snapshot.values["engine.itl_seconds.mean"] == pytest.approx(stats.itl.sum / stats.itl.count)
    assert snapshot.values["engine.itl_seconds.mean"] == pytest.approx(stats.tpot.sum / stats.tpot.count)


def test_a_replay_with_drafts_reports_their_acceptance_and_decodes_faster(conv: Path) -> None:
    """Drafts of 3 tokens each accepted with p 0.8 after the one before: (0.8 + 0.64 + 0.512) / 3 = 0.65
    of draft tokens accepted, 1 + 1.95 tokens a draft; the same trace decodes each token faster."""
    base = ReplaySpec(conv, rate_scale=1.0)
    plain = run_summary(base, "static:64", with_actions=False)
    drafted = run_summary(
        ReplaySpec(conv, rate_scale=1.0, spec_decode=SpecDecodeConfig(3, 0.8)),
        "static:64",
        with_actions=False,
    )
    assert "spec_decode" not in plain
    spec = drafted["spec_decode"]
    assert spec["draft_tokens"] == 3 and spec["acceptance_per_token"] == 0.8
    assert spec["acceptance"] == pytest.approx(0.651, abs=0.02)
    assert spec["tokens_per_draft"] == pytest.approx(1 + 3 * 0.651, abs=0.06)
    assert drafted["itl_p50_s"] < 0.6 * plain["itl_p50_s"]
    assert drafted["requests"] == plain["requests"]


def test_replay_flags_draft_and_a_bad_one_is_one_line_naming_it(
    conv: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replay", "--trace", str(conv), "--spec-acceptance", "1.5"]) == 2
    err = capsys.readouterr().err
    assert err == "servepilot replay: --spec-acceptance must be in [0, 1], got 1.5\n"
    assert (
        main(["replay", "--trace", str(conv), "--policy", "static:64", "--spec-tokens", "2", "--json"]) == 0
    )
    summary = json.loads(capsys.readouterr().out)
    assert summary["spec_decode"]["draft_tokens"] == 2 and summary["spec_decode"]["drafts"] > 0
    assert main(["replay", "--trace", str(conv), "--policy", "static:64", "--spec-tokens", "2"]) == 0
    assert "speculative decoding: 2 draft tokens" in capsys.readouterr().out


def test_spec_compare_replays_each_draft_length_and_names_the_best(
    conv: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["replay", "--trace", str(conv), "--policy", "static:64", "--spec-acceptance", "0.8"]
    assert main([*argv, "--spec-compare", "0,3", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    plain, drafted = summary["spec_compare"]
    assert [plain["policy"], drafted["policy"]] == ["static:64 K=0", "static:64 K=3"]
    assert "spec_decode" not in plain and drafted["spec_decode"]["draft_tokens"] == 3
    assert drafted["itl_p50_s"] < 0.6 * plain["itl_p50_s"]
    assert summary["best_spec"] in ("static:64 K=0", "static:64 K=3")
    with pytest.raises(SystemExit) as exited:  # argparse's own exit for a bad value: 2, one line
        main([*argv, "--spec-compare", "0,17"])
    assert exited.value.code == 2
    assert "--spec-compare lengths must be in [0, 16], got '0,17'" in capsys.readouterr().err
    assert main([*argv, "--spec-compare", "0,3", "--sweep"]) == 2
    assert "choose one" in capsys.readouterr().err
