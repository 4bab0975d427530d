"""``servepilot replay --config``: the replay takes the config's SLO, classes, steering, batch bounds,
queue timeout, energy setting and error budget, and a flag given on the command line wins."""

import math

from agent.config import build
from agent.replay.from_config import Flags, describe, spec_fields

POLICIES = {
    "ttft_slo_s": 3.0,
    "itl_slo_s": 0.08,
    "itl_steering": "served_classes",
    "served_window_s": 120.0,
    "slo_by_priority": {"high": {"itl_s": 0.05}, "low": {"ttft_s": 60.0}},
    "batch_min": 4,
    "batch_max": 256,
    "energy": True,
    "error_budget": 0.005,
}


def _cfg(gate: bool = True):
    data = {"policies": POLICIES, "gate": {"enabled": gate, "max_queue_wait_s": 2.5}}
    return build({**data, "actuators": {"gpu": "locked_clocks"}}, environ={})


def test_the_config_gives_every_field_the_replay_acts_on():
    fields = spec_fields(_cfg(), Flags(), with_classes=True)
    assert fields == {
        "slo": (3.0, 0.08),
        "class_slo": (("high", None, 0.05), ("low", 60.0, None)),
        "itl_steering": "served_classes",
        "served_window_s": 120.0,
        "batch_bounds": (4.0, 256.0),
        "energy": True,
        "error_budget": 0.005,
        "queue_timeout_s": 2.5,
    }
    line = describe(_cfg(), fields, True)
    assert "SLO ttft=3s itl=0.08s" in line and "batch 4-256" in line and "queue timeout 2.5s" in line
    assert "class targets: high, low; itl_steering served_classes" in line
    assert "error budget 0.50%" in line


def test_flags_win_over_the_config():
    flags = Flags(
        slo=(1.0, 0.2), class_slo=(("normal", 5.0, None),), itl_steering="global", queue_timeout_s=9.0
    )
    fields = spec_fields(_cfg(), flags, with_classes=True)
    assert fields["slo"] == (1.0, 0.2) and fields["class_slo"] == (("normal", 5.0, None),)
    assert (fields["itl_steering"], fields["queue_timeout_s"]) == ("global", 9.0)


def test_without_a_mix_the_configs_classes_are_left_out_and_said_so():
    fields = spec_fields(_cfg(), Flags(), with_classes=False)
    assert (fields["class_slo"], fields["itl_steering"]) == ((), None)  # the replay's default: one class
    assert "class targets and itl_steering need --priority-mix" in describe(_cfg(), fields, False)
    # a flag is kept, so that the replay refuses it as it does without a config
    assert (
        spec_fields(_cfg(), Flags(itl_steering="served_classes"), False)["itl_steering"] == "served_classes"
    )


def test_a_config_without_the_gate_replays_the_engine_alone():
    fields = spec_fields(_cfg(gate=False), Flags(), with_classes=False)
    assert math.isinf(fields["queue_timeout_s"])
    assert "no queue timeout (gate off)" in describe(_cfg(gate=False), fields, False)
