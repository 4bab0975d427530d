"""Tests of agent.engines."""
