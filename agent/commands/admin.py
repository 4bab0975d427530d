"""``servepilot admin ACTION``: the operator overrides of a running sidecar, from the pod's shell.

The override routes (agent/admin.py) listen on loopback and want the bearer token from a file: from a
workstation that was ``kubectl exec``, a token copied into a ``curl`` line (and the shell history), and a
port looked up. This command reads both from the sidecar's own config, so an on-call engineer types::

    kubectl exec POD -c servepilot -- servepilot admin --config /etc/servepilot/config.yaml pause

It prints the agent's JSON answer and exits 0 when the agent accepted the request, 1 when it refused it
(its one-line reason on stderr: a pin outside the bounds, a wrong token) or could not be reached, and 2
for bad input here (no config and no ``--url``, an unreadable token file).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

if TYPE_CHECKING:
    from agent.config import Config

#: actions whose answer is served without the token (read-only, like ``/api/state``)
OPEN_ACTIONS = frozenset({"actions"})
#: the canary sub-actions and the method of each
CANARY_METHODS = {"status": "GET", "start": "POST", "abort": "DELETE"}
#: the words that release a forced breaker level
RELEASE = frozenset({"release", "none", "null", "auto"})


@dataclass(frozen=True)
class AdminCall:
    """One request to the override routes."""

    method: str
    path: str
    body: dict[str, Any] | None = None


@dataclass(frozen=True)
class Target:
    """Where the override routes listen and the token they want (None: none configured)."""

    url: str
    token: str | None
    verify_tls: bool = True
    #: CA certificates to verify an https agent with, beside the system's (None: the system's only)
    cafile: str | None = None
    #: (certificate, key) PEM files to present to an agent that asks for one (``agent.tls_client_ca_file``)
    client_cert: tuple[str, str] | None = None


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "admin",
        help="pause/resume actuation, pin a knob, force the breaker, ... on a running sidecar",
        description="Send an operator override to a running sidecar's admin routes, with the address and "
        "the bearer token its config names (agent.admin_listen_host/port, actuators.admin_token_file). "
        "Prints the agent's JSON answer. Exit codes: 0 done, 1 refused by the agent or the agent not "
        "reachable (the reason on stderr), 2 bad input.",
    )
    parser.add_argument("--config", "-c", help="the sidecar's YAML config (address and token file)")
    parser.add_argument("--url", help="the admin routes' base URL, instead of the config's")
    parser.add_argument("--token-file", help="bearer token file, instead of actuators.admin_token_file")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the answer")
    parser.add_argument("--cacert", help="with https, CA certificates (PEM) to verify the agent with")
    parser.add_argument(
        "--insecure", action="store_true", help="with https, do not verify the agent's certificate"
    )
    parser.add_argument(
        "--cert",
        help="with https and mutual TLS (agent.tls_client_ca_file), the client certificate (PEM) to present",
    )
    parser.add_argument("--key", help="the private key (PEM) of --cert")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    actions.add_parser("state", help="mode, paused, pins, forced values and bound knobs")
    actions.add_parser("pause", help="stop writing knobs (decisions are still audited, as 'paused')")
    actions.add_parser("resume", help="write knobs again")
    pin = actions.add_parser("pin", help="hold a knob at a value, bypassing the policies (not the bounds)")
    pin.add_argument("knob", help="e.g. batch.max_in_flight, gpu.power_limit_w, route.upstream")
    pin.add_argument("value", help="a number, true/false, or a name (e.g. an upstream)")
    unpin = actions.add_parser("unpin", help="hand a pinned knob back to the policies")
    unpin.add_argument("knob")
    breaker = actions.add_parser("breaker", help="force a breaker level, or release it")
    breaker.add_argument("level", help="0-3, or 'release' to hand the breaker back to its policy")
    canary = actions.add_parser("canary", help="the precision canary: status, start or abort")
    canary.add_argument("what", nargs="?", default="status", choices=sorted(CANARY_METHODS))
    actions.add_parser("reload", help="re-read the config file (as SIGHUP does)")
    recent = actions.add_parser("actions", help="recent actions from the audit log, newest first")
    recent.add_argument("--limit", type=int, default=20, help="how many (1-10000)")
    recent.add_argument(
        "--table",
        action="store_true",
        help="one line per action (UTC time, knob, from, to, result, policy, reason) instead of JSON",
    )
    parser.set_defaults(func=run)


def parse_value(text: str) -> int | float | bool | str:
    """A pin's value as the agent wants it: ``32`` an integer, ``0.5`` a float, ``true`` a boolean, and
    anything else (an upstream's name) the text itself."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    if isinstance(value, float) and not math.isfinite(value):
        return text  # NaN and Infinity are no setting: the agent refuses the text with its reason
    return value if isinstance(value, int | float | bool) else text


def call_for(args: argparse.Namespace) -> AdminCall:
    """The request an action makes; UsageError for a value the routes could never take."""
    from agent.cli import UsageError

    action = args.action
    if action == "state":
        return AdminCall("GET", "/api/admin/state")
    if action in ("pause", "resume", "reload"):
        return AdminCall("POST", f"/api/admin/{action}")
    if action == "pin":
        return AdminCall("POST", "/api/admin/pin", {"knob": args.knob, "value": parse_value(args.value)})
    if action == "unpin":
        return AdminCall("DELETE", "/api/admin/pin/" + quote(args.knob, safe=""))
    if action == "breaker":
        if args.level.lower() in RELEASE:
            return AdminCall("POST", "/api/admin/breaker", {"level": None})
        try:
            return AdminCall("POST", "/api/admin/breaker", {"level": int(args.level)})
        except ValueError:
            raise UsageError(f"breaker level must be 0-3 or 'release', got {args.level!r}") from None
    if action == "canary":
        return AdminCall(CANARY_METHODS[args.what], "/api/admin/canary")
    if action == "actions":
        if not 1 <= args.limit <= 10_000:
            raise UsageError(f"--limit must be 1-10000, got {args.limit}")
        return AdminCall("GET", f"/api/actions?limit={args.limit}")
    raise UsageError(f"unknown action {action!r}")  # argparse's choices keep this unreachable


def target_for(args: argparse.Namespace, environ: Mapping[str, str]) -> Target:
    """The admin URL and token from ``--url``/``--token-file``, else from the sidecar's ``--config``."""
    from agent import config
    from agent.admin import load_token
    from agent.cli import UsageError

    cfg = config.load(args.config, environ) if args.config else None
    url = args.url or (admin_url(cfg) if cfg is not None else None)
    if url is None:
        raise UsageError("say where the sidecar is: --config FILE (its config) or --url URL")
    token_file = args.token_file or (cfg.actuators.admin_token_file if cfg is not None else None)
    token = None
    if token_file is not None:
        try:
            token = load_token(token_file)
        except ValueError as error:
            raise UsageError(str(error)) from None
    elif args.action not in OPEN_ACTIONS:
        raise UsageError(
            "no admin token: the config sets no actuators.admin_token_file and no --token-file was given"
        )
    if args.cacert is not None and not os.path.isfile(args.cacert):
        raise UsageError(f"--cacert {args.cacert!r} is not a file")
    if (args.cert is None) != (args.key is None):
        raise UsageError("--cert and --key go together")
    for flag, name in (("--cert", args.cert), ("--key", args.key)):
        if name is not None and not os.path.isfile(name):
            raise UsageError(f"{flag} {name!r} is not a file")
    client_cert = (args.cert, args.key) if args.cert is not None else None
    return Target(
        url.rstrip("/"), token, verify_tls=not args.insecure, cafile=args.cacert, client_cert=client_cert
    )


def admin_url(cfg: Config) -> str:
    """Where the sidecar started with ``cfg`` serves the admin routes: their own listener (plain HTTP),
    or the agent API's when ``agent.admin_listen_port`` is null (https with a certificate). A wildcard
    address is reached on loopback, where this command runs: in the sidecar's container."""
    agent = cfg.agent
    if agent.admin_listen_port is not None:
        return f"http://{_reachable(agent.admin_listen_host)}:{agent.admin_listen_port}"
    scheme = "https" if agent.tls_cert_file else "http"
    return f"{scheme}://{_reachable(agent.listen_host)}:{agent.listen_port}"


def _reachable(host: str) -> str:
    if host in ("", "0.0.0.0"):  # a listener's wildcard, reached here on loopback
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


async def send(target: Target, request: AdminCall, timeout_s: float) -> tuple[int, Any]:
    """The agent's status and JSON answer (the text, if the answer is not JSON). Raises
    ``aiohttp.ClientError`` or ``TimeoutError`` when the agent cannot be reached, ``ssl.SSLError`` for
    a CA file that holds no certificate or a client certificate that does not load."""
    import ssl

    import aiohttp

    headers = {"Authorization": f"Bearer {target.token}"} if target.token else {}
    tls: ssl.SSLContext | bool = target.verify_tls
    if target.client_cert is not None or (target.verify_tls and target.cafile is not None):
        tls = ssl.create_default_context()
        if not target.verify_tls:
            tls.check_hostname = False
            tls.verify_mode = ssl.CERT_NONE
        elif target.cafile is not None:
            tls.load_verify_locations(target.cafile)
        if target.client_cert is not None:
            tls.load_cert_chain(*target.client_cert)
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session,
        session.request(
            request.method,
            target.url + request.path,
            json=request.body,
            headers=headers,
            ssl=tls,
        ) as response,
    ):
        text = await response.text()
        try:
            return response.status, json.loads(text)
        except ValueError:
            return response.status, text


def run(args: argparse.Namespace) -> int:
    import asyncio
    import sys

    import aiohttp

    from agent.cli import UsageError

    if args.timeout <= 0:
        raise UsageError(f"--timeout must be > 0, got {args.timeout:g}")
    request = call_for(args)
    target = target_for(args, os.environ)
    try:
        status, answer = asyncio.run(send(target, request, args.timeout))
    except (aiohttp.ClientError, TimeoutError, OSError) as error:  # ssl.SSLError is an OSError
        why = str(error) or type(error).__name__
        print(f"servepilot admin: cannot reach the sidecar at {target.url}: {why}", file=sys.stderr)
        return 1
    if status >= 400:
        reason = answer.get("error") if isinstance(answer, dict) else None
        one_line = " ".join(str(reason or answer).split())  # an HTML error page, too
        print(f"servepilot admin: {status} {one_line}", file=sys.stderr)
        return 1
    if getattr(args, "table", False) and isinstance(answer, dict) and isinstance(answer.get("actions"), list):
        print(actions_table(answer["actions"]))
    else:
        print(json.dumps(answer, indent=2, sort_keys=True) if not isinstance(answer, str) else answer)
    return 0


def actions_table(actions: list[dict[str, object]]) -> str:
    """The audit records as an operator reads them in a terminal, newest first as served: the columns
    padded to their widest cell, the reason last and whole (it is the line's point)."""
    from datetime import UTC, datetime

    def when(record: dict[str, object]) -> str:
        stamp = record.get("time")
        if not isinstance(stamp, int | float):
            return "?"
        return datetime.fromtimestamp(stamp, UTC).strftime("%Y-%m-%d %H:%M:%S")

    def value(v: object) -> str:
        return "-" if v is None else v if isinstance(v, str) else json.dumps(v, separators=(",", ":"))

    rows: list[tuple[str, ...]] = [("TIME (UTC)", "KNOB", "FROM", "TO", "RESULT", "POLICY", "REASON")]
    for record in actions:
        moved = (value(record.get("from")), value(record.get("to")))
        cells = (record.get("result"), record.get("policy"), record.get("reason"))
        rows.append((when(record), str(record.get("knob")), *moved, *(str(c) for c in cells)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)) + "  " + row[-1]
        for row in rows
    )
