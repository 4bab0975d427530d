"""`servepilot demo`: its arguments and the config it builds (its runs are in tests/e2e/test_demo.py)."""

from __future__ import annotations

import pytest

from agent import config
from agent.cli import main
from agent.commands.demo import DEFAULT_PRIORITY_MIX, demo_config, parse_priority_mix, with_gate


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--initial-batch", "4"], "--initial-batch sets the gate's batch: it needs --mode advise or act"),
        (["--mode", "act", "--initial-batch", "0"], "--initial-batch must be positive, got 0"),
        (["--rate-scale", "0"], "--rate-scale must be positive, got 0"),
        (["--fault", "leak"], "--fault must look like NAME=NUMBER, got 'leak'"),
        (["--spec-tokens", "17"], "--spec-tokens must be in [0, 16], got 17"),
        (
            ["--engine", "llamacpp", "--spec-tokens", "3"],
            "--spec-tokens needs --engine sim or vllm (the demo's llama.cpp has no draft model)",
        ),
        (
            ["--priority-mix", "high=1"],
            "--priority-mix sets classes the gate acts on: it needs --mode advise or act",
        ),
        (
            ["--mode", "act", "--priority-mix", "urgent=1"],
            "--priority-mix must look like high=0.1,normal=0.7,low=0.2, got 'urgent=1'",
        ),
        (
            ["--mode", "act", "--priority-mix", "high=x"],
            "--priority-mix share of high must be a number, got 'x'",
        ),
        (
            ["--mode", "act", "--priority-mix", "high=nan"],
            "--priority-mix share of high must be >= 0, got nan",
        ),
        (
            ["--mode", "act", "--priority-mix", "high=0,low=0"],
            "--priority-mix needs a share above 0, got 'high=0,low=0'",
        ),
    ],
)
def test_bad_arguments_exit_2_with_one_line(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(says) and "\n" not in err


def test_advise_and_act_put_the_gate_in_front_of_the_engine_and_start_it_where_asked() -> None:
    cfg = config.build(with_gate(demo_config(9400, 8000), "act", 8080, 4))
    assert cfg.gate.enabled and cfg.gate.upstreams == {"primary": "http://127.0.0.1:8000"}
    assert (cfg.gate.listen_host, cfg.gate.listen_port) == ("127.0.0.1", 8080)
    assert cfg.gate.max_in_flight == cfg.policies.initial_batch == 4 and cfg.policies.batch_min == 4
    assert cfg.actuators.mode == "act" and cfg.policies.set == "auto"
    assert cfg.audit.path is None  # decisions at /api/actions, no file in the working directory
    # without a start of its own the gate and the policy keep their shared default
    plain = config.build(with_gate(demo_config(9400, 8000), "advise", 8080, None))
    assert plain.gate.max_in_flight == plain.policies.initial_batch and plain.actuators.mode == "advise"


def test_on_the_simulator_the_engines_control_api_and_the_energy_policy_join() -> None:
    cfg = config.build(with_gate(demo_config(9400, 8000), "act", 8080, None, engine_control=True))
    assert cfg.control.enabled and cfg.control.url == "http://127.0.0.1:8000" and cfg.policies.energy
    real = config.build(with_gate(demo_config(9400, 8000), "act", 8080, None))  # a real CPU engine
    assert not real.control.enabled and not real.policies.energy


def test_the_fault_example_in_the_help_is_a_real_fault_switch() -> None:
    import re

    from agent.cli import build_parser
    from simulator.faults import FaultSwitches

    demo = build_parser()._subparsers._group_actions[0].choices["demo"]  # type: ignore[union-attr]
    [fault] = [action for action in demo._actions if "--fault" in action.option_strings]
    [example] = re.findall(r"e\.g\. (\w+)=", fault.help)
    assert example in FaultSwitches().to_json()


def test_the_status_line_shows_the_clock_and_in_act_mode_the_newest_action() -> None:
    """``--no-view`` prints one line every 5 s: with the gate it names the limit and the newest action."""
    from types import SimpleNamespace

    from agent.demo_runner import _status_line
    from agent.loadgen import LoadStats

    values = {"nvml.gpu0.sm_clock_hz.mean": 1.513e9, "gate.limit": 216.0}
    state = SimpleNamespace(snapshot=SimpleNamespace(get=values.get), findings=())
    action = {"knob": "gpu.sm_clock_mhz", "from": 1669.0, "to": 1513.0}
    audit = SimpleNamespace(recent=lambda n: [action][:n])
    gen = SimpleNamespace(stats=LoadStats())
    observing = SimpleNamespace(
        loop=SimpleNamespace(state=state), knobs=SimpleNamespace(gate=None, audit=audit)
    )
    line = _status_line(observing, gen, 5.0)  # type: ignore[arg-type]
    assert "1513 MHz" in line and "last action" not in line
    acting = SimpleNamespace(
        loop=SimpleNamespace(state=state), knobs=SimpleNamespace(gate=object(), audit=audit)
    )
    line = _status_line(acting, gen, 5.0)  # type: ignore[arg-type]
    assert line.endswith("| gate limit 216, last action: gpu.sm_clock_mhz 1669.0 -> 1513.0")


def test_the_status_line_falls_back_to_the_clients_ttft_where_the_engine_reports_none() -> None:
    """llama.cpp has no TTFT histogram: the line shows the load generator's p99, marked as the client's."""
    from types import SimpleNamespace

    from agent.demo_runner import _status_line
    from agent.loadgen import LoadStats

    values: dict[str, float] = {}
    state = SimpleNamespace(snapshot=SimpleNamespace(get=values.get), findings=())
    sidecar = SimpleNamespace(loop=SimpleNamespace(state=state), knobs=SimpleNamespace(gate=None, audit=None))
    gen = SimpleNamespace(stats=LoadStats())
    assert "ttft p99 - ms |" in _status_line(sidecar, gen, 5.0)  # type: ignore[arg-type]
    gen.stats.ttft_s.extend([0.1] * 98 + [0.5] * 2)
    assert "ttft p99 500 ms (client) |" in _status_line(sidecar, gen, 5.0)  # type: ignore[arg-type]
    values["engine.ttft_seconds.p99"] = 0.25
    assert "ttft p99 250 ms |" in _status_line(sidecar, gen, 5.0)  # type: ignore[arg-type]


def test_the_default_priority_mix_parses_to_shares_of_all_three_classes() -> None:
    assert parse_priority_mix(DEFAULT_PRIORITY_MIX) == {"high": 0.1, "normal": 0.7, "low": 0.2}
    assert parse_priority_mix(" high=1 , low=3") == {"high": 1.0, "low": 3.0}


def test_with_a_priority_mix_the_status_line_shows_each_classes_ttft_and_shed() -> None:
    from types import SimpleNamespace

    from agent.demo_runner import _status_line
    from agent.loadgen import LoadStats

    state = SimpleNamespace(snapshot=SimpleNamespace(get={}.get), findings=())
    sidecar = SimpleNamespace(loop=SimpleNamespace(state=state), knobs=SimpleNamespace(gate=None, audit=None))
    stats = LoadStats(classes={"high": LoadStats(), "low": LoadStats(shed=7)})
    stats.classes["high"].ttft_s.extend([0.05, 0.05])
    line = _status_line(sidecar, SimpleNamespace(stats=stats), 5.0)  # type: ignore[arg-type]
    assert line.endswith("| ttft p99 high 50 ms (shed 0), low - ms (shed 7)")


def test_the_vllm_demo_runs_vllm_with_priority_scheduling_and_the_gate_passes_the_classes() -> None:
    from agent.engines.demo import ENGINE_PRIORITY, launch_options

    assert launch_options("vllm").scheduling_policy == "priority"
    assert launch_options("llamacpp").scheduling_policy == "fcfs"  # llama.cpp has no priority field
    assert launch_options("vllm").speculative_ngram == 0
    assert launch_options("vllm", spec_tokens=3).speculative_ngram == 3  # --spec-tokens: n-gram drafts
    cfg = config.build(
        with_gate(demo_config(9400, 8000), "act", 8080, None, engine_priority=ENGINE_PRIORITY["vllm"])
    )
    assert cfg.gate.priority_value("primary", "high") == -1
    assert config.build(with_gate(demo_config(9400, 8000), "act", 8080, None)).gate.engine_priority == {}


def test_the_simulator_demo_ranks_its_engines_queue_by_the_classes_the_gate_passes() -> None:
    from types import SimpleNamespace

    from agent.demo_runner import _Simulator
    from agent.engines.demo import ENGINE_PRIORITY

    args = SimpleNamespace(gpu="a100-80g", model="llama-3-8b", spec_tokens=0)
    simulator = _Simulator(args, {})  # type: ignore[arg-type]
    assert simulator.server.core.scheduler.policy == "priority" and simulator.server.core.spec is None
    cfg = config.build(
        with_gate(demo_config(9400, 8000), "act", 8080, None, engine_priority=ENGINE_PRIORITY["sim"])
    )
    assert [cfg.gate.priority_value("primary", c) for c in ("high", "normal", "low")] == [-1, 0, 1]


def test_spec_tokens_make_the_simulated_engine_draft_and_the_fault_switch_sets_their_acceptance() -> None:
    from types import SimpleNamespace

    from agent.demo_runner import DEMO_DRAFT_COST, _Simulator

    args = SimpleNamespace(gpu="a100-80g", model="llama-3-8b", spec_tokens=3)
    core = _Simulator(args, {"spec_acceptance": 0.05}).server.core  # type: ignore[arg-type]
    assert core.spec is not None and core.spec.k == 3 and core.faults.spec_acceptance == 0.05
    assert core.spec.config.draft_cost == DEMO_DRAFT_COST  # what the demo's sidecar prices drafts at
