"""One frozen, typed, validated configuration object, built once at start-up.

Loaded from YAML, with overrides from an environment *passed in as a mapping* (never read from
``os.environ`` here): ``SERVEPILOT_AGENT__INTERVAL_S=2`` sets ``agent.interval_s``. Validation is
pydantic's; :class:`ConfigError` turns its first error into one line that names the field, the allowed
range and the value, e.g. ``agent.interval_s must be in [0.05, 60], got 0``.

One module per group of sections (:mod:`~agent.config.process`, :mod:`~agent.config.sources`,
:mod:`~agent.config.gate`, :mod:`~agent.config.actuation`, :mod:`~agent.config.decisions`), the whole in
:mod:`~agent.config.root`, reading it in :mod:`~agent.config.loading`; callers import from here.
"""

from agent.config.actuation import ActuatorConfig, AuditConfig, ControlConfig, WebhookConfig
from agent.config.decisions import CanaryConfig, CostConfig, ForecastConfig, PolicyConfig, priority_targets
from agent.config.gate import GateConfig, GateLineConfig, read_api_keys
from agent.config.loading import ENV_PREFIX, ConfigError, apply_env, build, load
from agent.config.process import MIN_ENGINE_RESTART_STALL_S, AgentConfig
from agent.config.reference import reference_markdown
from agent.config.root import Config
from agent.config.sources import EngineConfig, NvmlConfig, ProbeConfig

__all__ = [
    "ENV_PREFIX",
    "MIN_ENGINE_RESTART_STALL_S",
    "ActuatorConfig",
    "AgentConfig",
    "AuditConfig",
    "CanaryConfig",
    "Config",
    "ConfigError",
    "ControlConfig",
    "CostConfig",
    "EngineConfig",
    "ForecastConfig",
    "GateConfig",
    "GateLineConfig",
    "NvmlConfig",
    "PolicyConfig",
    "ProbeConfig",
    "WebhookConfig",
    "apply_env",
    "build",
    "load",
    "priority_targets",
    "read_api_keys",
    "reference_markdown",
]
