"""Per-round session tokens for the stage link: HMAC-SHA256 over (run, round, device, times, nonce).

The ServerApp and the StageServer share a master secret; devices never see it. Each round the
ServerApp issues one token per sampled device and sends it in the round's Flower message; the
device presents it when it opens its stage-link session, and the StageServer checks the MAC,
the run and round it has begun, the device, the expiry, that it was issued after the round
began (so a round begun again, by a resumed run, takes only fresh tokens), and that no token
opened a session for this device in this round before (a `TokenLedger`).

A token is ``v2.<run_id>.<round>.<device_id>.<issued>.<expires>.<nonce>.<mac>``: run and
device in URL-safe base64 (no padding), round and times (unix seconds) in decimal, so it fits
in gRPC metadata and Flower config strings. Its MAC key is derived from the master secret for
this one purpose, so no other MAC fedpipe makes with the secret (control calls) can pass for a
token.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
import threading
import time
from dataclasses import dataclass

__all__ = [
    "InvalidTokenError",
    "TokenClaims",
    "TokenLedger",
    "check_secret",
    "derive_key",
    "issue_token",
    "new_secret",
    "verify_token",
]

_VERSION = "v2"
_FIELDS = 8
_NONCE_BYTES = 16
_MIN_SECRET_BYTES = 16
DEFAULT_TTL_S = 3600.0
CLOCK_SKEW_S = 30.0  # how far the ServerApp's clock may be behind the StageServer's


class InvalidTokenError(ValueError):
    """A session token is malformed, forged, expired, used, or for another run, round or device."""


@dataclass(frozen=True)
class TokenClaims:
    """What a verified token says: who may open a session, for which run and round, until when."""

    run_id: str
    round: int
    device_id: str
    issued: int  # unix seconds
    expires: int  # unix seconds
    nonce: str


def new_secret() -> str:
    """A fresh 256-bit shared secret, URL-safe base64 (store it like a password)."""
    return secrets.token_urlsafe(32)


def derive_key(secret: bytes | str, purpose: str) -> bytes:
    """A key for one ``purpose`` (``token``, ``control``) from the master secret."""
    return hmac.new(_key(secret), f"fedpipe {purpose}".encode(), hashlib.sha256).digest()


def issue_token(
    secret: bytes | str,
    *,
    run_id: str,
    round: int,
    device_id: str,
    ttl_s: float = DEFAULT_TTL_S,
    now: float | None = None,
) -> str:
    """Issue the token that lets ``device_id`` open one stage session in ``round`` of ``run_id``.

    It expires ``ttl_s`` seconds from ``now`` (the round's timeout is a good ``ttl_s``).
    """
    if round < 0:
        raise ValueError(f"round must be >= 0, got {round}")
    if ttl_s <= 0:
        raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
    issued = int(time.time() if now is None else now)
    expires = int(issued + ttl_s)
    nonce = _b64(secrets.token_bytes(_NONCE_BYTES))
    fields = [_VERSION, _b64(run_id.encode()), str(round), _b64(device_id.encode())]
    body = ".".join([*fields, str(issued), str(expires), nonce])
    return f"{body}.{_b64(_mac(derive_key(secret, 'token'), body))}"


def verify_token(
    secret: bytes | str,
    token: str,
    *,
    round: int,
    run_id: str | None = None,
    device_id: str | None = None,
    now: float | None = None,
    not_before: float = 0.0,
) -> TokenClaims:
    """Check the MAC (in constant time), then the run, round, device and expiry.

    ``not_before`` is when the round began on the StageServer: a token issued earlier (less
    ``CLOCK_SKEW_S``) belongs to an earlier attempt at the round and is refused. Raises
    `InvalidTokenError` saying which check failed; no claim is trusted before the MAC.
    """
    parts = token.split(".") if isinstance(token, str) and token.isascii() else []
    if parts and parts[0] != _VERSION and parts[0].startswith("v"):
        raise InvalidTokenError(
            f"session token format {parts[0]} is not accepted (this StageServer takes "
            f"{_VERSION}): run the same fedpipe version on the ServerApp and the StageServer"
        )
    if len(parts) != _FIELDS or parts[0] != _VERSION:
        raise InvalidTokenError(
            f"malformed session token: want {_FIELDS} '.'-separated {_VERSION} fields, got "
            f"{len(parts)} (the ServerApp sends it in the round config as 'token')"
        )
    body, mac = ".".join(parts[:-1]), _unb64(parts[-1], "mac")
    if not hmac.compare_digest(mac, _mac(derive_key(secret, "token"), body)):
        raise InvalidTokenError("session token MAC does not match: forged or another secret")
    claims = TokenClaims(
        run_id=_text(parts[1], "run_id"),
        round=_number(parts[2], "round"),
        device_id=_text(parts[3], "device_id"),
        issued=_number(parts[4], "issue time"),
        expires=_number(parts[5], "expiry"),
        nonce=parts[6],
    )
    _check_claims(claims, round=round, run_id=run_id, device_id=device_id, now=now)
    if claims.issued < not_before - CLOCK_SKEW_S:
        raise InvalidTokenError(
            f"session token was issued {not_before - claims.issued:.0f} s before round "
            f"{round} began: it is from an earlier attempt at this round (a replay?)"
        )
    return claims


def _check_claims(
    claims: TokenClaims, *, round: int, run_id: str | None, device_id: str | None, now: float | None
) -> None:
    if run_id is not None and claims.run_id != run_id:
        raise InvalidTokenError(
            f"session token is for run {claims.run_id!r}, this StageServer serves run {run_id!r}"
        )
    if claims.round != round:
        raise InvalidTokenError(f"session token is for round {claims.round}, this is round {round}")
    if device_id is not None and not hmac.compare_digest(
        claims.device_id.encode(), device_id.encode()
    ):
        raise InvalidTokenError(
            f"session token is for device {claims.device_id!r}, not {device_id!r}"
        )
    now = time.time() if now is None else now
    if now > claims.expires:
        raise InvalidTokenError(
            f"session token expired {now - claims.expires:.0f} s ago (round {claims.round}): "
            "the round outlived its timeout; the next round brings a fresh token"
        )


class TokenLedger:
    """The tokens a StageServer accepted: each token opens one session, ever, and each
    (run, round, device) one session per attempt at the round.

    ``epoch`` tells attempts at one round apart (when the round began): a resumed run that
    begins a round again gets fresh tokens, and `verify_token`'s ``not_before`` refuses the
    old ones. A token is also remembered by itself (its nonce) until it expires, so no token is
    accepted twice whatever the epoch. Entries are kept until their token expires (then it is
    refused anyway), so the ledger holds at most the tokens of the rounds still open.
    """

    def __init__(self) -> None:
        # (run, round, device, epoch) -> (nonce, expires)
        self._used: dict[tuple[str, int, str, float], tuple[str, int]] = {}
        self._tokens: dict[str, int] = {}  # nonce -> expires: every token accepted
        self._lock = threading.Lock()

    def claim(self, claims: TokenClaims, *, epoch: float = 0.0, now: float | None = None) -> None:
        """Record ``claims`` as used; raise `InvalidTokenError` if the token, or its
        (run, round, device) in this attempt at the round, was."""
        now = time.time() if now is None else now
        key = (claims.run_id, claims.round, claims.device_id, epoch)
        with self._lock:
            self._used = {k: v for k, v in self._used.items() if v[1] >= now}
            self._tokens = {n: e for n, e in self._tokens.items() if e >= now}
            if claims.nonce in self._tokens:
                raise InvalidTokenError(
                    f"this session token for device {claims.device_id!r} in round "
                    f"{claims.round} was already used: a token opens one session"
                )
            if key in self._used:
                raise InvalidTokenError(
                    f"a session token for device {claims.device_id!r} in round {claims.round} "
                    "was already used: one session per device and round (a replay, or a device "
                    "that restarted mid-round; it rejoins next round)"
                )
            self._used[key] = (claims.nonce, claims.expires)
            self._tokens[claims.nonce] = claims.expires

    def __len__(self) -> int:
        with self._lock:
            return len(self._used)


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


def _text(text: str, field: str) -> str:
    try:
        return _unb64(text, field).decode("utf-8", errors="strict")
    except UnicodeDecodeError as err:
        raise InvalidTokenError(f"session token field {field} is not UTF-8") from err


def _number(text: str, field: str) -> int:
    if not text.isdigit():
        raise InvalidTokenError(f"session token {field} {text!r} is not a number")
    return int(text)
