"""Knob wiring: the gate, the engine control client and the GPU actuator bound to one :class:`Actuation`.

Built from the config; each part exists only when configured (the gate when ``gate.enabled``, engine
control when ``control.enabled``, the GPU knob when ``actuators.gpu`` is not ``off``). Knob names:

* ``batch.max_in_flight`` — the effective batch (the gate's in-flight limit; without a gate, the engine's
  ``max_num_seqs`` where its control API sets it);
* ``gate.max_queue_wait_s`` — the gate's queue deadline (503 after it);
* ``route.upstream`` — route all traffic to one named upstream (breaker levels L2/L3);
* ``route.fp8_share`` — the precision canary's share of traffic on ``canary.candidate`` (the rest goes to
  ``canary.primary``; other upstreams get none while the canary drives the split);
* ``engine.<knob>`` — whatever the engine's control API offers (e.g. ``engine.max_num_seqs``);
* ``gpu.power_limit_w`` or ``gpu.sm_clock_mhz`` — the GPU actuator's knob.

The names are the policies' (:mod:`policies.knobs`), so a proposal reaches its actuator by name.

Every write goes through :meth:`Actuation.execute` (mode, pause, pins, audit), never around it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

from agent.audit import Action, AuditLog
from agent.collectors.base import Collector
from agent.config import Config, ConfigError, priority_targets
from agent.control.base import ControlError, KnobSpec
from agent.modes import Actuation, Mode
from policies import knobs

log = logging.getLogger(__name__)


#: The generic control API's SM clock knob (published by the simulator; DESIGN.md section 4).
ENGINE_CLOCK = "sm_clock_mhz"


def _checked(spec: KnobSpec, value: Any) -> str | None:
    """Why the engine would refuse ``value`` for the knob ``spec`` describes (None when it would not)."""
    return spec.check(spec.coerce(value))


#: The gate's own knobs: in this process, so a restart starts them at the configuration
#: (:meth:`Knobs.restore_gate`).
GATE_KNOBS = (knobs.BATCH, knobs.QUEUE_WAIT, knobs.UPSTREAM, knobs.FP8_SHARE)


class Knobs:
    """Owns the actuators' lifetimes; ``values()`` reports what each knob is set to now."""

    def __init__(self, cfg: Config, registry: CollectorRegistry) -> None:
        self.cfg = cfg
        self.audit = AuditLog(cfg.audit, registry)
        self.actuation = Actuation(cfg.actuators.mode, self.audit)
        # read at scrape time: a config reload changes the mode, the admin API pauses (fleet view: which
        # pods act, which only advise)
        mode = Gauge(
            "servepilot_actuation_mode",
            "1 for the actuation mode in force (observe, advise, act), 0 for the others.",
            ["mode"],
            registry=registry,
        )
        for name in Mode:
            mode.labels(name.value).set_function(functools.partial(self._mode_is, name))
        Gauge(
            "servepilot_actuation_paused",
            "1 while an operator has paused actuation (admin API).",
            registry=registry,
        ).set_function(lambda: float(self.actuation.paused))
        self.gate: Any = None
        self.control: Any = None
        #: Why :meth:`start` found no engine control API (None: found, or ``control.enabled`` is off).
        self.control_error: ControlError | None = None
        #: 1 once the engine's control API is found and its knobs are bound; 0 while it is not (absent when
        #: ``control.enabled`` is off). The ServepilotEngineControlUnavailable alert watches it.
        self._control_up: Gauge | None = None
        if cfg.control.enabled:
            self._control_up = Gauge(
                "servepilot_engine_control_up",
                "1 when the engine's control API was found and its knobs are bound (control.enabled).",
                registry=registry,
            )
        self._engine_values: dict[str, Any] = {}
        #: engine knobs that also carry a policy knob's name (no gate: batch = max_num_seqs; no GPU
        #: actuator: the energy clock = sm_clock_mhz)
        self._engine_aliases: dict[str, str] = {}
        self.gpu: Any = None
        self.gpu_knob = ""
        self.collectors: list[Collector] = []
        if cfg.gate.enabled:
            from agent.gate.collector import GateCollector
            from agent.gate.proxy import Gate

            self.gate = Gate(cfg.gate, registry)
            p = cfg.policies
            self.gate.set_slo(p.ttft_slo_s, p.itl_slo_s, priority_targets(p))
            self.collectors.append(GateCollector(self.gate))
            self.actuation.bind(knobs.BATCH, self._gate_limit, self._set_gate_limit)
            self.actuation.bind(
                knobs.UPSTREAM, self._gate_upstream, self._set_gate_upstream, self._check_upstream
            )
            self.actuation.bind(knobs.QUEUE_WAIT, self._gate_queue_wait, self._set_gate_queue_wait)
            if cfg.canary.enabled:
                self.actuation.bind(knobs.FP8_SHARE, self._fp8_share, self._set_fp8_share, _share_check)
        if cfg.actuators.gpu != "off":
            from agent.actuators.gpu import GpuActuator, backend_for

            self.gpu = GpuActuator(
                cfg.actuators, backend_for(cfg.actuators), registry, follow_engine=cfg.probe.enabled
            )
            self.gpu_knob = knobs.GPU_KNOB[cfg.actuators.gpu]
            self.actuation.bind(
                self.gpu_knob,
                self._gpu_value,
                self._set_gpu_value,
                self._check_gpu_value,
                waiting=lambda: self.gpu.waiting,
            )
        self.token = self._admin_token()
        if cfg.control.enabled and cfg.control.token_file:
            from agent.admin import load_token

            try:
                load_token(cfg.control.token_file)  # a bad file is a config error at start, not later
            except ValueError as error:
                raise ConfigError("control.token_file", str(error)) from None

    def _admin_token(self) -> str | None:
        path = self.cfg.actuators.admin_token_file
        if not path:
            return None
        from agent.admin import load_token

        try:
            return load_token(path)
        except ValueError as error:
            raise ConfigError("actuators.admin_token_file", str(error)) from None

    # -- knob bindings ---------------------------------------------------------------------------
    async def _gate_limit(self) -> Any:
        return self.gate.limit

    async def _set_gate_limit(self, value: Any) -> Any:
        self.gate.set_limit(int(value))
        return self.gate.limit

    async def _gate_queue_wait(self) -> Any:
        return self.gate.max_queue_wait_s

    async def _set_gate_queue_wait(self, value: Any) -> Any:
        self.gate.set_max_queue_wait(float(value))
        return self.gate.max_queue_wait_s

    def _route_now(self) -> str | None:
        """``route.upstream`` as it stands: the upstream that takes all traffic; ``default`` while the gate
        runs its configured split over several; None while a canary or an operator splits it otherwise."""
        weights = self.gate.pool.weights
        carrying = [name for name, weight in weights.items() if weight > 0]
        if len(carrying) == 1:
            return str(carrying[0])
        total = sum(self.cfg.gate.split.values())
        configured = {name: self.cfg.gate.split.get(name, 0.0) / total for name in weights}
        if all(abs(weights[name] - configured[name]) < 1e-9 for name in weights):
            return knobs.DEFAULT_ROUTE
        return None

    async def _gate_upstream(self) -> Any:
        return self._route_now()

    def _check_upstream(self, value: Any) -> str | None:
        names = [*self.cfg.gate.upstreams, knobs.DEFAULT_ROUTE]
        if value in names:
            return None
        return f"{knobs.UPSTREAM} must be one of {names}, got {value!r}"

    async def _set_gate_upstream(self, value: Any) -> Any:
        if value == knobs.DEFAULT_ROUTE:
            self.gate.set_split(self.cfg.gate.split)
        else:
            self.gate.set_split({str(value): 1.0})
        return self._route_now()

    def _fp8_share_now(self) -> float:
        return round(float(self.gate.pool.weights.get(self.cfg.canary.candidate, 0.0)), 6)

    async def _fp8_share(self) -> Any:
        return self._fp8_share_now()

    async def _set_fp8_share(self, value: Any) -> Any:
        share = min(1.0, max(0.0, float(value)))
        canary = self.cfg.canary
        self.gate.set_split({canary.primary: 1.0 - share, canary.candidate: share})
        return self._fp8_share_now()

    async def _gpu_value(self) -> Any:
        return self.gpu.current()

    async def _set_gpu_value(self, value: Any) -> Any:
        return self.gpu.set(float(value))

    def _check_gpu_value(self, value: Any) -> str | None:
        if self.gpu.problem:  # not ``waiting``: a pin made before the probe names the GPUs is held till then
            return f"{self.gpu_knob}: {self.gpu.problem}"
        return knobs.out_of_range(self.gpu_knob, value, *self.gpu.bounds())

    def _bind_engine_knobs(self) -> None:
        caps = self.control.capabilities
        # what the engine runs with, as last read or written: the arbiter needs the value in force to bound
        # each step and keep cooldowns (without it, every engine knob moved unbounded and unhurried)
        self._engine_values = dict(self.control.initial)
        for name in caps.knobs:

            async def read(name: str = name) -> Any:
                value = (await self.control.read()).get(name)
                self._engine_values[name] = value
                return value

            async def write(value: Any, name: str = name) -> Any:
                result = await self.control.apply({name: value})  # the client puts it in the knob's type
                self._engine_values.update(result.read_back)
                return result.read_back.get(name, value)

            spec = caps.knobs[name]
            self.actuation.bind(f"engine.{name}", read, write, functools.partial(_checked, spec))
        if self.gpu is None and ENGINE_CLOCK in caps.knobs:
            # no GPU actuator of the agent's own (actuators.gpu: off): an engine whose control API manages
            # its GPU's clock (the simulator's does) carries the energy ladder's knob, under its lease
            self.actuation.alias(knobs.SM_CLOCK, f"engine.{ENGINE_CLOCK}")
            self._engine_aliases[ENGINE_CLOCK] = knobs.SM_CLOCK
        if self.gate is None and "max_num_seqs" in caps.knobs:
            # no gate in front: the effective batch is the engine's own cap, where its control API sets it
            # (the simulator's does; so does the replay), under the same lease as every engine setting
            self.actuation.alias(knobs.BATCH, "engine.max_num_seqs")
            self._engine_aliases["max_num_seqs"] = knobs.BATCH

    # -- lifetime --------------------------------------------------------------------------------
    async def start(self) -> None:
        if self.gate is not None:
            port = await self.gate.start()
            log.info("admission gate on %s:%d", self.cfg.gate.listen_host, port)
        if self.cfg.control.enabled:
            self.control_error = await self.discover_control()

    async def discover_control(self) -> ControlError | None:
        """One attempt to find the engine's control API and bind its knobs; the error when none was found
        (``temporary``: the engine could not be asked, e.g. still loading its weights; try again later)."""
        from agent.control.client import ControlClient
        from agent.tls import engine_context

        client = ControlClient(self.cfg.control, tls=engine_context(self.cfg.engine))
        try:
            await client.start()
        except ControlError as error:  # observation goes on; the sidecar tries again while it is temporary
            await client.close()
            return error
        except BaseException:  # cancelled at stop while asking
            await client.close()
            raise
        self.control = client
        self._bind_engine_knobs()
        if self._control_up is not None:
            self._control_up.set(1.0)
        return None

    def gate_state(self) -> dict[str, Any] | None:
        """The gate's knobs as they stand, with the settings they started from, for ``agent.state_path``
        (:meth:`restore_gate`); None without a gate."""
        if self.gate is None:
            return None
        values = self.values()
        return {
            "knobs": {knob: values[knob] for knob in GATE_KNOBS if knob in values},
            "configured": self._gate_configured(),
        }

    def _gate_configured(self) -> dict[str, Any]:
        """The settings the gate's knobs start from, and the bounds the policies hold them to."""
        gate, policies = self.cfg.gate, self.cfg.policies
        return {
            "max_in_flight": gate.max_in_flight,
            "max_queue_wait_s": gate.max_queue_wait_s,
            "split": dict(gate.split),
            "upstreams": sorted(gate.upstreams),
            "batch_bounds": [policies.batch_min, policies.batch_max],
        }

    async def restore_gate(self, saved: Mapping[str, Any], now: float) -> list[str]:
        """Set the gate's knobs to where they stood before a restart (act mode only), each one audited.

        The gate lives in this process, so a restart started it at its configured limit: beside a llama.cpp
        whose 4 slots had brought the limit to 8, a restart with actuation paused by the operator opened it
        to 64, and nothing moved it back while paused. Not when the gate's settings or the batch bounds
        differ from those saved (a restart to change them must get them), nor outside act mode (the knobs
        are the configuration's there)."""
        if self.gate is None or self.actuation.mode is not Mode.ACT or not isinstance(saved, Mapping):
            return []
        if saved.get("configured") != self._gate_configured():
            log.info(
                "the gate's knobs start from the configuration: its gate settings changed since the save"
            )
            return []
        restored: list[str] = []
        for knob, value in dict(saved.get("knobs") or {}).items():
            if knob not in GATE_KNOBS or knob not in self.actuation.knobs:
                continue
            read, write = self.actuation.binding(knob)
            try:
                current = await read()
                if current == value or self.actuation.check(knob, value) is not None:
                    continue
                applied = await write(value)
            except Exception as error:  # a value the knob no longer takes: it starts from the configuration
                log.warning("the gate's %s not restored to %r: %s", knob, value, error)
                continue
            why = "restored to where it stood before the sidecar restarted (agent.state_path)"
            self.audit.record(Action(now, knob, current, applied, why, "restore", Mode.ACT.value, "ok"))
            restored.append(f"{knob}={applied!r}")
        if restored:
            log.info("restored the gate's knobs: %s", ", ".join(restored))
        return restored

    def renew(self) -> None:
        """Called every tick: keeps the GPU setting's lease alive while the agent is healthy. A control
        lease that lapsed put the engine back on defaults the agent has not read: its values are dropped
        until the next read or write."""
        if self.gpu is not None:
            self.gpu.renew()
        if self.control is not None and self.control.lapsed:
            self.control.lapsed = False
            self._engine_values.clear()

    async def hand_back(self) -> list[str]:
        """Put back what servepilot set, as a restart would (the sidecar left act mode): the GPU's default
        power limit or clocks, the engine's own settings (its lease ended, or the values found at start),
        and the gate's in-flight limit, queue deadline and split from the config. What it handed back,
        for the log."""
        done: list[str] = []
        if self.gpu is not None and self.gpu.restore():
            done.append(f"{self.gpu_knob} to the GPU's default")
        if self.control is not None and await self.control.hand_back():
            self._engine_values.clear()  # the engine's values are its defaults now: read them again
            done.append("the engine's knobs to its defaults")
        if self.gate is not None:
            gate = self.cfg.gate
            self.gate.set_limit(gate.max_in_flight)
            self.gate.set_max_queue_wait(gate.max_queue_wait_s)
            self.gate.set_split(gate.split)
            done.append(
                f"the gate to its configured limit {gate.max_in_flight}, queue deadline "
                f"{gate.max_queue_wait_s:g} s and split"
            )
        return done

    def _mode_is(self, mode: Mode) -> float:
        """1.0 while ``mode`` is the actuation mode in force (``servepilot_actuation_mode``)."""
        return float(self.actuation.mode is mode)

    def values(self) -> dict[str, float | str]:
        out: dict[str, float | str] = {}
        if self.gate is not None:
            out[knobs.BATCH] = float(self.gate.limit)
            out[knobs.QUEUE_WAIT] = float(self.gate.max_queue_wait_s)
            route = self._route_now()
            if route is not None:
                out[knobs.UPSTREAM] = route
            if self.cfg.canary.enabled:
                out[knobs.FP8_SHARE] = self._fp8_share_now()
        if self.gpu is not None:
            current = self.gpu.current()
            if current is not None:
                out[self.gpu_knob] = float(current)
        for name, value in self._engine_values.items():
            if isinstance(value, bool) or not isinstance(value, int | float | str):
                continue  # booleans (sleeping, paused) are level knobs: compared on read, not stepped
            out[f"engine.{name}"] = float(value) if isinstance(value, int | float) else value
            alias = self._engine_aliases.get(name)
            if alias is not None:
                out[alias] = out[f"engine.{name}"]
        return out

    def derived(self, values: Mapping[str, float], now: float) -> dict[str, float]:
        """Signals the tick gets from the knobs (a loop deriver): without a gate, the effective batch in
        force, the engine's ``max_num_seqs``, as ``gate.limit``, as ``servepilot replay`` publishes it.
        The policies size their moves from it: without it the breaker's first cut assumed a limit of 32
        and took a 256-sequence engine to 16."""
        if self.gate is not None:
            return {}  # the gate's collector publishes its own limit
        batch = self.values().get(knobs.BATCH)
        return {} if batch is None else {knobs.GATE_LIMIT: float(batch)}

    async def stop(self) -> None:
        """Restore safe defaults: GPU settings back, engine lease released, gate drained."""
        if self.gpu is not None:
            with contextlib.suppress(Exception):
                self.gpu.close()
        if self.control is not None:
            with contextlib.suppress(Exception):
                await self.control.close()
        if self.gate is not None:
            with contextlib.suppress(Exception):
                await self.gate.stop()
        with contextlib.suppress(Exception):
            self.audit.close()


def _share_check(value: Any) -> str | None:
    return knobs.out_of_range(knobs.FP8_SHARE, value, 0.0, 1.0)
