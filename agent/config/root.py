"""The whole configuration: one section per concern, and the rules that span sections."""

from __future__ import annotations

from pydantic import model_validator

from agent.config.actuation import ActuatorConfig, AuditConfig, ControlConfig, WebhookConfig
from agent.config.base import Section
from agent.config.decisions import CanaryConfig, CostConfig, DetectorsConfig, ForecastConfig, PolicyConfig
from agent.config.gate import GateConfig
from agent.config.process import AgentConfig
from agent.config.sources import EngineConfig, NvmlConfig, ProbeConfig


class Config(Section):
    """The whole configuration. Every field has a default that is safe on a GPU node."""

    agent: AgentConfig = AgentConfig()
    engine: EngineConfig = EngineConfig()
    nvml: NvmlConfig = NvmlConfig()
    probe: ProbeConfig = ProbeConfig()
    gate: GateConfig = GateConfig()
    control: ControlConfig = ControlConfig()
    actuators: ActuatorConfig = ActuatorConfig()
    audit: AuditConfig = AuditConfig()
    webhooks: WebhookConfig = WebhookConfig()
    forecast: ForecastConfig = ForecastConfig()
    cost: CostConfig = CostConfig()
    policies: PolicyConfig = PolicyConfig()
    canary: CanaryConfig = CanaryConfig()
    detectors: DetectorsConfig = DetectorsConfig()

    @model_validator(mode="after")
    def _energy_wiring(self) -> Config:
        if self.policies.energy and self.actuators.gpu == "off" and not self.control.enabled:
            raise ValueError(
                "policies.energy needs actuators.gpu (locked_clocks or power_limit) to drive, or"
                " control.enabled with an engine control API that offers sm_clock_mhz"
            )
        if self.policies.schedule is not None and not self.policies.energy:
            raise ValueError(
                "policies.schedule needs policies.energy (its peak windows hold the energy ladder at full"
                " clock; nothing else reads it)"
            )
        return self

    @model_validator(mode="after")
    def _sleep_wiring(self) -> Config:
        if not self.policies.sleep:
            return self
        if not self.forecast.enabled:
            raise ValueError("policies.sleep needs forecast.enabled (it sleeps only on a low forecast)")
        if not self.control.enabled:
            raise ValueError(
                "policies.sleep needs control.enabled (sleep and wake go through the engine's API)"
            )
        if self.policies.set == "none":
            raise ValueError("policies.sleep needs a policy set (policies.set auto or seed)")
        return self

    @model_validator(mode="after")
    def _canary_wiring(self) -> Config:
        canary = self.canary
        if not canary.enabled:
            return self
        if not self.gate.enabled:
            raise ValueError("canary.enabled needs gate.enabled (the gate's split carries the fp8 share)")
        if canary.validation_file is None:
            raise ValueError("canary.validation_file is required when the canary is enabled")
        known = ", ".join(self.gate.upstreams)
        for field in ("primary", "candidate"):
            name = getattr(canary, field)
            if name not in self.gate.upstreams:
                raise ValueError(f"canary.{field} {name!r} is not one of gate.upstreams ({known})")
        if canary.primary == canary.candidate:
            raise ValueError("canary.candidate must differ from canary.primary")
        return self
