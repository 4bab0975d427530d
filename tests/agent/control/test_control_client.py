"""The control client against the simulator's control API (in-process, loopback), and with fakes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import pytest
from aiohttp import web

from agent.config import ControlConfig
from agent.control.base import Capabilities, ControlError, KnobSpec, Value
from agent.control.client import ControlClient
from agent.engines.launcher import free_port as _free_port
from simulator.engine import make_core
from simulator.server import SimServer

ROOT = Path(__file__).resolve().parents[3]


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


@pytest.fixture
async def sim() -> AsyncIterator[tuple[SimServer, str]]:
    server = SimServer(make_core("a100-80g", "llama-2-7b", "fp16", 256), speed=10.0)
    runner, url = await _serve(server.app())
    yield server, url
    await runner.cleanup()


async def _client(url: str, **kw: object) -> ControlClient:
    client = ControlClient(ControlConfig(enabled=True, url=url, lease_s=30, **kw))  # type: ignore[arg-type]
    await client.start()
    return client


async def test_auto_discovery_finds_the_generic_api_and_its_knobs(sim: tuple[SimServer, str]) -> None:
    client = await _client(sim[1])
    try:
        assert client.capabilities is not None and client.capabilities.adapter == "generic"
        assert {"max_num_seqs", "precision", "power_limit_w"} <= set(client.capabilities.knobs)
        assert client.capabilities.leases
    finally:
        await client.close()


async def test_apply_sets_an_absolute_value_and_reads_it_back(sim: tuple[SimServer, str]) -> None:
    server, url = sim
    client = await _client(url)
    try:
        result = await client.apply({"max_num_seqs": 32, "precision": "fp8"})
        assert result.ok and result.read_back["max_num_seqs"] == 32
        assert server.core.settings.max_num_seqs == 32 and server.control.lease_expires_at is not None
    finally:
        await client.close()


async def test_a_clean_stop_ends_the_lease_and_the_engine_is_on_its_defaults_at_once(
    sim: tuple[SimServer, str],
) -> None:
    server, url = sim
    client = await _client(url)
    await client.apply({"max_num_seqs": 8, "precision": "fp8"})
    await client.close()
    state = server.control.state(server.clock())
    assert state["settings"] == state["safe_defaults"] and not state["lease"]["active"]
    assert state["settings"]["max_num_seqs"] == 256 and state["last_revert_at"] is not None


async def test_without_release_on_stop_the_setting_holds_until_the_lease_lapses(
    sim: tuple[SimServer, str],
) -> None:
    server, url = sim
    client = await _client(url, release_on_stop=False)
    await client.apply({"max_num_seqs": 8})
    await client.close()
    state = server.control.state(server.clock())
    assert state["settings"]["max_num_seqs"] == 8 and state["lease"]["active"]
    assert server.control.expire(server.clock() + 30.0)  # and reverts when the lease lapses


async def test_a_client_that_never_applied_leaves_the_engine_alone_on_stop(
    sim: tuple[SimServer, str],
) -> None:
    server, url = sim
    other = await _client(url)
    await other.apply({"max_num_seqs": 8})  # e.g. set by hand, or by an earlier sidecar's lease
    observer = await _client(url)
    await observer.close()
    assert server.core.settings.max_num_seqs == 8 and server.control.lease_expires_at is not None
    await other.close()


async def test_handing_back_ends_the_lease_and_a_later_apply_takes_a_new_one(
    sim: tuple[SimServer, str],
) -> None:
    """Leaving act mode: the engine is on its defaults at once, nothing renews, and the client still works."""
    server, url = sim
    client = await _client(url)
    try:
        await client.apply({"max_num_seqs": 8})
        await client.hand_back()
        state = server.control.state(server.clock())
        assert state["settings"] == state["safe_defaults"] and not state["lease"]["active"]
        assert client._renew_task is None
        await client.hand_back()  # nothing held now: a no-op, not an error
        result = await client.apply({"max_num_seqs": 16})  # back in act mode
        assert result.ok and server.core.settings.max_num_seqs == 16
        assert server.control.lease_expires_at is not None and client._renew_task is not None
    finally:
        await client.close()


async def test_a_failed_release_is_logged_and_the_stop_goes_on(
    sim: tuple[SimServer, str], caplog: pytest.LogCaptureFixture
) -> None:
    server, url = sim
    client = await _client(url)
    await client.apply({"max_num_seqs": 8})
    server.control_token = "now-the-engine-wants-a-token"  # the DELETE is refused (401)
    await client.close()
    assert "control lease release failed" in caplog.text and "HTTP 401" in caplog.text
    assert server.core.settings.max_num_seqs == 8  # reverts when the lease lapses, as after a kill -9


async def test_an_integral_float_goes_to_an_integer_knob_as_an_integer(sim: tuple[SimServer, str]) -> None:
    server, url = sim
    client = await _client(url)
    try:
        result = await client.apply({"max_num_seqs": 48.0})  # the engine refuses JSON 48.0 (422)
        assert result.ok and result.sent == {"max_num_seqs": 48} and server.core.settings.max_num_seqs == 48
    finally:
        await client.close()


async def test_value_outside_the_published_bounds_never_leaves_the_agent(sim: tuple[SimServer, str]) -> None:
    server, url = sim
    client = await _client(url)
    try:
        with pytest.raises(ControlError, match=r"max_num_seqs must be in \[1, 1024\]") as info:
            await client.apply({"max_num_seqs": 5000})
        assert not info.value.temporary and server.control.generation == 0
    finally:
        await client.close()


async def test_a_value_already_set_is_not_sent_again(sim: tuple[SimServer, str]) -> None:
    server, url = sim
    client = await _client(url)
    try:
        await client.apply({"max_num_seqs": 16})
        result = await client.apply({"max_num_seqs": 16})
        assert result.sent == {} and server.control.generation == 1
    finally:
        await client.close()


async def test_no_control_api_is_a_permanent_one_line_error() -> None:
    app = web.Application()
    runner, url = await _serve(app)
    try:
        with pytest.raises(ControlError, match="no engine control API found") as info:
            await _client(url)
        assert "\n" not in str(info.value)
    finally:
        await runner.cleanup()


class FlakyAdapter:
    """Fails the first ``failures`` applies with a temporary error; records the keys it saw."""

    name = "flaky"

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.keys: list[str] = []
        self.value: dict[str, Value] = {"n": 1}

    async def discover(self) -> Capabilities:
        return Capabilities("flaky", {"n": KnobSpec("n", "integer", 1, 10)}, leases=False)

    async def read(self) -> dict[str, Value]:
        return dict(self.value)

    async def apply(self, values: Mapping[str, Value], key: str, lease_s: float) -> dict[str, Value]:
        self.keys.append(key)
        if len(self.keys) <= self.failures:
            raise ControlError("connection refused", temporary=True)
        self.value.update(values)
        return dict(self.value)

    async def renew(self, lease_s: float) -> None:
        return None


async def _flaky_client(failures: int) -> tuple[ControlClient, FlakyAdapter, list[float]]:
    waits: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        waits.append(seconds)

    client = ControlClient(ControlConfig(), session=None, sleep=fake_sleep, retries=3)
    adapter = FlakyAdapter(failures)
    client.adapter, client.capabilities = adapter, await adapter.discover()
    return client, adapter, waits


async def test_a_lapsed_lease_is_flagged_for_the_owner() -> None:
    """A renewal answered 409 means the engine went back to its defaults: the knob values the agent holds
    for it are stale (agent/knobs.py drops them on the flag)."""
    client, adapter, _ = await _flaky_client(failures=0)

    async def lapsed(lease_s: float) -> None:
        raise ControlError("no active lease to renew", temporary=False, status=409)

    adapter.renew = lapsed  # type: ignore[method-assign]
    assert not client.lapsed
    await client._renew_loop(adapter)  # returns at the 409
    assert client.lapsed


async def test_temporary_failures_are_retried_under_the_same_idempotency_key() -> None:
    client, adapter, waits = await _flaky_client(failures=2)
    result = await client.apply({"n": 5})
    assert result.ok and result.attempts == 3 and len(set(adapter.keys)) == 1
    assert len(waits) == 2 and all(0 <= w <= 2.0 for w in waits)


async def test_retries_are_bounded() -> None:
    client, adapter, _ = await _flaky_client(failures=10)
    with pytest.raises(ControlError, match="connection refused"):
        await client.apply({"n": 5})
    assert len(adapter.keys) == 4


def _wait_for_settings(url: str, want: int, deadline_s: float) -> float:
    """Poll the simulator's state until max_num_seqs == want; seconds it took. Real processes, real time."""
    import json
    import urllib.request

    start = time.monotonic()
    while time.monotonic() - start < deadline_s:
        try:
            with urllib.request.urlopen(url + "/v1/control/state", timeout=2) as resp:
                if json.load(resp)["settings"]["max_num_seqs"] == want:
                    return time.monotonic() - start
        except OSError:
            pass  # not listening yet
        time.sleep(0.05)
    raise AssertionError(f"max_num_seqs never became {want} within {deadline_s} s")


def test_kill_9_of_the_sidecar_returns_the_engine_to_safe_defaults() -> None:
    """Simulator and lease holder are separate processes; after kill -9 of the holder its 2 s lease
    lapses and the simulator reverts by itself. Waits on real processes, so it takes ~3 s."""
    url = f"http://127.0.0.1:{_free_port()}"
    sim = subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "sim", "--port", url.rsplit(":", 1)[1]],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    holder = None
    try:
        _wait_for_settings(url, 256, deadline_s=20)  # up, on its defaults
        holder = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("lease_holder.py")), url, "2"],
            cwd=ROOT, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
        assert holder.stdout is not None and holder.stdout.readline().strip() == "applied"
        _wait_for_settings(url, 8, deadline_s=1)
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=5)
        reverted_after = _wait_for_settings(url, 256, deadline_s=10)
        assert 0.8 < reverted_after < 3.5  # held until the lease (renewed every 0.67 s) lapsed
    finally:
        if holder is not None and holder.poll() is None:
            holder.kill()
        sim.send_signal(signal.SIGTERM)
        sim.wait(timeout=10)


async def test_a_token_protected_control_api_refuses_without_the_token_and_accepts_with_it(
    tmp_path: Path,
) -> None:
    import aiohttp

    token = "s3cret-control-token-0123"
    server = SimServer(make_core("a100-80g", "llama-2-7b", "fp16", 256), control_token=token)
    runner, url = await _serve(server.app())
    try:
        async with aiohttp.ClientSession() as http:
            for method, path in (("GET", "state"), ("POST", "apply"), ("POST", "lease"), ("DELETE", "lease")):
                async with http.request(method, f"{url}/v1/control/{path}", json={}) as response:
                    assert response.status == 401, path
                    assert response.headers["WWW-Authenticate"] == "Bearer"
            wrong = {"Authorization": "Bearer not-the-token-at-all"}
            async with http.get(f"{url}/v1/control/state", headers=wrong) as response:
                assert response.status == 401
        (tmp_path / "token").write_text(token + "\n")
        client = await _client(url, token_file=str(tmp_path / "token"))
        try:
            result = await client.apply({"max_num_seqs": 64})
            assert result.ok and result.read_back["max_num_seqs"] == 64
        finally:
            await client.close()
    finally:
        await runner.cleanup()
