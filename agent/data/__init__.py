"""Data files bundled with the agent (see SOURCES.md)."""
