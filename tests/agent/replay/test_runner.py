import pytest

from agent.replay.runner import (
    ReplaySpec,
    parse_policy,
    run_summary,
    static_grid,
    static_tokens,
    sweep,
    workload_for,
)
from agent.replay.slo import Slo


def test_parse_static_policy():
    assert parse_policy("static:48") == ("static", 48)


def test_parse_static_policy_with_a_token_budget():
    assert parse_policy("static:48/1024") == ("static", 48)
    assert static_tokens("static:48/1024") == 1024 and static_tokens("static:48") is None


@pytest.mark.parametrize(
    "bad", ["static:0", "static:x", "greedy", "static", "static:8/", "static:8/4", "static:8/x"]
)
def test_bad_policy_is_refused(bad):
    with pytest.raises(ValueError, match="--policy"):
        parse_policy(bad)


def test_sweep_best_has_the_highest_goodput(conv):
    rows, best = sweep(ReplaySpec(conv, rate_scale=5.0), settings=(8, 64), budget_settings=(64,))
    assert [r["policy"] for r in rows] == [
        "static:8",
        "static:64",
        "static:64/512",
        "static:64/1024",
        "static:64/4096",
    ]
    assert best["goodput_tps"] == max(r["goodput_tps"] for r in rows)


def test_energy_adds_the_clock_policy(conv):
    summary = run_summary(ReplaySpec(conv, rate_scale=0.5, energy=True), "auto")
    assert summary["policy"] == "auto+energy" and any(
        a["knob"] == "gpu.sm_clock_mhz" for a in summary["actions"]
    )


def test_seed_policy_keeps_within_its_bounds(conv):
    summary = run_summary(ReplaySpec(conv, rate_scale=5.0), "seed")
    batch = [a["value"] for a in summary["actions"] if a["knob"] == "batch.max_in_flight"]
    assert batch and max(batch) <= 128 and summary["actions"][-1]["value"] <= 32


def test_spec_window_starts_where_asked(conv):
    whole = workload_for(ReplaySpec(conv), 4096)
    start = float(whole.arrivals[150])
    window = workload_for(ReplaySpec(conv, start_s=start, duration_s=60.0), 4096)
    assert window.prompts[0] == whole.prompts[150] and window.duration_s < 60.0


def test_sweep_on_a_given_workload_replays_that_workload(conv):
    spec = ReplaySpec(conv, rate_scale=5.0)
    short = workload_for(spec, 4096).until(5.0)
    rows, _ = sweep(spec, settings=(64,), budgets=(), workload=short)
    assert rows[0]["requests"] == len(short) < len(workload_for(spec, 4096))


def test_static_grid_sweeps_every_budget_auto_can_reach(conv):
    grid = static_grid(ReplaySpec(conv), settings=(8, 256), budgets=(512, 2048), budget_settings=(8, 64))
    assert grid == ["static:8", "static:256", "static:8/512", "static:64/512"]


def test_static_budget_sets_the_engine_budget(conv):
    spec = ReplaySpec(conv, rate_scale=5.0, duration_s=20.0)
    small = run_summary(spec, "static:64/512", with_actions=False)
    big = run_summary(spec, "static:64", with_actions=False)
    assert small["policy"] == "static:64/512" and small["itl_p99_s"] < big["itl_p99_s"]


def test_auto_lowers_the_token_budget_when_prefill_stalls_decodes(code):
    summary = run_summary(ReplaySpec(code, rate_scale=2.0, slo=Slo(10.0, 0.1)), "auto")
    budget = [a["value"] for a in summary["actions"] if a["knob"] == "engine.max_num_batched_tokens"]
    assert budget and min(budget) < 2048 and all(1024 <= b <= 4096 for b in budget)
    default = run_summary(ReplaySpec(code, rate_scale=2.0, slo=Slo(10.0, 0.1)), "static:256")
    assert summary["slo_attainment"] > default["slo_attainment"]
