from agent.replay.driver import Replay
from agent.replay.report import render
from agent.replay.slo import Slo
from agent.replay.summary import summarise
from agent.replay.workload import load
from simulator.engine import make_core


def test_report_is_html_with_one_chart_per_panel(conv):
    core = make_core("a100-80g", "llama-2-7b", max_num_seqs=64, max_num_batched_tokens=2048)
    run = Replay(core, load(conv, max_model_len=4096, rate_scale=5.0), Slo(10.0, 0.1)).run()
    page = render(run, summarise(run, "static:64"))
    assert page.startswith("<!doctype html>") and page.count("<svg") == 6
    assert "priority classes" not in page


def test_a_replay_with_classes_shows_a_row_per_class(conv):
    from agent.replay.runner import ReplaySpec, run_policy

    spec = ReplaySpec(
        conv, rate_scale=5.0, priority_mix=(("high", 0.3), ("low", 0.7)), class_slo=(("low", 60.0, None),)
    )
    run, name = run_policy(spec, "static:32")
    page = render(run, summarise(run, name))
    assert "<h2>priority classes</h2>" in page
    assert page.count("<tr><td>high</td>") == 1 and page.count("<tr><td>low</td>") == 1
    assert "<td>60</td>" in page  # low's own TTFT target
