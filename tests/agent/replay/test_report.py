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
