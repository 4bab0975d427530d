"""Prometheus exposition of the simulated engine (vLLM V1 names) and the simulated allocator probe.

Both are custom collectors on their OWN :class:`CollectorRegistry`: they read the core's plain counters at
scrape time, so the hot loop never touches prometheus_client and several simulators can live in one
process (tests) without colliding in the global registry.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from simulator.engine import EngineCore
from simulator.specdec import SpecDecoder
from simulator.stats import Histogram
from simulator.telemetry import memory_state

TORCH_VERSION = "2.13.0+cu126"


class VllmCollector(Collector):
    """``vllm:*`` families with ``model_name`` and ``engine="0"`` labels, as vLLM V1 serves them."""

    def __init__(self, core: EngineCore, model_name: str, started_at: float | None = None) -> None:
        self.core = core
        self.labels = {"model_name": model_name, "engine": "0"}
        #: the engine process's start time (now when not given), as prometheus_client's process collector
        #: serves it beside vLLM's families (``process_start_time_seconds``, unix seconds): a restart moves it
        self.started_at = time.time() if started_at is None else started_at

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), value)
        return family

    def _counters_by(
        self, name: str, doc: str, label: str, counts: Iterable[tuple[str, float]]
    ) -> CounterMetricFamily:
        """One counter per value of ``label``, beside the engine's labels."""
        family = CounterMetricFamily(name, doc, labels=[*self.labels, label])
        for value, count in counts:
            family.add_metric([*self.labels.values(), value], count)
        return family

    def _histogram(self, name: str, doc: str, hist: Histogram) -> HistogramMetricFamily:
        family = HistogramMetricFamily(name, doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), hist.cumulative(), hist.sum)
        return family

    def collect(self) -> Iterator[Metric]:
        core, stats = self.core, self.core.stats
        yield GaugeMetricFamily(
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds.",
            self.started_at,
        )
        yield self._gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", core.num_running
        )
        yield self._gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", core.num_waiting
        )
        yield self._gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", core.kv_usage
        )
        yield self._counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            stats.prefix_cache_queries,
        )
        yield self._counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            stats.prefix_cache_hits,
        )
        yield self._counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.", stats.preemptions
        )
        yield self._counter("vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens)
        yield self._counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", stats.generation_tokens
        )
        yield self._counters_by(
            "vllm:request_success",
            "Count of successfully processed requests.",
            "finished_reason",
            stats.request_success.items(),
        )
        if core.spec is not None:
            yield from self._spec(core.spec)
        for name, doc, hist in (
            (
                "vllm:request_prompt_tokens",
                "Number of prefill tokens processed.",
                stats.request_prompt_tokens,
            ),
            (
                "vllm:request_generation_tokens",
                "Number of generation tokens processed.",
                stats.request_generation_tokens,
            ),
            (
                "vllm:iteration_tokens_total",
                "Histogram of number of tokens per engine_step.",
                stats.iteration_tokens,
            ),
            (
                "vllm:request_params_max_tokens",
                "Histogram of the max_tokens request parameter.",
                stats.request_max_tokens,
            ),
            ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", stats.ttft),
            ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", stats.itl),
            (
                "vllm:request_time_per_output_token_seconds",
                "Histogram of time_per_output_token_seconds per request.",
                stats.tpot,
            ),
            ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", stats.e2e),
            (
                "vllm:request_queue_time_seconds",
                "Histogram of time spent in WAITING phase for request.",
                stats.queue,
            ),
            (
                "vllm:request_inference_time_seconds",
                "Histogram of time spent in RUNNING phase for request.",
                stats.inference,
            ),
            (
                "vllm:request_prefill_time_seconds",
                "Histogram of time spent in PREFILL phase for request.",
                stats.prefill,
            ),
            (
                "vllm:request_decode_time_seconds",
                "Histogram of time spent in DECODE phase for request.",
                stats.decode,
            ),
            (
                "vllm:request_num_preemptions",
                "Histogram of the number of times a request was preempted.",
                stats.request_preemptions,
            ),
        ):
            yield self._histogram(name, doc, hist)
        yield self._cache_config()

    def _spec(self, spec: SpecDecoder) -> Iterator[Metric]:
        """vLLM V1's speculative-decoding counters (served only when the engine drafts)."""
        yield self._counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", spec.drafts)
        yield self._counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", spec.draft_tokens)
        yield self._counter(
            "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", spec.accepted
        )
        yield self._counters_by(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            "position",
            ((str(position), count) for position, count in enumerate(spec.accepted_per_position)),
        )

    def _cache_config(self) -> GaugeMetricFamily:
        core = self.core
        info = {
            "block_size": str(core.block_size),
            "cache_dtype": "fp8_e4m3" if core.settings.precision == "fp8" else "auto",
            "enable_prefix_caching": "False",
            "engine": "0",
            "gpu_memory_utilization": str(core.gpu_memory_utilization),
            "kv_cache_memory_bytes": str(int(core.budget.kv_pool_bytes)),
            "kv_cache_size_tokens": str(core.budget.num_blocks * core.block_size),
            "num_gpu_blocks": str(core.budget.num_blocks),
        }
        family = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(info)
        )
        family.add_metric(list(info.values()), 1.0)
        return family


class ProbeCollector(Collector):
    """``servepilot_probe_*``: the families the real in-engine allocator probe serves."""

    def __init__(
        self, core: EngineCore, now: Callable[[], float], pid: int, uuids: Sequence[str] = ()
    ) -> None:
        self.core = core
        self.now = now
        self.pid = pid
        #: the engine's GPUs by UUID, CUDA device order (one probe stands for every rank, as its stats do)
        self.uuids = list(uuids)
        self.peak_reserved = 0.0
        self.alloc_retries = 0
        self.ooms = 0
        self._was_full = False

    def collect(self) -> Iterator[Metric]:
        mem = memory_state(self.core, self.now())
        self.peak_reserved = max(self.peak_reserved, mem.reserved)
        full = mem.process >= mem.total
        if full:
            self.alloc_retries += 1  # the caching allocator frees its cache and retries cudaMalloc
            if not self._was_full:
                self.ooms += 1
        self._was_full = full
        yield GaugeMetricFamily("servepilot_probe_up", "1 when the probe runs inside the engine.", value=1)
        yield GaugeMetricFamily("servepilot_probe_cuda_available", "1 when CUDA is available.", value=1)
        for name, doc, value in (
            ("allocated_bytes", "Bytes held by live tensors.", mem.allocated),
            ("reserved_bytes", "Bytes the caching allocator holds from the driver.", mem.reserved),
            ("active_bytes", "Bytes in active allocator blocks.", mem.active),
            ("inactive_split_bytes", "Bytes in inactive, split blocks (fragmentation).", mem.inactive_split),
            ("peak_allocated_bytes", "Peak of allocated bytes.", mem.peak_allocated),
            ("peak_reserved_bytes", "Peak of reserved bytes.", self.peak_reserved),
            ("fragmentation_ratio", "1 - allocated / reserved.", mem.fragmentation_ratio),
        ):
            family = GaugeMetricFamily(f"servepilot_probe_{name}", doc, labels=["device"])
            family.add_metric(["0"], value)
            yield family
        for name, doc, count in (
            ("alloc_retries", "cudaMalloc retries after freeing the allocator cache.", self.alloc_retries),
            ("ooms", "Out-of-memory errors raised by the allocator.", self.ooms),
        ):
            counter = CounterMetricFamily(f"servepilot_probe_{name}", doc, labels=["device"])
            counter.add_metric(["0"], count)
            yield counter
        info = GaugeMetricFamily(
            "servepilot_probe_info", "Probe process information.", labels=["pid", "torch_version"]
        )
        info.add_metric([str(self.pid), TORCH_VERSION], 1)
        yield info
        devices = GaugeMetricFamily(
            "servepilot_probe_device_info",
            "Which GPU (UUID, as NVML names it) each CUDA device is.",
            labels=["device", "uuid"],
        )
        for device, uuid in enumerate(self.uuids):
            devices.add_metric([str(device), uuid], 1)
        yield devices


def registry_with(collector: Collector) -> CollectorRegistry:
    """A fresh registry holding only ``collector``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
