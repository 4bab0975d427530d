"""The committed OpenAPI spec is valid, covers every route, and the server's answers match its schemas."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from openapi_spec_validator import validate
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from simulator.engine import make_core
from simulator.server import SimServer

SPEC_PATH = Path(__file__).parents[2] / "simulator" / "openapi.yaml"
SPEC: dict[str, Any] = yaml.safe_load(SPEC_PATH.read_text(encoding="utf-8"))
REGISTRY = Registry().with_resource(
    "urn:spec", Resource.from_contents(SPEC, default_specification=DRAFT202012)
)


def check(instance: Any, schema_name: str) -> None:
    """Validate ``instance`` against ``#/components/schemas/<schema_name>`` of the spec."""
    schema = {"$ref": f"urn:spec#/components/schemas/{schema_name}"}
    jsonschema.Draft202012Validator(schema, registry=REGISTRY).validate(instance)


def test_spec_is_valid_openapi() -> None:
    validate(SPEC)


def test_every_route_is_in_the_spec() -> None:
    app = SimServer(make_core(), pid=1).app()
    routes = {
        (r.resource.canonical, r.method.lower())
        for r in app.router.routes()
        if r.method != "HEAD" and r.resource
    }
    documented = {(path, method) for path, item in SPEC["paths"].items() for method in item}
    assert routes == documented


def test_schema_check_rejects_a_wrong_shape() -> None:
    with pytest.raises(jsonschema.ValidationError):
        check({"driver_version": "1", "gpus": [{"index": 0}]}, "Nvml")


async def test_json_answers_match_their_schemas(sim: Any) -> None:
    check(await (await sim.get("/v1/models")).json(), "ModelList")
    check(await (await sim.get("/v1/control/state")).json(), "ControlState")
    check(await (await sim.get("/sim/nvml")).json(), "Nvml")
    check(await (await sim.get("/sim/faults")).json(), "Faults")
    check(await (await sim.post("/sim/faults", json={"latency_factor": 2})).json(), "Faults")
    check(
        await (await sim.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})).json(), "Completion"
    )
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    check(await (await sim.post("/v1/chat/completions", json=chat)).json(), "ChatCompletion")
    check(await (await sim.post("/v1/messages", json=chat)).json(), "Message")
    response = {"input": "hi", "max_output_tokens": 2}
    check(await (await sim.post("/v1/responses", json=response)).json(), "Response")


async def test_control_answers_match_their_schemas(sim: Any) -> None:
    apply = {"settings": {"precision": "fp8", "power_limit_w": 300}, "idempotency_key": "a", "lease_s": 60}
    check(apply, "ApplyRequest")
    check(await (await sim.post("/v1/control/apply", json=apply)).json(), "ApplyResult")
    check(await (await sim.post("/v1/control/lease", json={"lease_s": 10})).json(), "LeaseResult")
    check(await (await sim.delete("/v1/control/lease")).json(), "ReleaseResult")
    check(await (await sim.post("/v1/control/apply", json={"settings": {}})).json(), "Error")


async def test_stream_chunks_match_their_schema(sim: Any) -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text = await (await sim.post("/v1/chat/completions", json=body)).text()
    events = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    for event in events[:-1]:
        check(json.loads(event), "StreamChunk")
