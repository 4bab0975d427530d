"""Process wiring: config -> collectors, store, loop, exporter and HTTP API, with a clean shutdown.

Used by ``servepilot run`` and, in-process beside the simulator, by ``servepilot demo``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, Any

from aiohttp import web

from agent import eventloop
from agent.api import build_app
from agent.assembly import (
    breaker_levels,
    build_collectors,
    build_detectors,
    build_policies,
    set_detector_slo,
    warm_imports,
)
from agent.audit import Action
from agent.collectors.base import Collector
from agent.collectors.nvml import NvmlCollector
from agent.config import ActuatorConfig, Config, ConfigError, PolicyConfig, priority_targets
from agent.engine_gpus import EngineGpus, Follower
from agent.exporter import Exporter
from agent.gate.upstreams import engine_upstream
from agent.itl_steering import AUDIT_KNOB, ItlTarget, steered_itl, steering_warnings
from agent.knobs import Knobs
from agent.loop import Loop
from agent.modes import Mode
from agent.server_name import without_versions
from agent.stop_signals import ignore_hangup_until_exit, ignore_hangup_while_stopping
from agent.store import Store
from agent.tls import TlsFilesCollector, WatchedTls, server_tls
from agent.tls import watch as watch_tls
from detectors.base import Finding
from detectors.snapshot import Snapshot
from policies.base import Policy, Proposal

if TYPE_CHECKING:
    from agent.canary_live import LiveCanary
    from agent.forecasting import LiveForecaster
    from agent.reload import Reloader, ReloadResult
    from agent.state import AgentState
    from agent.webhooks import WebhookDispatcher

log = logging.getLogger(__name__)


#: Longest wait between two attempts to find an engine's control API that did not answer yet.
CONTROL_RETRY_MAX_S = 30.0


def _without_pinned_partners(proposals: Sequence[Proposal], pins: Mapping[str, Any]) -> list[Proposal]:
    """``proposals`` less those for a knob linked to a pinned one (``policies.knobs.LINKED``): a pin on
    ``route.upstream`` must hold against a canary's ``route.fp8_share``, which sets the same split."""
    from policies.knobs import LINKED

    held = {knob for group in LINKED if group & set(pins) for knob in group} - set(pins)
    return [p for p in proposals if p.knob not in held]


class Sidecar:
    """The running agent: owns the loop task and the HTTP site."""

    def __init__(
        self,
        cfg: Config,
        *,
        collectors: Sequence[Collector] | None = None,
        config_path: str | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        """``config_path`` (and the ``environ`` its overrides came from): the file a reload re-reads
        (agent/reload.py); without it there is no reload."""
        self.cfg = cfg
        self.collectors = list(collectors) if collectors is not None else build_collectors(cfg)
        self.store = Store(cfg.agent.history_points, cfg.agent.max_series)
        self.exporter = Exporter(slo=_slo(cfg.policies))
        self.knobs = Knobs(cfg, self.exporter.registry)
        self.collectors.extend(self.knobs.collectors)
        #: the gate upstream that is this engine (engine.url and the upstreams need a restart to change)
        self._engine_upstream = engine_upstream(cfg)
        if self.knobs.gate is not None:
            self.knobs.gate.mark_engine(self._engine_upstream)
        if cfg.gate.enabled and cfg.gate.eject_stalled_s > 0 and self._engine_upstream is None:
            log.warning(
                "no gate upstream has engine.url (%s): the engine_stall finding cannot take this engine out "
                "of the split; give its upstream the same URL (docs/gate.md)",
                cfg.engine.url,
            )
        self.forecaster: LiveForecaster | None = None
        if cfg.forecast.enabled:
            from agent.forecasting import LiveForecaster

            self.forecaster = LiveForecaster(cfg.forecast, policy_ttft_slo_s=cfg.policies.ttft_slo_s)
            self.collectors.append(self.forecaster)
        from agent.cost import CostTracker
        from agent.refits import AfterTickExecutor

        # detector refits run in a worker thread, started when the tick that asked for them ends
        self._refits = AfterTickExecutor(ThreadPoolExecutor(1, thread_name_prefix="servepilot-refit"))

        self.cost = CostTracker(cfg.cost.price_per_gpu_hour_usd, window_s=cfg.cost.window_s)
        # -- precision canary (agent/canary_live.py): its meter is a collector, its policy joins the set
        self.canary: LiveCanary | None = None
        if cfg.canary.enabled:
            from agent.canary_live import LiveCanary

            self.canary = LiveCanary(cfg)
            self.collectors.extend(self.canary.collectors())
        # -- end precision canary
        self.loop = Loop(
            self.collectors,
            self.store,
            interval_s=cfg.agent.interval_s,
            source_timeout_s=cfg.agent.source_timeout_s,
            lead_s=cfg.agent.scrape_lead_s,
            detectors=build_detectors(
                self._refits,
                slo_s=_slo(cfg.policies),
                windows_s=(cfg.engine.quantile_window_s, cfg.gate.stats_window_s),
                draft_cost_ratio=cfg.detectors.spec_draft_cost_ratio,
                disabled=cfg.detectors.disabled,
            ),
            policies=build_policies(cfg, self.knobs.gpu)
            + ([self.canary.policy] if self.canary is not None else []),
            act=self._act,
            derive=[self.cost.update, self.knobs.derived],
            enrich=self._leak_evidence if cfg.probe.enabled else None,
        )
        if self.canary is not None:
            self.canary.attach(self.loop)
        from agent.probe.leak_evidence import LeakEvidence
        from policies.registry import default_arbiter

        self.arbiter = default_arbiter((float(cfg.policies.batch_min), float(cfg.policies.batch_max)))
        self.knobs.actuation.bounds = self.arbiter.check  # an operator's pin is held to the same bounds
        self._arbiter_state: Any = None

        self.evidence = LeakEvidence()
        self._evidence_task: asyncio.Task[None] | None = None
        self.loop.subscribe(self._refits.release)
        self.loop.subscribe(self._tell_gate_of_the_engine)
        self.engine_gpus = EngineGpus(self._gpu_followers())
        if cfg.probe.enabled and self.engine_gpus.followers:
            self.loop.subscribe(self.engine_gpus.on_state)
        #: the ITL target the policies were built or last retuned with (agent/itl_steering.py)
        self._itl_target = ItlTarget(cfg.policies.itl_slo_s)
        self.exporter.set_policy_itl(self._itl_target.itl_s)
        self.loop.subscribe(self._steer_itl)  # a reload may turn policies.itl_steering on
        for warning in steering_warnings(cfg.policies, self.knobs.gate is not None):
            log.warning("%s", warning)
        self.loop.subscribe(self.exporter.publish)
        if self.forecaster is not None:
            self.loop.subscribe(self.forecaster.on_state)
        self.webhooks: WebhookDispatcher | None = None
        if cfg.webhooks.enabled:
            from agent.webhooks import WebhookDispatcher
            from agent.webhooks.outbox import OutboxError

            try:
                self.webhooks = WebhookDispatcher(cfg.webhooks, self.exporter.registry)
            except ValueError as error:  # the signing secret's file: unreadable or not a secret
                raise ConfigError("", str(error)) from None
            except OutboxError as error:  # webhooks.queue_path: no such directory, not writable
                raise ConfigError("webhooks.queue_path", str(error)) from None
            self.loop.subscribe(self.webhooks.observe)
        self.reloader: Reloader | None = None
        if config_path is not None:
            from agent.reload import Reloader

            gate = self.knobs.gate
            self.reloader = Reloader(
                config_path,
                environ or {},
                cfg,
                self.exporter.registry,
                self.knobs.audit,
                apply_gate=gate.set_admission_rules if gate is not None else None,
                apply_policies=self._retune_policies,
                apply_actuators=self._change_mode,
                prepare_webhooks=self.webhooks.prepare if self.webhooks is not None else None,
            )
        self._runner: web.AppRunner | None = None
        self._admin_runner: web.AppRunner | None = None
        self._task: asyncio.Task[None] | None = None
        self._save_task: asyncio.Task[None] | None = None
        self._watch_task: asyncio.Task[None] | None = None
        self._tls_task: asyncio.Task[None] | None = None
        #: the agent API's TLS, once started with a certificate (agent/tls.py)
        self.tls: WatchedTls | None = None
        self.exporter.registry.register(TlsFilesCollector(lambda: self.tls))
        self._control_task: asyncio.Task[None] | None = None
        #: saved pins on knobs the engine's control API binds once it answers (agent/persist.py)
        self._held_pins: dict[str, Any] = {}
        self._stop = asyncio.Event()
        self._hand_back_task: asyncio.Task[None] | None = None

    def reload(self, trigger: str = "admin API") -> ReloadResult:
        """Re-read the config file and apply what may change without a restart (agent/reload.py)."""
        if self.reloader is None:
            raise RuntimeError("this sidecar was not started from a config file")
        result = self.reloader.reload(trigger)
        if result.result == "applied":
            self.cfg = self.reloader.current
        return result

    def _retune_policies(self, p: PolicyConfig) -> None:
        """A reload's SLO targets, batch bounds and peak schedule (agent/reload.py): each running policy
        is retuned and keeps its state; the arbiter's batch bounds, the gate's SLO verdicts and the
        exported ``servepilot_slo_*_seconds`` follow, and an operator's pin outside the new bounds is
        dropped with a warning (as a restart drops it: agent/persist.py). Everything is built before
        anything is swapped, so a ValueError leaves the running brain as it was."""
        from policies.registry import with_batch_bounds

        bounds = (float(p.batch_min), float(p.batch_max))
        target = self._steered(p)
        retuned = self._retuned(p, target.itl_s)
        arbiter = with_batch_bounds(self.arbiter, bounds)
        self.loop.policies[:] = retuned
        self._aim(target)
        self.arbiter = arbiter
        self.knobs.actuation.bounds = arbiter.check
        self.exporter.set_slo(_slo(p))
        set_detector_slo(self.loop.detectors, _slo(p))
        if self.knobs.gate is not None:
            self.knobs.gate.set_slo(p.ttft_slo_s, p.itl_slo_s, priority_targets(p))
        if self.forecaster is not None and self.cfg.forecast.ttft_slo_s is None:
            self.forecaster.ttft_slo_s = p.ttft_slo_s  # capacity at the latency the replica now runs for
        pins = self.knobs.actuation.pins
        for knob, value in list(pins.items()):  # a pin bypasses the policies, not the bounds: as at a restart
            why = arbiter.check(knob, value)
            if why is not None:
                del pins[knob]
                log.warning("pin %s=%r dropped by the reload: %s", knob, value, why)

    def _retuned(self, p: PolicyConfig, itl_s: float) -> list[Policy]:
        """The running policies retuned to ``p`` with ``itl_s`` as their ITL target (ValueError: a value
        they do not take)."""
        from policies.registry import retune
        from policies.schedule import Schedule

        bounds = (float(p.batch_min), float(p.batch_max))
        schedule = Schedule.from_data(p.schedule) if p.schedule else None
        return [
            retune(
                policy,
                ttft_slo_s=p.ttft_slo_s,
                itl_slo_s=itl_s,
                batch_bounds=bounds,
                schedule=schedule,
                error_budget=p.error_budget,
            )
            for policy in self.loop.policies
        ]

    def _steered(self, p: PolicyConfig) -> ItlTarget:
        gate = self.knobs.gate
        if gate is None:
            return ItlTarget(p.itl_slo_s)
        return steered_itl(p, gate.stats.last_seen, gate.clock())

    def _steer_itl(self, _: AgentState) -> None:
        """``policies.itl_steering: served_classes``, after each tick: when the classes served lately ask
        for another ITL target, the policies are retuned to it (keeping their state) from the next tick,
        with an audit record (knob ``policies.itl_target_s``) and ``servepilot_policy_itl_target_seconds``."""
        p = self.cfg.policies
        target = self._steered(p)
        if target.itl_s == self._itl_target.itl_s:
            return
        try:
            self.loop.policies[:] = self._retuned(p, target.itl_s)
        except ValueError as error:
            log.warning(
                "ITL target %g s not taken by the policies: %s; they keep %g s",
                target.itl_s,
                error,
                self._itl_target.itl_s,
            )
            return
        self._aim(target)

    def _aim(self, target: ItlTarget) -> None:
        """The policies were retuned to ``target``: export it, and log and audit it when it moved (by the
        classes served, or by a reload)."""
        previous = self._itl_target.itl_s
        self._itl_target = target
        self.exporter.set_policy_itl(target.itl_s)
        if target.itl_s == previous:
            return
        reason = target.reason
        log.info("the policies now steer to an ITL of %g s (was %g s): %s", target.itl_s, previous, reason)
        mode = self.cfg.actuators.mode
        action = Action(
            self.loop.clock(), AUDIT_KNOB, previous, target.itl_s, reason, "itl_steering", mode, "ok"
        )
        self.knobs.audit.record(action)

    def _change_mode(self, a: ActuatorConfig) -> None:
        """``actuators.mode`` from a reload. Into act: decisions apply from the next tick. Out of act:
        nothing is applied any more, and what servepilot had set goes back as a restart would put it
        (:meth:`agent.knobs.Knobs.hand_back`), so no clock stays locked low and no batch cut stays in
        force with nobody tending it."""
        actuation = self.knobs.actuation
        old, new = actuation.mode, Mode(a.mode)
        if new is old:
            return
        actuation.mode = new
        log.info("actuation mode %s -> %s (config reload)", old.value, new.value)
        if old is Mode.ACT:
            self._hand_back_task = asyncio.get_running_loop().create_task(
                self._hand_back(), name="servepilot-hand-back"
            )

    async def _hand_back(self) -> None:
        if self.knobs.actuation.mode is Mode.ACT:  # back in act before this ran: keep what it holds
            return
        try:
            done = await self.knobs.hand_back()
        except Exception:  # the lease then lapses, the GPU watchdog restores: logged, never raised
            log.exception("handing back the knobs after leaving act mode failed")
            return
        if done:
            log.info("left act mode: handed back %s", "; ".join(done))

    async def save_state(self) -> None:
        """Write the brain state (agent/persist.py) when ``agent.state_path`` is set: captured here, between
        ticks, and written from a worker thread. A failed write is logged; the previous file stays."""
        path = self.cfg.agent.state_path
        if path is None:
            return
        from agent import persist

        data = persist.capture(self.loop, self.loop.clock(), self.knobs.actuation, self.knobs.gate_state())
        try:
            await asyncio.get_running_loop().run_in_executor(None, persist.write_atomically, path, data)
        except OSError as error:
            log.error("brain state not saved to %s: %s", path, error)

    async def _stopped_after(self, seconds: float) -> bool:
        """Wait ``seconds``, or less when the sidecar stops meanwhile; True when it is stopping."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), timeout=seconds)
        return self._stop.is_set()

    async def _watch_config(self, every_s: float) -> None:
        """Reload when the config file's content changes (``agent.config_watch_s``)."""
        assert self.reloader is not None
        while not await self._stopped_after(every_s):
            if self.reloader.file_changed():
                try:
                    self.reload("file changed")
                except Exception:  # a bug in applying must not end the watch: the next edit is tried
                    log.exception("config reload failed")

    async def _save_periodically(self) -> None:
        while not await self._stopped_after(self.cfg.agent.state_save_interval_s):
            await self.save_state()

    def _apply_forced_breaker(self, now: float) -> None:
        """Carry an operator's forced breaker level (admin API) into the breaker policy's state."""
        breaker: Any = next((p for p in self.loop.policies if p.name == "breaker"), None)
        if breaker is None:
            return
        wanted = self.knobs.actuation.forced.get("breaker.level")
        state = self.loop.policy_state("breaker")
        current = getattr(state, "forced", None)
        if wanted is not None and current != int(wanted):
            try:
                self.loop.set_policy_state("breaker", breaker.force(state, int(wanted), now))
            except ValueError as error:  # a level saved before the gate lost that upstream
                log.warning("forced breaker level dropped: %s", error)
                self.knobs.actuation.forced.pop("breaker.level", None)
        elif wanted is None and current is not None:
            self.loop.set_policy_state("breaker", breaker.release(state, now))

    async def _after_control_discovery(self) -> None:
        """The levers that depend on what the engine's control API offers (agent/engine_levers.py; each
        one logs why it stays out), and the saved pins that waited for its knobs."""
        if self._held_pins:
            from agent import persist

            restored = persist.restore_pins(self._held_pins, self.knobs.actuation)
            if restored:
                log.info("restored now that the engine's knobs are bound: %s", ", ".join(restored))
            self._held_pins.clear()
        from agent import engine_levers

        policies = self.loop.policies
        await engine_levers.start_batch_at_the_engines_cap(self.knobs, policies)
        # in this order: the token budget's controller looks for the energy policy
        if (energy := engine_levers.engine_energy(self.cfg, self.knobs)) is not None:
            policies.append(energy)
        if (budget := await engine_levers.token_budget(self.cfg, self.knobs, policies)) is not None:
            policies.append(budget)
        if (sleep := engine_levers.sleep_wake(self.cfg, self.knobs)) is not None:
            policies.append(sleep)

    async def _discover_control_later(self) -> None:
        """Ask for the engine's control API again, backing off from 1 s to 30 s, until it answers, says for
        good that it serves none, or the sidecar stops. Before this, an engine that was not up when the
        sidecar started (the usual order in a pod) was never controlled: act mode had no engine knob for
        the life of the process."""
        started, delay = time.monotonic(), 1.0
        while not await self._stopped_after(delay):
            try:
                error = await self.knobs.discover_control()
            except Exception:  # a bug must not end the retries silently, nor surface at stop
                log.exception("asking for the engine's control API failed")
                delay = min(CONTROL_RETRY_MAX_S, delay * 2)
                continue
            if error is None:
                log.info("engine control found %.0f s after start", time.monotonic() - started)
            elif error.temporary:
                log.debug("engine control still unavailable: %s", error)
                delay = min(CONTROL_RETRY_MAX_S, delay * 2)
                continue
            else:
                log.error("engine control unavailable: %s", error)
            await self._after_control_discovery()
            return

    def _gpu_followers(self) -> list[Follower]:
        """What watches or drives GPUs and so must keep to the engine's (agent/engine_gpus.py)."""
        followers: list[Follower] = [
            c.sampler for c in self.collectors if isinstance(c, NvmlCollector) and c.sampler is not None
        ]
        if self.knobs.gpu is not None:
            followers.append(self.knobs.gpu)
        return followers

    def _tell_gate_of_the_engine(self, state: AgentState) -> None:
        """What the tick learnt of this engine, to the gate's upstream that is it: the engine_stall
        finding or its end (a hang the gate cannot see when the engine holds no stream: non-streamed
        requests, prompts only), and its decode tokens per step, by which the gate counts its streams
        without usage (:meth:`agent.gate.proxy.Gate.set_tokens_per_event`)."""
        gate, upstream = self.knobs.gate, self._engine_upstream
        if gate is None or upstream is None or upstream not in gate.pool.upstreams:
            return
        stall = next((f for f in state.findings if f.detector == "engine_stall"), None)
        gate.set_engine_stalled(upstream, stall.summary if stall is not None else None)
        if state.snapshot is not None:
            per_step = state.snapshot.values.get("engine.decode_tokens_per_step")
            gate.set_tokens_per_event(upstream, per_step)

    async def _leak_evidence(self, findings: tuple[Finding, ...], snapshot: Snapshot) -> tuple[Finding, ...]:
        """When the leak detector fires, ask the probe (in the background) to record allocator history."""
        if self.evidence.wanted(findings, snapshot.now) and self._evidence_task is None:
            self._evidence_task = asyncio.create_task(
                self._record_evidence(), name="servepilot-leak-evidence"
            )
        return tuple(self.evidence.link(findings))

    async def _record_evidence(self) -> None:
        import aiohttp

        from agent.probe.leak_evidence import request_snapshot

        try:
            async with aiohttp.ClientSession() as session:
                answer = await request_snapshot(session, self.cfg.probe.url, self.evidence.duration_s)
            self.evidence.recorded(answer)
        finally:
            self._evidence_task = None

    async def _act(self, proposals: Sequence[Proposal], snapshot: Snapshot) -> Mapping[str, float | str]:
        """Proposals -> arbiter (priority, bounds, steps, cooldowns, hysteresis) -> actuation (mode, pause,
        pins and audit are the Actuation's); then renew the leases that keep settings alive."""
        actuation = self.knobs.actuation
        self._apply_forced_breaker(snapshot.now)
        proposals = _without_pinned_partners(proposals, actuation.pins)
        actual = self.knobs.values()
        self._arbiter_state, decisions = self.arbiter.decide(
            proposals, actual, self._arbiter_state, snapshot.now
        )
        for decision in decisions:
            why = decision.reason
            if decision.overruled:
                why += f" (over {', '.join(decision.overruled)})"
            await actuation.execute(Proposal(decision.policy, decision.knob, decision.value, why))
        decided = {d.knob for d in decisions}
        for knob, value in list(actuation.pins.items()):  # a pin holds even while no policy proposes
            if knob not in decided:
                await actuation.execute(Proposal("operator", knob, value, "pinned by operator"))
        self.knobs.renew()
        return self.knobs.values()

    async def start(self) -> None:
        # what detectors import lazily (scipy.stats: ~0.7 s), imported off the event loop now rather than
        # inside the first tick that needs it
        await asyncio.get_running_loop().run_in_executor(None, warm_imports)
        if self.forecaster is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.forecaster.restore)
        await self.knobs.start()
        if self.cfg.agent.state_path is not None:
            from agent import persist

            # after knobs.start(): engine knobs are bound once discovery has run, and a saved pin is kept
            # only for a bound knob (before, every pin on an engine knob was dropped at each restart)
            # while the engine's control API is still being asked for, pins on knobs not bound yet wait
            waiting = self.knobs.control_error is not None and self.knobs.control_error.temporary
            gate: dict[str, Any] = {}
            await asyncio.get_running_loop().run_in_executor(
                None,
                persist.load_into,
                self.cfg.agent.state_path,
                self.loop,
                self.knobs.actuation,
                self._held_pins if waiting else None,
                gate,
            )
            await self.knobs.restore_gate(gate, self.loop.clock())
            # an operator's forced level was saved with the breaker: the override survives the restart
            forced = getattr(self.loop.policy_state("breaker"), "forced", None)
            if forced is not None:
                self.knobs.actuation.forced["breaker.level"] = forced
        error = self.knobs.control_error
        if error is not None and error.temporary:
            # the engine is not answering yet (in a pod the sidecar is up in seconds, the engine loads its
            # weights for minutes): ask again in the background; the levers that need it join then
            log.error("engine control unavailable: %s; asking again in the background", error)
            self._control_task = asyncio.create_task(
                self._discover_control_later(), name="servepilot-control-discovery"
            )
        else:
            if error is not None:
                log.error("engine control unavailable: %s", error)
            await self._after_control_discovery()
        from agent.admin import add_admin_routes

        agent_cfg = self.cfg.agent
        app = build_app(
            self.loop,
            self.exporter,
            unready_on_engine_stall=self.cfg.agent.unready_when_engine_stalled,
            upstreams=self.knobs.gate.pool if self.knobs.gate is not None else None,
            engine_restart_stall_s=agent_cfg.engine_restart_stall_s,
            client_certificates=agent_cfg.tls_client_ca_file is not None,
            shutting_down=self._gate_shutting_down,
        )
        admin_args = (self.knobs.actuation, self.knobs.audit, self.knobs.token, self.canary, self.loop.clock)
        admin_kwargs: dict[str, Any] = {
            "breaker_levels": breaker_levels(self.cfg),
            "reload": self.reload if self.reloader is not None else None,
        }
        if agent_cfg.admin_listen_port is None:  # config validation allows this only on loopback
            add_admin_routes(app, *admin_args, **admin_kwargs)
        else:
            admin = without_versions(web.Application(client_max_size=64 * 1024))
            add_admin_routes(admin, *admin_args, **admin_kwargs)
            self._admin_runner = web.AppRunner(admin, access_log=None, handle_signals=False)
            await self._admin_runner.setup()
            await web.TCPSite(
                self._admin_runner, agent_cfg.admin_listen_host, agent_cfg.admin_listen_port
            ).start()
            log.info("admin routes on http://%s:%d", agent_cfg.admin_listen_host, agent_cfg.admin_listen_port)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        ssl_context = None
        if agent_cfg.tls_cert_file is not None and agent_cfg.tls_key_file is not None:
            files = (agent_cfg.tls_cert_file, agent_cfg.tls_key_file, agent_cfg.tls_client_ca_file)
            self.tls = server_tls(*files)
            ssl_context = self.tls.context
        site = web.TCPSite(
            self._runner, agent_cfg.listen_host, agent_cfg.listen_port, ssl_context=ssl_context
        )
        await site.start()
        scheme = "https" if ssl_context else "http"
        log.info(
            "agent API on %s://%s:%d (%s event loop)",
            scheme,
            agent_cfg.listen_host,
            agent_cfg.listen_port,
            eventloop.running_loop_name(),
        )
        self._task = asyncio.create_task(self.loop.run(self._stop), name="servepilot-loop")
        if self.cfg.agent.state_path is not None:
            self._save_task = asyncio.create_task(self._save_periodically(), name="servepilot-save-state")
        if self.reloader is not None and self.cfg.agent.config_watch_s > 0:
            self._watch_task = asyncio.create_task(
                self._watch_config(self.cfg.agent.config_watch_s), name="servepilot-watch-config"
            )
        if agent_cfg.tls_watch_s > 0:  # client contexts may come later (control discovery)
            self._tls_task = asyncio.create_task(
                watch_tls(agent_cfg.tls_watch_s, self._stop, self.tls), name="servepilot-watch-tls"
            )
        if self.webhooks is not None:
            self.webhooks.start()

    def _gate_shutting_down(self) -> bool:
        return self.knobs.gate is not None and self.knobs.gate.shutting_down

    async def stop(self, hurry: asyncio.Event | None = None) -> None:
        """Drain the gate (``hurry`` cuts it short: :meth:`Gate.drain`), stop the loop, keep the state,
        put every setting back to its default.

        Each stage runs even when one before it raised (logged with its traceback): a bug in saving the
        state, or a drain that failed, must not leave the GPU clocks and the engine's settings where the
        policies had put them."""
        stages = (
            ("the gate's drain", partial(self._drain, hurry)),
            ("ending the loop and saving the state", self._stop_tasks),
            ("restoring the defaults", self._hand_back_and_close),
        )
        for what, stage in stages:
            try:
                await stage()
            except Exception:
                log.exception("stopping: %s failed; the stop goes on", what)

    async def _drain(self, hurry: asyncio.Event | None) -> None:
        if self.knobs.gate is not None:  # drain first, while the loop still renews leases and exports
            await self.knobs.gate.drain(hurry)

    async def _stop_tasks(self) -> None:
        """The loop and the background tasks end; the state is saved; queued alerts go to the outbox."""
        self._stop.set()
        for task, limit_s in ((self._task, 2.0), (self._save_task, None), (self._watch_task, None),
                              (self._tls_task, None)):  # fmt: skip
            if task is None:
                continue
            try:
                await asyncio.wait_for(task, timeout=limit_s)
            except (TimeoutError, asyncio.CancelledError):
                pass
            except Exception:  # it ended on an error nobody had read: say so, and go on
                log.exception("%s had failed", task.get_name())
        if self._control_task is not None:  # may be waiting on an engine that never answered
            self._control_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._control_task
        if self._task is not None:  # only a started agent has state worth keeping
            await self.save_state()
        if self.webhooks is not None:
            await self.webhooks.stop()  # pending alerts stay in the on-disk outbox for the next start

    async def _hand_back_and_close(self) -> None:
        if self._evidence_task is not None:
            self._evidence_task.cancel()
        if self._hand_back_task is not None:  # a hand-back under way finishes: knobs.stop() follows it
            with contextlib.suppress(Exception):
                await self._hand_back_task
        self._refits.shutdown(wait=False, cancel_futures=True)
        await self.knobs.stop()  # GPU and engine settings back to their defaults
        for collector in self.collectors:
            with contextlib.suppress(Exception):
                await collector.close()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._admin_runner is not None:
            await self._admin_runner.cleanup()


async def serve(
    cfg: Config,
    stop: asyncio.Event,
    *,
    hurry: asyncio.Event | None = None,
    config_path: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> None:
    """Run the sidecar until ``stop`` is set (``hurry`` then cuts the stop short: agent/stop_signals.py);
    with ``config_path``, SIGHUP reloads it (agent/reload.py)."""
    sidecar = Sidecar(cfg, config_path=config_path, environ=environ)
    loop = asyncio.get_running_loop()
    hangup = False
    if config_path is not None:  # before start: a reload needs only the config and the gate's objects
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread
            loop.add_signal_handler(signal.SIGHUP, sidecar.reload, "SIGHUP")
            hangup = True
    try:
        await sidecar.start()
        from agent.heap import settle_after_start_up

        settle_after_start_up()  # full GC passes would otherwise stall ticks and the gate's streams
        await stop.wait()
    finally:
        if hangup:
            ignore_hangup_while_stopping(loop)
        await sidecar.stop(hurry)
        if hangup:
            ignore_hangup_until_exit(loop)


def _slo(p: PolicyConfig) -> dict[str, float]:
    """The latency targets as the exporter and the detectors take them."""
    return {"ttft": p.ttft_slo_s, "itl": p.itl_slo_s}
