"""The figures the simulator is calibrated to reproduce (docs/simulator.md has the table)."""

from __future__ import annotations

from simulator import workload
from simulator.engine import EngineCore, make_core
from simulator.hardware import gpu_profile
from simulator.models import model_profile


def mean_itl(core: EngineCore) -> float:
    return core.stats.itl.sum / core.stats.itl.count


def decode_itl(batch: int, prompt: int = 128, output: int = 256) -> float:
    core = make_core("a100-80g", "llama-2-7b", "fp16", 256)
    workload.closed_batch(core, batch, prompt, output)
    return mean_itl(core)


def test_single_stream_itl_is_10_to_30_percent_above_the_bandwidth_bound() -> None:
    gpu, model = gpu_profile("a100-80g"), model_profile("llama-2-7b")
    bound = model.weight_bytes("fp16") / gpu.bandwidth_bps  # 13.5 GB / 2.04 TB/s = 6.6 ms
    ratio = decode_itl(1) / bound
    assert 1.10 <= ratio <= 1.30, ratio


def test_throughput_rises_with_batch_and_saturates() -> None:
    throughput = {}
    for batch in (1, 8, 64, 256, 512):
        core = make_core("a100-80g", "llama-2-7b", "fp16", 512)
        throughput[batch] = workload.closed_batch(core, batch, 128, 256).throughput_tps
    assert throughput[1] < throughput[8] < throughput[64] < throughput[256]
    assert throughput[8] / throughput[1] > 5  # nearly linear while memory-bound
    assert throughput[512] / throughput[256] < 1.25  # saturated: compute-bound and KV-bound


def test_itl_grows_10_to_20_percent_from_16_to_32_sequences() -> None:
    growth = decode_itl(32) / decode_itl(16) - 1
    assert 0.10 <= growth <= 0.20, growth


def test_fp8_serves_about_1_6x_the_fp16_throughput_on_h100() -> None:
    fp16 = workload.closed_batch(make_core("h100-sxm", "llama-3-8b", "fp16", 256), 512, 512, 256)
    fp8 = workload.closed_batch(make_core("h100-sxm", "llama-3-8b", "fp8", 256), 512, 512, 256)
    ratio = fp8.throughput_tps / fp16.throughput_tps
    assert 1.45 <= ratio <= 1.8, ratio


def test_energy_per_token_is_u_shaped_over_the_sm_clock() -> None:
    energy = {}
    for clock in (300, 600, 800, 1000, 1410):
        core = make_core("a100-80g", "llama-2-7b", "fp16", 64, sm_clock_mhz=clock)
        energy[clock] = workload.closed_batch(core, 32, 256, 256).energy_per_token_j
    best = min(energy, key=energy.__getitem__)
    assert best not in (300, 1410)
    assert energy[300] > 1.3 * energy[best]
    assert energy[1410] > 1.2 * energy[best]


def test_preemption_happens_when_the_kv_cache_is_full() -> None:
    core = make_core("a100-80g", "llama-2-7b", "fp16", 256, gpu_memory_utilization=0.25)
    needed_blocks = 64 * (400 + 400) // 16
    assert core.budget.num_blocks < needed_blocks
    summary = workload.closed_batch(core, 64, 400, 400)
    assert core.stats.preemptions > 0
    assert summary.generated_tokens == 64 * 400  # preempted requests are recomputed, nothing is lost


def test_no_preemption_when_the_cache_is_large_enough() -> None:
    core = make_core("a100-80g", "llama-2-7b", "fp16", 256)
    workload.closed_batch(core, 64, 400, 400)
    assert core.stats.preemptions == 0
