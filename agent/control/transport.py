"""One JSON-over-HTTP call with errors classified as temporary or permanent."""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from agent.control.base import ControlError


async def call(
    session: aiohttp.ClientSession, method: str, url: str, body: Any = None, timeout_s: float = 2.0
) -> Any:
    """``method url`` with a JSON body; the parsed JSON answer, or a classified :class:`ControlError`."""
    try:
        async with session.request(
            method, url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            text = await resp.text()
            status = resp.status
    except (aiohttp.ClientError, TimeoutError, OSError) as error:
        raise ControlError(f"{method} {url}: {type(error).__name__}: {error}", temporary=True) from None
    if status >= 400:
        detail = text.strip().replace("\n", " ")[:300]
        try:
            doc = json.loads(text)
            if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
                detail = str(doc["error"].get("message", detail))
        except ValueError:
            pass
        temporary = status >= 500 or status == 429
        raise ControlError(f"{method} {url}: HTTP {status}: {detail}", temporary=temporary, status=status)
    if not text.strip():
        return None
    try:
        return json.loads(text)
    except ValueError:
        raise ControlError(f"{method} {url}: answer is not JSON", temporary=False, status=status) from None
