"""The engine control client: capability discovery and one adapter per engine API flavour.

:class:`~agent.control.client.ControlClient` is what the agent calls; adapters (generic control API,
SGLang ``/set_internal_state``, vLLM runtime endpoints) translate absolute knob values to each API.
"""
