"""A calibrated LLM inference-engine simulator: the engine servepilot is developed and demonstrated against.

It models continuous batching, a paged KV cache and a roofline step time on real GPU profiles, and serves
the same faces a real vLLM pod has (OpenAI API with SSE, ``/metrics`` with vLLM's names, a control API,
simulated NVML and allocator-probe readings).
"""
