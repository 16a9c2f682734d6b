"""Per-round session tokens for the stage link: HMAC-SHA256 over (run, round, device, nonce).

The ServerApp and the StageServer share a secret. Each round the ServerApp issues one
token per sampled device and sends it in the round config; the device presents it when
it opens its stage-link session, and the StageServer verifies it for the current round.
A token is ``v1.<run_id>.<round>.<device_id>.<nonce>.<mac>`` with every field URL-safe
base64 (no padding), so it fits in gRPC metadata and Flower config strings.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
from dataclasses import dataclass

__all__ = [
    "InvalidTokenError",
    "TokenClaims",
    "check_secret",
    "issue_token",
    "new_secret",
    "verify_token",
]

_VERSION = "v1"
_NONCE_BYTES = 16
_MIN_SECRET_BYTES = 16


class InvalidTokenError(ValueError):
    """A session token is malformed, forged, or for another round or device."""


@dataclass(frozen=True)
class TokenClaims:
    """What a verified token says: who may open a session, for which run and round."""

    run_id: str
    round: int
    device_id: str
    nonce: str


def new_secret() -> str:
    """A fresh 256-bit shared secret, URL-safe base64 (store it like a password)."""
    return secrets.token_urlsafe(32)


def issue_token(secret: bytes | str, *, run_id: str, round: int, device_id: str) -> str:
    """Issue the token that lets ``device_id`` open a stage session in ``round``."""
    if round < 0:
        raise ValueError(f"round must be >= 0, got {round}")
    nonce = _b64(secrets.token_bytes(_NONCE_BYTES))
    fields = [_VERSION, _b64(run_id.encode()), str(round), _b64(device_id.encode()), nonce]
    body = ".".join(fields)
    return f"{body}.{_b64(_mac(_key(secret), body))}"


def verify_token(
    secret: bytes | str, token: str, *, round: int, device_id: str | None = None
) -> TokenClaims:
    """Check the MAC (in constant time), the round and, if given, the device.

    Raises `InvalidTokenError` saying which check failed; the MAC is checked before any
    claim is trusted.
    """
    parts = token.split(".") if isinstance(token, str) and token.isascii() else []
    if len(parts) != 6 or parts[0] != _VERSION:
        raise InvalidTokenError(f"malformed session token: want 6 '.'-separated {_VERSION} fields")
    body, mac = ".".join(parts[:5]), _unb64(parts[5], "mac")
    if not hmac.compare_digest(mac, _mac(_key(secret), body)):
        raise InvalidTokenError("session token MAC does not match: forged or another secret")
    claims = TokenClaims(
        run_id=_unb64(parts[1], "run_id").decode("utf-8", errors="strict"),
        round=_round(parts[2]),
        device_id=_unb64(parts[3], "device_id").decode("utf-8", errors="strict"),
        nonce=parts[4],
    )
    if claims.round != round:
        raise InvalidTokenError(f"session token is for round {claims.round}, this is round {round}")
    if device_id is not None and not hmac.compare_digest(
        claims.device_id.encode(), device_id.encode()
    ):
        raise InvalidTokenError(
            f"session token is for device {claims.device_id!r}, not {device_id!r}"
        )
    return claims


def check_secret(secret: bytes | str) -> None:
    """Raise ValueError unless ``secret`` is long enough to key session tokens."""
    _key(secret)


def _key(secret: bytes | str) -> bytes:
    key = secret.encode() if isinstance(secret, str) else bytes(secret)
    if len(key) < _MIN_SECRET_BYTES:
        raise ValueError(
            f"secret has {len(key)} bytes, need at least {_MIN_SECRET_BYTES}: use new_secret()"
        )
    return key


def _mac(key: bytes, body: str) -> bytes:
    return hmac.new(key, body.encode("ascii"), hashlib.sha256).digest()


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def _unb64(text: str, field: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError) as err:
        raise InvalidTokenError(f"session token field {field} is not URL-safe base64") from err


def _round(text: str) -> int:
    if not text.isdigit():
        raise InvalidTokenError(f"session token round {text!r} is not a number")
    return int(text)
