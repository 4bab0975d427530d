"""Pure decision rules: batch sizing, circuit breaker, precision canary, energy, admission, arbiter.

A policy is ``decide(observation, state, now) -> (state, proposal)``; it never reads the clock and never
touches an engine. The agent turns accepted proposals into actions.
"""
