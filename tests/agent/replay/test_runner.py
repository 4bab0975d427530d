import pytest

from agent.replay.runner import ReplaySpec, parse_policy, run_summary, sweep, workload_for


def test_parse_static_policy():
    assert parse_policy("static:48") == ("static", 48)


@pytest.mark.parametrize("bad", ["static:0", "static:x", "greedy", "static"])
def test_bad_policy_is_refused(bad):
    with pytest.raises(ValueError, match="--policy"):
        parse_policy(bad)


def test_sweep_best_has_the_highest_goodput(conv):
    rows, best = sweep(ReplaySpec(conv, rate_scale=5.0), settings=(8, 64))
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
    rows, _ = sweep(spec, settings=(64,), workload=short)
    assert rows[0]["requests"] == len(short) < len(workload_for(spec, 4096))
