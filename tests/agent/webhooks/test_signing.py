from __future__ import annotations

import base64

import pytest

from agent.webhooks.signing import (
    SignatureError,
    decode_secret,
    decode_secrets,
    sign_headers,
    signature,
    verify,
)

SECRET = b"0123456789abcdef0123456789abcdef"
BODY = b'{"alerts":[]}'


def test_signature_matches_the_standard_webhooks_reference_vector() -> None:
    # Test vector from the Standard Webhooks spec repository (standard-webhooks/standard-webhooks, libraries).
    secret = decode_secret("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
    sig = signature(secret, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, b'{"test": 2432232314}')
    assert sig == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def test_verify_accepts_a_fresh_signed_message() -> None:
    headers = sign_headers(SECRET, "msg_1", 1_000_000, BODY)
    assert verify(SECRET, headers, BODY, now=1_000_010) == "msg_1"


def test_verify_rejects_a_modified_body() -> None:
    headers = sign_headers(SECRET, "msg_1", 1_000_000, BODY)
    with pytest.raises(SignatureError, match="no webhook-signature matches"):
        verify(SECRET, headers, BODY + b" ", now=1_000_000)


def test_verify_rejects_a_replay_outside_the_window() -> None:
    headers = sign_headers(SECRET, "msg_1", 1_000_000, BODY)
    with pytest.raises(SignatureError, match="outside"):
        verify(SECRET, headers, BODY, now=1_000_000 + 301, tolerance_s=300)


def test_verify_rejects_a_timestamp_from_the_future() -> None:
    headers = sign_headers(SECRET, "msg_1", 1_000_000, BODY)
    with pytest.raises(SignatureError, match="outside"):
        verify(SECRET, headers, BODY, now=1_000_000 - 301)


def test_verify_rejects_another_id_with_the_same_signature() -> None:
    headers = sign_headers(SECRET, "msg_1", 1_000_000, BODY)
    headers["webhook-id"] = "msg_2"
    with pytest.raises(SignatureError):
        verify(SECRET, headers, BODY, now=1_000_000)


def test_verify_accepts_any_of_several_signatures_during_key_rotation() -> None:
    headers = sign_headers(SECRET, "msg_1", 1_000_000, BODY)
    headers["webhook-signature"] = "v1,bm90LWl0 " + headers["webhook-signature"]
    assert verify(SECRET, headers, BODY, now=1_000_000) == "msg_1"


def test_verify_names_missing_headers() -> None:
    with pytest.raises(SignatureError, match="webhook-timestamp, webhook-signature"):
        verify(SECRET, {"Webhook-Id": "msg_1"}, BODY, now=0)


def test_headers_are_matched_case_insensitively() -> None:
    headers = {k.title(): v for k, v in sign_headers(SECRET, "msg_1", 5, BODY).items()}
    assert verify(SECRET, headers, BODY, now=5) == "msg_1"


def test_whsec_secret_is_base64_decoded() -> None:
    assert decode_secret("whsec_" + base64.b64encode(b"key").decode()) == b"key"


def test_bad_whsec_secret_is_a_one_line_error() -> None:
    with pytest.raises(SignatureError, match="not valid base64"):
        decode_secret("whsec_***")


def test_a_secret_file_with_two_whsec_secrets_is_a_rotation_in_progress() -> None:
    old, new = (base64.b64encode(key).decode() for key in (b"old-key", b"new-key"))
    assert decode_secrets(f"whsec_{old}\nwhsec_{new}\n") == (b"old-key", b"new-key")
    assert decode_secrets(f"whsec_{old} whsec_{old}") == (b"old-key",)  # the same one twice: one
    assert decode_secrets("a raw secret with spaces\n") == (b"a raw secret with spaces",)
    with pytest.raises(SignatureError, match="not valid base64"):
        decode_secrets(f"whsec_{old} whsec_***")


def test_a_message_signed_with_two_secrets_passes_a_receiver_holding_either() -> None:
    old, new, other = b"o" * 32, b"n" * 32, b"x" * 32
    headers = sign_headers((old, new), "msg_1", 1_000, BODY)
    assert len(headers["webhook-signature"].split()) == 2
    assert verify(old, headers, BODY, now=1_000) == "msg_1"
    assert verify(new, headers, BODY, now=1_000) == "msg_1"
    assert verify((other, new), headers, BODY, now=1_000) == "msg_1"  # a receiver mid-rotation too
    with pytest.raises(SignatureError, match="no webhook-signature matches"):
        verify(other, headers, BODY, now=1_000)
    with pytest.raises(SignatureError, match="no webhook secret"):
        sign_headers((), "msg_1", 1_000, BODY)
