"""``servepilot admin``: the override routes from the command line, with the sidecar config's address and
token, against the real routes (agent/admin.py) on loopback."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import pytest
import trustme
import yaml

from agent import config as agent_config
from agent.audit import AuditLog
from agent.cli import UsageError, build_parser, main
from agent.commands.admin import admin_url, call_for, parse_value, target_for
from agent.config import Config
from agent.modes import Actuation
from agent.sidecar import Sidecar
from tests.agent.test_admin import TOKEN, admin  # noqa: F401 - the routes on loopback, a fixture
from tests.agent.test_sidecar import OneValue


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["admin", *argv])


@pytest.mark.parametrize(
    ("argv", "method", "path", "body"),
    [
        (["state"], "GET", "/api/admin/state", None),
        (["pause"], "POST", "/api/admin/pause", None),
        (["resume"], "POST", "/api/admin/resume", None),
        (["reload"], "POST", "/api/admin/reload", None),
        (
            ["pin", "batch.max_in_flight", "32"],
            "POST",
            "/api/admin/pin",
            {"knob": "batch.max_in_flight", "value": 32},
        ),
        (
            ["pin", "route.upstream", "fp8"],
            "POST",
            "/api/admin/pin",
            {"knob": "route.upstream", "value": "fp8"},
        ),
        (["unpin", "gpu.sm_clock_mhz"], "DELETE", "/api/admin/pin/gpu.sm_clock_mhz", None),
        (["unpin", "a/b"], "DELETE", "/api/admin/pin/a%2Fb", None),
        (["breaker", "2"], "POST", "/api/admin/breaker", {"level": 2}),
        (["breaker", "release"], "POST", "/api/admin/breaker", {"level": None}),
        (["canary"], "GET", "/api/admin/canary", None),
        (["canary", "start"], "POST", "/api/admin/canary", None),
        (["canary", "abort"], "DELETE", "/api/admin/canary", None),
        (["actions", "--limit", "5"], "GET", "/api/actions?limit=5", None),
    ],
)
def test_each_action_is_its_route(argv: list[str], method: str, path: str, body: object) -> None:
    request = call_for(_args(*argv))
    assert (request.method, request.path, request.body) == (method, path, body)


@pytest.mark.parametrize("argv", [["breaker", "high"], ["actions", "--limit", "0"]])
def test_values_no_route_takes_are_usage_errors(argv: list[str]) -> None:
    with pytest.raises(UsageError):
        call_for(_args(*argv))


def test_a_pin_value_is_a_number_or_boolean_where_it_reads_as_one() -> None:
    assert parse_value("32") == 32 and isinstance(parse_value("32"), int)
    assert parse_value("0.5") == 0.5
    assert parse_value("true") is True
    assert parse_value("fp8") == "fp8"
    assert parse_value('"32"') == '"32"'  # a JSON string is taken as typed, quotes and all
    assert parse_value("[1]") == "[1]"
    assert parse_value("NaN") == "NaN" and parse_value("Infinity") == "Infinity"


def test_the_url_follows_the_config() -> None:
    assert admin_url(Config()) == "http://127.0.0.1:9402"  # its own loopback listener by default
    wildcard = Config.model_validate({"agent": {"admin_listen_host": "0.0.0.0", "admin_listen_port": 9500}})
    assert admin_url(wildcard) == "http://127.0.0.1:9500"
    v6 = Config.model_validate({"agent": {"admin_listen_host": "::1", "admin_listen_port": 9500}})
    assert admin_url(v6) == "http://[::1]:9500"
    mounted = Config.model_validate(
        {"agent": {"admin_listen_port": None, "tls_cert_file": "c.pem", "tls_key_file": "k.pem"}}
    )
    assert admin_url(mounted) == "https://127.0.0.1:9400"  # on the agent API, with its TLS


def test_where_and_which_token_are_said_or_it_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="--config FILE"):
        target_for(_args("pause"), {})
    with pytest.raises(UsageError, match="admin_token_file"):
        target_for(_args("--url", "http://127.0.0.1:1", "pause"), {})
    short = tmp_path / "short"
    short.write_text("abc\n")
    with pytest.raises(UsageError, match="shorter than 16"):
        target_for(_args("--url", "http://127.0.0.1:1", "--token-file", str(short), "pause"), {})
    with pytest.raises(UsageError, match="--cacert"):
        target_for(
            _args("--url", "https://127.0.0.1:1", "--cacert", str(tmp_path / "none.pem"), "actions"), {}
        )
    # the audit log's recent actions are open, as on the route
    assert target_for(_args("--url", "http://127.0.0.1:1/", "actions"), {}).url == "http://127.0.0.1:1"


@pytest.fixture
def sidecar(admin: tuple[str, Actuation, AuditLog], tmp_path: Path) -> tuple[Path, Actuation]:  # noqa: F811
    """The real admin routes on loopback (tests/agent/test_admin.py) and a sidecar config that names
    their port and token file."""
    url, actuation, _ = admin
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    config = tmp_path / "config.yaml"
    port = int(url.rsplit(":", 1)[1])
    config.write_text(f"agent:\n  admin_listen_port: {port}\nactuators:\n  admin_token_file: {token}\n")
    return config, actuation


async def _cli(*argv: str) -> int:
    """``servepilot admin ...`` as the shell runs it (its own event loop, in a thread)."""
    return await asyncio.to_thread(main, ["admin", *argv])


async def test_pause_pin_and_state_through_the_configs_address_and_token(
    sidecar: tuple[Path, Actuation], capsys: pytest.CaptureFixture[str]
) -> None:
    config, actuation = sidecar
    assert await _cli("--config", str(config), "pause") == 0
    assert actuation.paused and json.loads(capsys.readouterr().out)["paused"] is True
    assert await _cli("-c", str(config), "pin", "batch.max_in_flight", "32") == 0
    assert actuation.pins == {"batch.max_in_flight": 32}
    capsys.readouterr()
    assert await _cli("-c", str(config), "state") == 0
    state = json.loads(capsys.readouterr().out)
    assert state["pins"] == {"batch.max_in_flight": 32} and state["paused"] is True
    assert await _cli("-c", str(config), "unpin", "batch.max_in_flight") == 0
    assert await _cli("-c", str(config), "resume") == 0
    assert actuation.pins == {} and not actuation.paused


async def test_actions_as_a_table_one_line_each_newest_first(
    sidecar: tuple[Path, Actuation], capsys: pytest.CaptureFixture[str]
) -> None:
    """What an operator reads through weeks of advise mode: time, knob, the move, result, policy, why."""
    config, _ = sidecar
    assert await _cli("-c", str(config), "pin", "batch.max_in_flight", "32") == 0
    assert await _cli("-c", str(config), "pause") == 0
    capsys.readouterr()
    assert await _cli("-c", str(config), "actions", "--table") == 0
    lines = capsys.readouterr().out.splitlines()
    header, newest, pin = lines[0], lines[1], lines[2]
    assert header.split() == ["TIME", "(UTC)", "KNOB", "FROM", "TO", "RESULT", "POLICY", "REASON"]
    assert newest.split()[2:7] == ["actuation.paused", "false", "true", "ok", "operator"]
    assert newest.endswith("actuation paused by an operator (admin API, from 127.0.0.1)")
    assert pin.split()[2:7] == ["batch.max_in_flight", "-", "32", "ok", "operator"]  # a pin has no from
    for column in ("TO", "RESULT", "REASON"):  # padded into columns
        assert newest[header.index(column) - 1] == pin[header.index(column) - 1] == " "
    assert len(lines) == 3


async def test_a_refusal_is_exit_1_with_the_agents_reason_on_one_line(
    sidecar: tuple[Path, Actuation], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config, actuation = sidecar
    assert await _cli("-c", str(config), "pin", "batch.max_in_flight", "100000") == 1
    err = capsys.readouterr().err
    assert err.startswith("servepilot admin: 400 ") and "512" in err and err.count("\n") == 1
    assert actuation.pins == {}
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-token-0123456789")
    assert await _cli("-c", str(config), "--token-file", str(wrong), "pause") == 1
    assert "401 missing or wrong bearer token" in capsys.readouterr().err
    assert not actuation.paused
    assert await _cli("-c", str(config), "canary", "start") == 1  # this agent runs no canary
    assert "404 the precision canary is disabled: set canary.enabled" in capsys.readouterr().err


async def test_a_sidecar_that_is_not_there_is_exit_1_naming_the_address(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert await _cli("--url", f"http://127.0.0.1:{port}", "actions") == 1
    assert f"cannot reach the sidecar at http://127.0.0.1:{port}" in capsys.readouterr().err


async def test_bad_input_is_exit_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert await _cli("pause") == 2
    err = capsys.readouterr().err
    assert err.startswith("servepilot admin: ") and err.count("\n") == 1


def _tls_sidecar_config(tmp_path: Path, **agent: object) -> tuple[Path, trustme.CA]:
    """A sidecar config with admin on its API listener over TLS (``admin_listen_port: null``), the
    certificate from a test CA (written to ca.pem), and ``agent`` settings besides."""
    from agent.engines.launcher import free_port

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    cert.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    (tmp_path / "token").write_text(TOKEN)
    doc = {
        "agent": {
            "listen_port": free_port(),
            "admin_listen_port": None,
            "tls_cert_file": str(tmp_path / "cert.pem"),
            "tls_key_file": str(tmp_path / "key.pem"),
            **agent,
        },
        "actuators": {"admin_token_file": str(tmp_path / "token")},
        "audit": {"path": str(tmp_path / "audit.jsonl")},
        "forecast": {"enabled": False},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path, ca


async def test_a_sidecar_serving_admin_on_its_tls_api_listener(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A real sidecar with admin on its API listener over TLS: the command finds it at https on the API
    port, verifies it with ``--cacert`` and refuses it without."""
    path, _ = _tls_sidecar_config(tmp_path)
    sidecar = Sidecar(agent_config.load(path, {}), collectors=[OneValue()])
    await sidecar.start()
    try:
        assert await _cli("-c", str(path), "--cacert", str(tmp_path / "ca.pem"), "pause") == 0
        assert sidecar.knobs.actuation.paused
        assert json.loads(capsys.readouterr().out)["paused"] is True
        assert await _cli("-c", str(path), "--insecure", "resume") == 0
        assert not sidecar.knobs.actuation.paused
        capsys.readouterr()
        assert await _cli("-c", str(path), "state") == 1  # the test CA is not among the system's
        assert "certificate verify failed" in capsys.readouterr().err
    finally:
        await sidecar.stop()


async def test_under_mutual_tls_the_command_presents_its_certificate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``agent.tls_client_ca_file`` set: without ``--cert``/``--key`` the agent answers 403 (exit 1,
    the reason on stderr); with a certificate its CA signed, the override goes through."""
    clients = trustme.CA()
    clients.cert_pem.write_to_path(str(tmp_path / "clients.pem"))
    operator = clients.issue_cert("operator@example.com")
    operator.cert_chain_pems[0].write_to_path(str(tmp_path / "op.pem"))
    operator.private_key_pem.write_to_path(str(tmp_path / "op.key"))
    path, _ = _tls_sidecar_config(tmp_path, tls_client_ca_file=str(tmp_path / "clients.pem"))
    sidecar = Sidecar(agent_config.load(path, {}), collectors=[OneValue()])
    await sidecar.start()
    cacert = ("--cacert", str(tmp_path / "ca.pem"))
    try:
        assert await _cli("-c", str(path), *cacert, "pause") == 1
        assert "403" in capsys.readouterr().err and not sidecar.knobs.actuation.paused
        mine = ("--cert", str(tmp_path / "op.pem"), "--key", str(tmp_path / "op.key"))
        assert await _cli("-c", str(path), *cacert, *mine, "pause") == 0
        assert sidecar.knobs.actuation.paused
    finally:
        await sidecar.stop()


def test_cert_and_key_go_together_and_must_be_files(tmp_path: Path) -> None:
    (tmp_path / "op.pem").write_text("x")
    with pytest.raises(UsageError, match="--cert and --key go together"):
        target_for(_args("--url", "https://127.0.0.1:1", "--cert", str(tmp_path / "op.pem"), "actions"), {})
    with pytest.raises(UsageError, match=r"--key '.*missing\.key' is not a file"):
        target_for(
            _args(
                "--url", "https://127.0.0.1:1", "--cert", str(tmp_path / "op.pem"),
                "--key", str(tmp_path / "missing.key"), "actions",
            ),
            {},
        )  # fmt: skip
