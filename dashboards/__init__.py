"""Grafana dashboards and Prometheus rules for servepilot, generated from code (see docs/alerts.md)."""
