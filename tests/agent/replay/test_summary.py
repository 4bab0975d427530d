import json

import pytest

from agent.replay.driver import Replay
from agent.replay.slo import Slo
from agent.replay.summary import summarise, table
from agent.replay.workload import load
from simulator.engine import make_core

KEYS = {
    "policy",
    "goodput_tps",
    "throughput_tps",
    "slo_attainment",
    "ttft_p99_s",
    "itl_p99_s",
    "energy_j_per_token",
    "actions",
}


@pytest.fixture
def summary(conv):
    core = make_core("a100-80g", "llama-2-7b", max_num_seqs=64, max_num_batched_tokens=2048)
    run = Replay(core, load(conv, max_model_len=4096, rate_scale=5.0), Slo(10.0, 0.1)).run()
    return summarise(run, "static:64")


def test_has_the_design_contract_keys(summary):
    assert set(summary) >= KEYS


def test_goodput_never_exceeds_throughput(summary):
    assert 0 < summary["goodput_tps"] <= summary["throughput_tps"]


def test_attainment_is_a_ratio(summary):
    assert 0.0 <= summary["slo_attainment"] <= 1.0


def test_is_json_serialisable(summary):
    assert json.loads(json.dumps(summary))["policy"] == "static:64"


def test_table_has_one_line_per_row(summary):
    assert len(table([summary, summary]).splitlines()) == 4
