import pytest

from policies.arbiter import Arbiter
from policies.base import Proposal
from policies.knobs import TOKEN_BUDGET
from policies.registry import build_set, default_arbiter
from policies.token_budget import BudgetState, TokenBudget
from tests.policies.conftest import make_snapshot

POLICY = TokenBudget(ttft_slo_s=10.0, itl_slo_s=0.1)
#: A tick whose steps carry prompt tokens, with 2048 published as the engine's budget.
PREFILL = {
    "engine__requests_running": 12,
    "engine__max_num_batched_tokens": 2048,
    "engine__prompt_tokens_per_second": 9000,
}


def _decide(state: BudgetState | None = None, now: float = 100.0, **values: float) -> list[float]:
    _, proposals = POLICY.decide(make_snapshot(**values), [], state, now)
    return [float(p.value) for p in proposals]


def test_halves_when_itl_tail_is_over_target_while_prefilling():
    assert _decide(engine__itl_seconds__p99=0.13, **PREFILL) == [1024]


def test_the_reason_tells_an_itl_just_over_the_target_from_it():
    _, proposals = POLICY.decide(make_snapshot(engine__itl_seconds__p99=0.0801, **PREFILL), [], None, 100.0)
    assert proposals[0].reason.startswith("ITL p99 0.0801s above 0.08s while prefilling")


def test_holds_when_itl_is_over_target_without_prefill():
    """Slow decode steps are the batch limit's business: smaller chunks would not help."""
    values = {**PREFILL, "engine__prompt_tokens_per_second": 0}
    assert _decide(engine__itl_seconds__p99=0.13, **values) == []


def test_prompt_tokens_all_served_by_the_prefix_cache_are_no_prefill():
    """vLLM counts its cache hits among its prompt tokens; steps that computed none carry no chunk to
    shrink. The computed rate (engine.prompt_tokens_computed_per_second) decides where it is published."""
    hits = {**PREFILL, "engine__prompt_tokens_computed_per_second": 0}
    assert _decide(engine__itl_seconds__p99=0.13, **hits) == []
    some = {**PREFILL, "engine__prompt_tokens_computed_per_second": 800}
    assert _decide(engine__itl_seconds__p99=0.13, **some) == [1024]


def test_itl_alone_stops_halving_at_the_itl_floor():
    """Below 1024 an ITL tail comes from decode: only KV pressure takes the budget further down."""
    values = {**PREFILL, "engine__max_num_batched_tokens": 1024}
    assert _decide(engine__itl_seconds__p99=0.2, **values) == []
    assert _decide(engine__itl_seconds__p99=0.2, engine__preemptions_per_second=0.5, **values) == [512]


def test_the_itl_floor_scales_with_a_tighter_itl_target():
    """At a 0.05 s target (an interactive class steered to) a 1024-token chunk's step alone breaks it:
    ITL halves the budget on to 512. A looser target keeps the 1024 floor."""
    values = make_snapshot(
        **{**PREFILL, "engine__max_num_batched_tokens": 1024}, engine__itl_seconds__p99=0.06
    )
    tight = TokenBudget(ttft_slo_s=10.0, itl_slo_s=0.05)
    assert (tight.floor_for_itl, POLICY.floor_for_itl) == (512.0, 1024.0)
    assert TokenBudget(ttft_slo_s=10.0, itl_slo_s=0.2).floor_for_itl == 1024.0
    assert TokenBudget(ttft_slo_s=10.0, itl_slo_s=0.075).floor_for_itl == pytest.approx(768.0)
    assert [p.value for p in tight.decide(values, [], None, 100.0)[1]] == [512]
    assert POLICY.decide(values, [], None, 100.0)[1] == []  # 0.06 s is inside 0.1 s x headroom anyway


def test_halves_on_kv_pressure_while_prefilling_even_with_itl_in_target():
    values = {**PREFILL, "engine__itl_seconds__p99": 0.03}
    assert _decide(engine__kv_cache_usage_ratio=0.97, **values) == [1024]
    assert _decide(engine__preemptions_per_second=2.0, **values) == [1024]
    assert _decide(engine__kv_cache_usage_ratio=0.9, **values) == []  # below kv_high: no pressure


def test_kv_pressure_without_prefill_holds():
    """Preemptions in pure-decode steps: the chunk is not what fills the cache."""
    values = {**PREFILL, "engine__prompt_tokens_per_second": 0, "engine__itl_seconds__p99": 0.03}
    assert _decide(engine__preemptions_per_second=2.0, **values) == []


def test_never_goes_below_its_lower_bound():
    values = {**PREFILL, "engine__max_num_batched_tokens": 512, "engine__preemptions_per_second": 3.0}
    assert _decide(engine__itl_seconds__p99=0.2, **values) == []


#: A tick at budget 512 that would double (TTFT at risk, ITL far below target) but for KV pressure.
DOUBLING = {
    **PREFILL,
    "engine__max_num_batched_tokens": 512,
    "engine__ttft_seconds__p99": 9.0,
    "engine__itl_seconds__p99": 0.03,
    "engine__kv_cache_usage_ratio": 0.5,
}


def test_does_not_double_within_the_kv_hold_after_pressure():
    assert _decide(BudgetState(512, changed_at=0.0, pressed_at=60.0), now=100.0, **DOUBLING) == []
    assert _decide(BudgetState(512, changed_at=0.0, pressed_at=30.0), now=100.0, **DOUBLING) == [1024]


def test_does_not_double_while_kv_usage_is_above_target():
    values = {**DOUBLING, "engine__kv_cache_usage_ratio": 0.9}
    assert _decide(**values) == []
    assert _decide(**DOUBLING) == [1024]


def test_remembers_pressure_seen_during_the_dwell():
    """A preemption inside the dwell after a change still bars doubling for kv_hold_s."""
    snapshot = make_snapshot(**{**DOUBLING, "engine__preemptions_per_second": 1.0})
    state, proposals = POLICY.decide(snapshot, [], BudgetState(512, changed_at=95.0), 100.0)
    assert proposals == [] and state is not None and state.pressed_at == 100.0
    _, later = POLICY.decide(make_snapshot(**DOUBLING), [], state, 140.0)
    assert later == []


def test_doubles_when_ttft_is_at_risk_and_itl_has_room():
    values = {**PREFILL, "engine__max_num_batched_tokens": 1024, "engine__ttft_seconds__p99": 9.0}
    assert _decide(engine__itl_seconds__p99=0.03, **values) == [2048]


def test_doubles_on_a_long_queue_wait_with_itl_room():
    values = {
        **PREFILL,
        "engine__max_num_batched_tokens": 1024,
        "engine__requests_waiting": 60,
        "engine__requests_finished_per_second": 10,
    }
    assert _decide(engine__itl_seconds__p99=0.03, **values) == [2048]


def test_holds_inside_the_hysteresis_band():
    """ITL between low and high: neither doubling (its stall would double) nor halving."""
    values = {**PREFILL, "engine__max_num_batched_tokens": 1024, "engine__ttft_seconds__p99": 9.0}
    assert _decide(engine__itl_seconds__p99=0.06, **values) == []


def test_holds_without_ttft_risk_even_with_itl_room():
    values = {**PREFILL, "engine__max_num_batched_tokens": 1024}
    assert _decide(engine__itl_seconds__p99=0.02, **values) == []


def test_waits_a_dwell_after_a_change():
    values = {"engine__itl_seconds__p99": 0.13, **PREFILL}
    assert _decide(BudgetState(2048, changed_at=95.0), now=100.0, **values) == []
    assert _decide(BudgetState(2048, changed_at=89.0), now=100.0, **values) == [1024]


def test_falls_back_to_its_state_when_the_budget_is_not_published():
    values = {k: v for k, v in PREFILL.items() if k != "engine__max_num_batched_tokens"}
    state, proposals = POLICY.decide(
        make_snapshot(engine__itl_seconds__p99=0.13, **values), [], BudgetState(4096), 50.0
    )
    assert [p.value for p in proposals] == [2048] and state == BudgetState(2048, 50.0)


def test_holds_without_engine_data():
    assert _decide(engine__itl_seconds__p99=0.13) == []


def test_rejects_bad_parameters():
    with pytest.raises(ValueError):
        TokenBudget(10.0, 0.1, lower=4096, initial=2048)
    with pytest.raises(ValueError):
        TokenBudget(10.0, 0.1, low=0.9)
    with pytest.raises(ValueError):
        TokenBudget(10.0, 0.1, kv_target=0.97)


def test_auto_set_includes_the_budget_only_when_the_engine_budget_is_known():
    without = build_set("auto", ttft_slo_s=10.0, itl_slo_s=0.1)
    with_budget = build_set("auto", ttft_slo_s=10.0, itl_slo_s=0.1, initial_token_budget=8192.0)
    assert "token_budget" not in [p.name for p in without]
    [budget] = [p for p in with_budget if isinstance(p, TokenBudget)]
    assert budget.initial == 8192.0 and budget.upper >= 8192.0


def test_arbiter_moves_the_budget_at_most_x2_and_cools_down():
    arbiter: Arbiter = default_arbiter()
    up = Proposal("token_budget", TOKEN_BUDGET, 16384, "test", 10)
    state, decisions = arbiter.decide([up], {TOKEN_BUDGET: 1024.0}, None, 0.0)
    assert [d.value for d in decisions] == [2048]
    _, again = arbiter.decide([up], {TOKEN_BUDGET: 2048.0}, state, 2.0)
    assert again == []  # within the 5 s cooldown
    low = Proposal("token_budget", TOKEN_BUDGET, 16, "test", 10)
    _, decisions = arbiter.decide([low], {TOKEN_BUDGET: 300.0}, None, 0.0)
    assert [d.value for d in decisions] == [256]


def test_a_queued_request_without_finishes_is_no_ttft_risk():
    """One long prompt queued in a tick where nothing finished is an arrival gap, not a stall."""
    values = {**PREFILL, "engine__max_num_batched_tokens": 1024, "engine__requests_waiting": 1}
    assert _decide(engine__itl_seconds__p99=0.01, engine__requests_finished_per_second=0, **values) == []


def test_with_the_energy_policy_the_token_budget_may_reach_its_floor_on_itl():
    """Its 1024 ITL floor assumes full clock; the energy policy lowers the clock."""
    plain = build_set("auto", ttft_slo_s=10.0, itl_slo_s=0.1, initial_token_budget=2048.0)
    energy = build_set(
        "auto", ttft_slo_s=10.0, itl_slo_s=0.1, initial_token_budget=2048.0, clock_levels_mhz=(1410.0, 700.0)
    )
    floors = [[p.itl_floor for p in s if p.name == "token_budget"] for s in (plain, energy)]
    assert floors == [[1024.0], [512.0]]
