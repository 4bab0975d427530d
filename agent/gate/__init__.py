"""The admission gate: servepilot's own knobs in front of any OpenAI-compatible engine (DESIGN.md s. 2).

Pure core: :mod:`~agent.gate.admission` (in-flight limit, priority queue), :mod:`~agent.gate.ratelimit`
(token buckets per business line), :mod:`~agent.gate.upstreams` (split and failover),
:mod:`~agent.gate.records` (histograms and signals). Thin I/O shell: :mod:`~agent.gate.proxy`.
"""
