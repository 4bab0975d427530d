"""HMAC-SHA256 signatures in the Standard Webhooks style, and the verifier receivers can use.

Why this scheme: it is what Svix, Standard Webhooks (standardwebhooks.com) and a growing set of receivers
already check, so a receiver need not learn a servepilot-specific format. Every message carries three
headers::

    webhook-id:        msg_<hex>             (stable across retries: the receiver's idempotency key)
    webhook-timestamp: 1719000000            (Unix seconds when this attempt was signed)
    webhook-signature: v1,<base64(HMAC-SHA256(secret, id + "." + timestamp + "." + body))>

The id, the timestamp and the exact body bytes are all inside the MAC, so a captured request cannot be
replayed later (the verifier rejects timestamps outside its window) nor re-targeted with another id or
body. ``webhook-signature`` may hold several space-separated signatures (key rotation); one match is
enough. Secrets are written ``whsec_<base64>`` (the convention) or given as raw bytes.

Rotating a secret without losing a message: put the new secret beside the old one in the secret file
(``whsec_old whsec_new``, by space or newline); every message is then signed with both, so receivers
accept it whether they check the old secret or already the new one. Once every receiver has the new
secret, remove the old one from the file. The sidecar re-reads the file at each config reload.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Mapping, Sequence

SECRET_PREFIX = "whsec_"
DEFAULT_TOLERANCE_S = 300.0
HEADER_ID = "webhook-id"
HEADER_TIMESTAMP = "webhook-timestamp"
HEADER_SIGNATURE = "webhook-signature"


class SignatureError(ValueError):
    """A message that must be rejected; the message says why in one line."""


def decode_secret(text: str) -> bytes:
    """``whsec_<base64>`` -> key bytes; any other non-empty string is used as UTF-8 bytes."""
    text = text.strip()
    if not text:
        raise SignatureError("webhook secret is empty")
    if text.startswith(SECRET_PREFIX):
        try:
            key = base64.b64decode(text[len(SECRET_PREFIX) :], validate=True)
        except binascii.Error:
            raise SignatureError("webhook secret after 'whsec_' is not valid base64") from None
        if not key:
            raise SignatureError("webhook secret after 'whsec_' is empty")
        return key
    return text.encode("utf-8")


def decode_secrets(text: str) -> tuple[bytes, ...]:
    """The secrets of a secret file: several ``whsec_`` secrets separated by whitespace (a rotation in
    progress), else the whole text as one secret (a raw secret may contain spaces)."""
    parts = text.split()
    if len(parts) > 1 and all(part.startswith(SECRET_PREFIX) for part in parts):
        return tuple(dict.fromkeys(decode_secret(part) for part in parts))
    return (decode_secret(text),)


def signature(secret: bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``v1,<base64>`` signature of one attempt."""
    signed = msg_id.encode("utf-8") + b"." + str(int(timestamp)).encode("ascii") + b"." + body
    digest = hmac.new(secret, signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode("ascii")


def sign_headers(secret: bytes | Sequence[bytes], msg_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """The three headers to send with ``body`` (plus the JSON content type); with several secrets, one
    signature per secret, space-separated (key rotation)."""
    secrets = (secret,) if isinstance(secret, bytes) else tuple(secret)
    if not secrets:
        raise SignatureError("no webhook secret to sign with")
    return {
        HEADER_ID: msg_id,
        HEADER_TIMESTAMP: str(int(timestamp)),
        HEADER_SIGNATURE: " ".join(signature(key, msg_id, timestamp, body) for key in secrets),
        "content-type": "application/json",
    }


def verify(
    secret: bytes | Sequence[bytes],
    headers: Mapping[str, str],
    body: bytes,
    *,
    now: float,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
) -> str:
    """Check one received message; return its ``webhook-id`` or raise :class:`SignatureError`.

    ``headers`` is looked up case-insensitively. ``now`` is the receiver's clock (injected, so tests and
    receivers with their own time source agree); timestamps more than ``tolerance_s`` away from it in
    either direction are rejected, which bounds how long a captured request stays replayable. ``secret``
    may be several keys (a receiver accepting the old and the new one while a rotation is in progress).
    Receivers should additionally remember ids they have processed for that window to drop exact
    duplicates (retries after a lost response carry the same id).
    """
    lower = {k.lower(): v for k, v in headers.items()}
    msg_id = lower.get(HEADER_ID, "")
    raw_ts = lower.get(HEADER_TIMESTAMP, "")
    raw_sig = lower.get(HEADER_SIGNATURE, "")
    if not msg_id or not raw_ts or not raw_sig:
        missing = [h for h in (HEADER_ID, HEADER_TIMESTAMP, HEADER_SIGNATURE) if not lower.get(h)]
        raise SignatureError(f"missing header(s): {', '.join(missing)}")
    try:
        timestamp = int(raw_ts)
    except ValueError:
        raise SignatureError(f"webhook-timestamp is not an integer: {raw_ts[:40]!r}") from None
    if abs(now - timestamp) > tolerance_s:
        raise SignatureError(
            f"webhook-timestamp {timestamp} is {now - timestamp:+.0f} s from now, outside ±{tolerance_s:g} s"
        )
    keys = (secret,) if isinstance(secret, bytes) else tuple(secret)
    expected = [signature(key, msg_id, timestamp, body).encode("ascii") for key in keys]
    for candidate in raw_sig.split():
        if candidate.startswith("v1,") and any(
            hmac.compare_digest(candidate.encode("ascii", "replace"), one) for one in expected
        ):
            return msg_id
    raise SignatureError("no webhook-signature matches (wrong secret or modified body)")
