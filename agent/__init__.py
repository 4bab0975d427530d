"""The servepilot sidecar: process wiring, config, collectors, store, loop, HTTP API and CLI.

Kept import-light on purpose: the allocator probe (``agent.probe``) is loaded inside the engine process.
"""


def version() -> str:
    """The installed distribution's version (``unknown`` when run from a tree that is not installed)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("servepilot")
    except PackageNotFoundError:
        return "unknown"
