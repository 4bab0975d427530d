"""What the gate sends upstream in place of the client's body (``Forwarder.body_for``): pure, no sockets."""

from __future__ import annotations

import json
import random
from typing import Any

from agent.config import GateConfig
from agent.gate.forward import Forwarder
from agent.gate.openai import RequestInfo, parse_request

UPSTREAMS = {"primary": "http://127.0.0.1:9", "small": "http://127.0.0.1:10"}


def _forwarder(**settings: Any) -> Forwarder:
    cfg = GateConfig(enabled=True, upstreams=UPSTREAMS, **settings)
    unused: Any = None  # body_for reads only the config
    return Forwarder(lambda: cfg, unused, unused, unused, unused, unused, lambda: 0.0, random.Random(0))


def test_the_model_and_the_class_are_set_together_and_the_rest_is_kept() -> None:
    fwd = _forwarder(upstream_models={"small": "tiny"}, engine_priority={"small": "sglang"})
    body = json.dumps({"model": "big", "prompt": "hi", "max_tokens": 4, "priority": 50}).encode()
    info = parse_request("/v1/completions", body)
    sent = json.loads(fwd.body_for("small", body, info, "low"))
    assert sent == {"model": "tiny", "prompt": "hi", "max_tokens": 4, "priority": -1}
    assert fwd.body_for("primary", body, info, "low") is body  # neither configured there


def test_an_unadmitted_request_or_a_body_that_is_not_a_json_object_goes_as_it_came() -> None:
    fwd = _forwarder(engine_priority={"primary": {"high": 9, "normal": 5, "low": 1}})
    body = b'{"model": "m", "input": "x"}'
    assert fwd.body_for("primary", body, RequestInfo(), "") is body  # passed through, never admitted
    assert json.loads(fwd.body_for("primary", body, RequestInfo(), "high"))["priority"] == 9
    form = b'--boundary\r\nContent-Disposition: form-data; name="file"\r\n\r\n\x00\xff\r\n--boundary--'
    assert fwd.body_for("primary", form, RequestInfo(stream=False), "high") is form  # an audio upload
    broken = b'{"model": "m", "input": '
    assert fwd.body_for("primary", broken, RequestInfo(), "high") is broken  # the engine judges it
    assert fwd.body_for("primary", b"", RequestInfo(), "high") == b""
