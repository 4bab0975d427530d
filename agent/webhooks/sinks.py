"""Where alerts go, and what each receiver's message looks like. Pure: rendering only, no I/O.

* :class:`AlertmanagerSink`: Alertmanager's v2 API, ``POST /api/v2/alerts`` with a JSON array of
  ``{labels, annotations, startsAt, endsAt, generatorURL}``. A firing alert carries ``endsAt`` a few
  resend periods ahead, so if the agent dies Alertmanager resolves it by itself instead of paging for
  ever; a resolved alert carries its real end time. Alertmanager does its own grouping and dedup.
* :class:`GenericSink`: one JSON envelope per group of alerts (grouped by ``group_by`` labels, like an
  Alertmanager route), signed at send time in the Standard Webhooks style (:mod:`.signing`).

A message id is a hash of the sink and its content, so enqueuing the same transition twice (for
example after a restart) yields the same id and the outbox keeps one copy.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from agent.webhooks.alerts import Alert
from agent.webhooks.signing import sign_headers


def rfc3339(ts: float) -> str:
    """Unix seconds -> RFC 3339 UTC with milliseconds, the format Alertmanager expects."""
    return datetime.fromtimestamp(ts, tz=UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def message_id(sink: str, body: bytes) -> str:
    return "msg_" + hashlib.sha256(sink.encode("utf-8") + b"\x00" + body).hexdigest()[:32]


class Sink(Protocol):
    """A receiver: renders alerts into message bodies and gives the headers of one attempt."""

    @property
    def name(self) -> str: ...

    @property
    def url(self) -> str: ...

    def render(self, alerts: Sequence[Alert], now: float) -> list[bytes]: ...

    def headers(self, msg_id: str, body: bytes, now: float) -> dict[str, str]: ...


def _dumps(data: Any) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode("utf-8")


@dataclass(frozen=True)
class AlertmanagerSink:
    """Alertmanager v2. ``base_url`` is e.g. ``http://alertmanager:9093``."""

    base_url: str
    generator_url: str = ""
    resend_s: float = 60.0
    name: str = "alertmanager"

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + "/api/v2/alerts"

    def render(self, alerts: Sequence[Alert], now: float) -> list[bytes]:
        if not alerts:
            return []
        items: list[dict[str, Any]] = []
        for alert in alerts:
            # 4 resend periods of silence before Alertmanager resolves on its own (Prometheus uses 4 too).
            ends = alert.ends_at if alert.ends_at is not None else now + 4 * self.resend_s
            item: dict[str, Any] = {
                "labels": dict(alert.labels),
                "annotations": dict(alert.annotations),
                "startsAt": rfc3339(alert.starts_at),
                "endsAt": rfc3339(ends),
            }
            if self.generator_url:
                item["generatorURL"] = self.generator_url
            items.append(item)
        return [_dumps(items)]

    def headers(self, msg_id: str, body: bytes, now: float) -> dict[str, str]:
        return {"content-type": "application/json"}


@dataclass(frozen=True)
class GenericSink:
    """A generic HTTPS endpoint receiving signed JSON; see :func:`agent.webhooks.signing.verify`.

    ``secret``: one key, or several while a rotation is in progress (each message then carries one
    signature per key)."""

    url: str
    secret: bytes | tuple[bytes, ...]
    group_by: tuple[str, ...] = ("alertname",)
    name: str = "generic"

    def render(self, alerts: Sequence[Alert], now: float) -> list[bytes]:
        groups: dict[tuple[str, ...], list[Alert]] = {}
        for alert in alerts:
            key = tuple(alert.labels.get(label, "") for label in self.group_by)
            groups.setdefault(key, []).append(alert)
        bodies = []
        for key, members in sorted(groups.items()):
            firing = [a for a in members if a.ends_at is None]
            envelope = {
                "type": "servepilot.alerts",
                "version": 1,
                "status": "firing" if firing else "resolved",
                "group": dict(zip(self.group_by, key, strict=True)),
                "alerts": [a.to_json() for a in members],
            }
            bodies.append(_dumps(envelope))
        return bodies

    def headers(self, msg_id: str, body: bytes, now: float) -> dict[str, str]:
        return sign_headers(self.secret, msg_id, int(now), body)
