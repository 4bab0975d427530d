"""The servepilot sidecar: process wiring, config, collectors, store, loop, HTTP API and CLI.

Kept import-light on purpose: the allocator probe (``agent.probe``) is loaded inside the engine process.
"""
