"""The simulator's HTTP face (aiohttp): runs an :class:`EngineCore` in real time, scaled by ``speed``.

One background task steps the core: it asks for one iteration at the current simulated time, waits the
iteration's duration (divided by ``speed``), then hands the emitted tokens to the waiting requests, so
SSE chunks leave at the pace the model computes them. Time comes from an injected ``clock`` (wall seconds,
default :func:`time.time`) and waits go through an injected ``sleep``: tests pass a fake clock and a
sleep that advances it, so nothing in a test really sleeps. Leases run on the clock, not on simulated
time, because the sidecar that renews them lives in real time.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from simulator import messages_api, openai_api, responses_api, streams
from simulator.control import ControlError, ControlPlane
from simulator.engine import EngineCore, StepResult
from simulator.faults import FaultError
from simulator.metrics import ProbeCollector, VllmCollector, registry_with, render
from simulator.sleep import SleepModel, SleepRefused
from simulator.telemetry import NvmlView

#: How often an idle engine loop wakes to check the lease (wall seconds).
IDLE_POLL_S = 0.5

Sleep = Callable[[float], Awaitable[Any]]

#: With ``stamp_chunks``: the response header that carries when the request reached the simulator
#: (``time.monotonic_ns()``, a clock every process on the host shares); each SSE event then starts with
#: the comment line ``: sent_ns=<monotonic ns>``, which SSE clients ignore (WHATWG HTML, 9.2.6).
RECEIVED_HEADER = "X-Sim-Received-Ns"
STAMP_PREFIX = b": sent_ns="

RID_PREFIXES = {"completion": "cmpl-", "responses": "resp_"}
"""Request ids as vLLM names them: ``cmpl-`` for completions, ``resp_`` for responses, ``chatcmpl-`` else."""


def _error(status: int, message: str, kind: str = "BadRequestError") -> web.Response:
    return web.json_response(openai_api.ApiError(status, message, kind).body(), status=status)


class SimServer:
    """Routes and the engine loop around one core."""

    def __init__(
        self,
        core: EngineCore,
        *,
        speed: float = 1.0,
        clock: Callable[[], float] = time.time,
        sleep: Sleep = asyncio.sleep,
        seed: int = 0,
        pid: int | None = None,
        control_token: str | None = None,
        fp8_ppl_delta: float = 0.003,
        stamp_chunks: bool = False,
        node_gpus: int | None = None,
    ) -> None:
        if speed <= 0:
            raise ValueError(f"speed must be > 0, got {speed}")
        if not 0 <= fp8_ppl_delta < 1:
            raise ValueError(f"fp8_ppl_delta must be in [0, 1), got {fp8_ppl_delta}")
        self.core = core
        self.fp8_ppl_delta = fp8_ppl_delta  # relative perplexity rise of fp8 (echo + logprobs answers)
        self.control_token = control_token  # when set, the control API wants "Authorization: Bearer <it>"
        # a bench aid (bench/gate.py): when each request arrived and each SSE event left, on the host's
        # monotonic clock, so a proxy's own delay can be told apart from the engine's batching
        self.stamp_chunks = stamp_chunks
        self.model_name = core.model.served_name
        self.speed = speed
        self.clock = clock
        self.sleep = sleep
        self.control = ControlPlane(core, core.settings)
        self.sleep_mode = SleepModel()
        self.pid = os.getpid() if pid is None else pid
        self._wall0 = clock()
        self._sim0 = core.time
        self._rng = np.random.default_rng(seed)
        self._streams: dict[str, streams.TokenQueue] = {}
        self._wake = asyncio.Event()
        self.nvml = NvmlView(core, seed=seed, pid=self.pid, node_gpus=node_gpus)
        self.engine_metrics = VllmCollector(core, self.model_name)
        self.registry = registry_with(self.engine_metrics)
        self.probe_registry = registry_with(
            ProbeCollector(core, self.sim_now, self.pid, self.nvml.engine_uuids)
        )

    def sim_now(self) -> float:
        """Simulated seconds now: the clock's progress since start, times ``speed``."""
        return self._sim0 + (self.clock() - self._wall0) * self.speed

    # -- engine loop --------------------------------------------------------------------------------
    async def run_engine(self) -> None:
        """Step the core forever; tokens are released when their iteration ends."""
        core = self.core
        while True:
            self.control.expire(self.clock())
            if not core.has_work() or core.faults.stalled:  # stalled: hold every request, step nothing
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=IDLE_POLL_S)
                continue
            result = core.step(self.sim_now())
            if result.steps == 0:
                await self.sleep(0.001)
                continue
            wait = (result.end - self.sim_now()) / self.speed
            if wait > 0:
                await self.sleep(wait)
            self._dispatch(result)

    def _dispatch(self, result: StepResult) -> None:
        streams = self._streams
        for rid, count in result.tokens.items():
            queue = streams.get(rid)
            if queue is not None:
                queue.put_nowait(("tokens", count))
        for done in result.finished:
            queue = streams.get(done.request_id)
            if queue is not None:
                queue.put_nowait(("finish", done.reason))

    async def _engine_ctx(self, app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(self.run_engine())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    def app(self) -> web.Application:
        app = web.Application()
        app.cleanup_ctx.append(self._engine_ctx)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/messages", self.messages)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/control/state", self.control_state)
        app.router.add_post("/v1/control/apply", self.control_apply)
        app.router.add_post("/v1/control/lease", self.control_lease)
        app.router.add_delete("/v1/control/lease", self.control_release)
        app.router.add_get("/sim/nvml", self.nvml_json)
        app.router.add_get("/sim/probe/metrics", self.probe_metrics)
        app.router.add_get("/sim/faults", self.faults_get)
        app.router.add_post("/sim/faults", self.faults_post)
        app.router.add_post("/sleep", self.sleep_post)
        app.router.add_post("/wake_up", self.wake_up_post)
        app.router.add_get("/is_sleeping", self.is_sleeping_get)
        return app

    # -- vLLM-style sleep mode (simulator/sleep.py) ---------------------------------------------------
    async def sleep_post(self, request: web.Request) -> web.Response:
        in_flight = self.core.num_running + self.core.num_waiting
        try:
            self.sleep_mode.sleep(in_flight, self.sim_now())
        except SleepRefused as error:
            return _error(409, str(error), "ConflictError")
        return web.Response(status=200)

    async def wake_up_post(self, request: web.Request) -> web.Response:
        self.sleep_mode.wake_up(self.sim_now())
        return web.Response(status=200)

    async def is_sleeping_get(self, request: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": self.sleep_mode.is_sleeping(self.sim_now())})

    # -- OpenAI API ---------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        model = {
            "id": self.model_name,
            "object": "model",
            "created": int(self._wall0),
            "owned_by": "servepilot",
            "root": self.model_name,
            "max_model_len": self.core.model.max_model_len,
        }
        return web.json_response({"object": "list", "data": [model]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def messages(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "messages")

    async def responses(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "responses")

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        received_ns = time.monotonic_ns()
        if self.sleep_mode.is_sleeping(self.sim_now()):
            return _error(503, "the engine is sleeping or waking up", "ServiceUnavailableError")
        faults = self.core.faults
        if faults.error_rate > 0 and self._rng.random() < faults.error_rate:
            return _error(faults.error_status, "injected fault: engine unavailable", "InternalServerError")
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "request body is not valid JSON")
        try:
            if kind == "messages":
                parsed = messages_api.parse(body, self.model_name)
            elif kind == "responses":
                parsed = responses_api.parse(body, self.model_name)
            else:
                parsed = openai_api.parse(kind, body, self.model_name)
            priority = openai_api.priority_of(body)
        except openai_api.ApiError as error:
            return web.json_response(error.body(), status=error.status)
        rid = RID_PREFIXES.get(kind, "chatcmpl-") + uuid.uuid4().hex[:16]
        # several prompts, or n > 1: a request of its own in the core for each sequence, as vLLM fans
        # them out; sequence p x n + i is prompt p's i-th, its choices[].index
        lengths = [length for length in parsed.prompt_lengths for _ in range(parsed.n)]
        sequence_ids = [rid] if len(lengths) == 1 else [f"{rid}-{i}" for i in range(len(lengths))]
        queues: list[streams.TokenQueue] = [asyncio.Queue() for _ in sequence_ids]
        try:
            for sequence_id, length in zip(sequence_ids, lengths, strict=True):
                self.core.submit(sequence_id, length, parsed.max_tokens, self.sim_now(), priority)
        except ValueError as error:
            for sequence_id in sequence_ids:
                self.core.abort(sequence_id, self.sim_now())
            return _error(400, str(error))
        self._streams.update(zip(sequence_ids, queues, strict=True))
        self._wake.set()
        try:
            if parsed.stream:
                return await self._stream(request, parsed, rid, queues, received_ns)
            return await self._collect(parsed, rid, queues)
        finally:
            for sequence_id in sequence_ids:
                self._streams.pop(sequence_id, None)
                self.core.abort(sequence_id, self.sim_now())  # a no-op unless the client went away

    async def _stream(
        self,
        request: web.Request,
        parsed: openai_api.ParsedRequest,
        rid: str,
        queues: list[streams.TokenQueue],
        received_ns: int,
    ) -> web.StreamResponse:
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        stamp = self.stamp_chunks
        if stamp:
            headers[RECEIVED_HEADER] = str(received_ns)
        response = web.StreamResponse(headers=headers)
        await response.prepare(request)
        created = int(time.time())
        kind, model = parsed.kind, self.model_name

        async def write(event: bytes) -> None:
            await response.write(b"%b%d\n%b" % (STAMP_PREFIX, time.monotonic_ns(), event) if stamp else event)

        async def send(payload: Any) -> None:
            await write(f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode())

        try:
            if kind in ("messages", "responses"):
                events = streams.message_events if kind == "messages" else streams.response_events
                await events(write, parsed, rid, self.model_name, queues[0])
                await response.write_eof()
                return response
            if kind == "chat":
                for index in range(len(queues)):
                    await send(openai_api.chunk(kind, rid, model, created, None, role=True, index=index))

            async def relay(index: int, queue: streams.TokenQueue) -> int:
                """Sequence ``index``'s tokens, the last with its finish reason; returns how many it had."""

                async def token(text: str) -> None:
                    await send(openai_api.chunk(kind, rid, model, created, text, index=index))

                async def last(text: str, reason: str) -> None:  # the finish reason on the last token
                    await send(openai_api.chunk(kind, rid, model, created, text, reason, index=index))

                finish_reason, emitted, closed = await streams.relay_tokens(queue, token, last)
                if not closed:  # it ended with no token in its last step: a closing event of its own
                    end = None if kind == "chat" else ""
                    await send(openai_api.chunk(kind, rid, model, created, end, finish_reason, index=index))
                return emitted

            emitted = sum(await streams.side_by_side([relay(i, q) for i, q in enumerate(queues)]))
            if parsed.include_usage:
                tail = openai_api.chunk(kind, rid, model, created, None)
                tail["choices"] = []
                tail["usage"] = openai_api.usage(parsed.prompt_tokens, emitted)
                await send(tail)
            await write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client went away: _generate's finally aborts the request in the core
        return response

    async def _collect(
        self, parsed: openai_api.ParsedRequest, rid: str, queues: list[streams.TokenQueue]
    ) -> web.Response:
        outcomes = await streams.side_by_side([streams.gather_tokens(q) for q in queues])
        if parsed.kind == "responses":
            (pieces, finish_reason), item_id = outcomes[0], f"msg_{uuid.uuid4().hex[:16]}"
            answer = responses_api.response(
                rid, self.model_name, int(time.time()), parsed.max_tokens,
                instructions=parsed.instructions, output=[responses_api.item(item_id, "".join(pieces))],
                finish_reason=finish_reason, tokens=(parsed.prompt_tokens, len(pieces)),
            )  # fmt: skip
            return web.json_response(answer)
        if parsed.kind == "messages":
            pieces, finish_reason = outcomes[0]
            answer = messages_api.full_message(
                rid, self.model_name, "".join(pieces), finish_reason, parsed.prompt_tokens, len(pieces)
            )
            return web.json_response(answer)
        precision = self.core.settings.precision  # read per answer: a control-API switch shows
        prefix = "".join(parsed.prompt_pieces) if parsed.echo else ""
        answers = [
            openai_api.Answer(
                prefix + "".join(pieces),
                finish_reason,
                None
                if parsed.logprobs is None
                else openai_api.logprobs_block(
                    parsed.prompt_pieces, pieces, parsed.echo, precision, self.fp8_ppl_delta
                ),
            )
            for pieces, finish_reason in outcomes
        ]
        tokens = sum(len(pieces) for pieces, _ in outcomes)
        body = openai_api.full_response(
            parsed.kind, rid, self.model_name, int(time.time()), answers, parsed.prompt_tokens, tokens
        )
        return web.json_response(body)

    # -- metrics, telemetry, faults -----------------------------------------------------------------
    async def metrics(self, request: web.Request) -> web.Response:
        delay = self.core.faults.metrics_delay_s
        if delay > 0:
            await self.sleep(delay)
        self.core.idle_until(self.sim_now())
        return web.Response(body=render(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def probe_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=render(self.probe_registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def nvml_json(self, request: web.Request) -> web.Response:
        return web.json_response(self.nvml.read(self.sim_now()))

    async def faults_get(self, request: web.Request) -> web.Response:
        return web.json_response(self.core.faults.to_json())

    async def faults_post(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            faults = self.core.faults.updated(body)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "request body is not valid JSON")
        except FaultError as error:
            return _error(422, str(error), "UnprocessableEntityError")
        self.core.set_faults(faults, max(self.sim_now(), self.core.time))
        self._wake.set()  # a stall that ended resumes at once
        return web.json_response(faults.to_json())

    # -- control API --------------------------------------------------------------------------------
    def _unauthorized(self, request: web.Request) -> web.Response | None:
        """401 unless the request carries the control token (constant-time comparison)."""
        if self.control_token is None:
            return None
        header = request.headers.get("Authorization", "")
        presented = header[7:].strip() if header[:7].lower() == "bearer " else ""
        if hmac.compare_digest(presented.encode(), self.control_token.encode()):
            return None
        response = _error(401, "missing or wrong bearer token", "AuthenticationError")
        response.headers["WWW-Authenticate"] = "Bearer"
        return response

    async def control_state(self, request: web.Request) -> web.Response:
        if (denied := self._unauthorized(request)) is not None:
            return denied
        return web.json_response(self.control.state(self.clock()))

    async def control_apply(self, request: web.Request) -> web.Response:
        if (denied := self._unauthorized(request)) is not None:
            return denied
        return await self._control(request, self.control.apply)

    async def control_lease(self, request: web.Request) -> web.Response:
        if (denied := self._unauthorized(request)) is not None:
            return denied
        return await self._control(request, self.control.renew, allow_empty=True)

    async def control_release(self, request: web.Request) -> web.Response:
        if (denied := self._unauthorized(request)) is not None:
            return denied
        return await self._control(request, self.control.release, allow_empty=True)

    async def _control(
        self, request: web.Request, action: Callable[[Any, float], dict[str, Any]], allow_empty: bool = False
    ) -> web.Response:
        try:
            raw = await request.text()
            body = json.loads(raw) if raw.strip() or not allow_empty else None
            answer = action(body, self.clock())
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "request body is not valid JSON")
        except ControlError as error:
            return _error(error.status, str(error), "ControlError")
        return web.json_response(answer)
