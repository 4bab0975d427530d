"""``servepilot demo --engine llamacpp|vllm``: the demo's engine slot filled by a real engine.

:class:`RealEngine` has the simulator wrapper's face in :mod:`agent.demo_runner` (``start(host, port)``,
``stop()``, ``model_name``, ``description``), so the demo runs unchanged around it; :func:`demo_config`
is the sidecar config for it (no GPU and no allocator probe on these CPU engines). The engines come
from ``scripts/engines.sh``; a missing one is a one-line error naming that command.
"""

from __future__ import annotations

import asyncio
from typing import Any

from agent.engines.launcher import ENGINES, SERVED_MODEL, EngineError, LaunchOptions, RunningEngine, start

#: Longest prompt and output the demo's trace sends: the tiny models have 2048 tokens per slot.
MAX_PROMPT_TOKENS = 1536
MAX_OUTPUT_TOKENS = 256
READY_TIMEOUT_S = {"llamacpp": 120.0, "vllm": 900.0}
#: The engines that rank their own queue by a request's priority, and the gate's preset for each: the
#: demo starts them so (vLLM with ``--scheduling-policy priority``, the simulator with its copy of that
#: policy), so the load's classes reach them.
ENGINE_PRIORITY = {"vllm": "vllm", "sim": "vllm"}


def launch_options(name: str, spec_tokens: int = 0) -> LaunchOptions:
    """How the demo starts engine ``name``: the launcher's defaults, with priority scheduling on where
    the engine has it (:data:`ENGINE_PRIORITY`), and vLLM drafting ``spec_tokens`` by n-gram lookup."""
    policy = "priority" if name in ENGINE_PRIORITY else "fcfs"
    return LaunchOptions(scheduling_policy=policy, speculative_ngram=spec_tokens if name == "vllm" else 0)


class RealEngine:
    """A real engine on ``127.0.0.1:<port>`` for the demo's lifetime."""

    def __init__(self, name: str, spec_tokens: int = 0) -> None:
        if name not in ENGINES:
            raise EngineError(f"--engine must be one of sim, {', '.join(ENGINES)}; got {name!r}")
        self.name = name
        self.spec_tokens = spec_tokens
        self.model_name = SERVED_MODEL
        self.description = f"{name} {ENGINES[name].version} (CPU, tiny random-weight model)"
        self._engine: RunningEngine | None = None

    async def start(self, host: str, port: int) -> None:
        """Start and wait for ``/health`` in a worker thread, so the event loop stays responsive."""
        if host != "127.0.0.1":
            raise EngineError("real engines have no API key and open CORS: they bind to 127.0.0.1 only")

        def launch() -> RunningEngine:
            engine = start(self.name, port=port, opts=launch_options(self.name, self.spec_tokens))
            engine.wait_ready(READY_TIMEOUT_S[self.name])
            return engine

        self._engine = await asyncio.get_running_loop().run_in_executor(None, launch)

    async def stop(self) -> None:
        if self._engine is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._engine.stop)
            self._engine = None


def demo_config(name: str, port: int, engine_port: int) -> dict[str, Any]:
    """The sidecar config for a real CPU engine: its metric table, no NVML, no probe."""
    return {
        "agent": {
            "interval_s": 1.0,
            "listen_host": "127.0.0.1",
            "listen_port": port,
            "admin_listen_port": None,
        },
        "engine": {"kind": ENGINES[name].metric_kind, "url": f"http://127.0.0.1:{engine_port}"},
        "nvml": {"backend": "off"},
        "probe": {"enabled": False},
        "forecast": {"enabled": True, "state_path": None},
    }
