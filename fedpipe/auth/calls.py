"""Control calls authenticated by a MAC of the request, never by sending the secret.

The ServerApp signs each StageControl call: an HMAC-SHA256, keyed by a key derived from the
master secret for this purpose only, over the method name, a timestamp, a fresh nonce, the
identity of the StageServer it is for, the run it is made in, and the request's bytes. It
travels in gRPC metadata as ``fedpipe-control-auth:
v2.<unix ms>.<nonce>.<server id>.<run, base64>.<mac>``. The StageServer recomputes it,
refuses a call signed for another server (a sibling sharing the secret, or itself before a
restart: each process draws a new identity), timestamps outside a freshness window, and the
nonces it saw within that window, so a recorded call can neither be replayed nor bent into
another method, request, server or run. A listener on a plaintext link learns the request (use
TLS to hide it) but never the secret.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from fedpipe.auth.tokens import derive_key
from fedpipe.errors import AuthError

__all__ = ["CONTROL_HEADER", "ControlVerifier", "SignedCall", "sign_call"]

CONTROL_HEADER = "fedpipe-control-auth"
_VERSION = "v2"
WINDOW_S = 60.0  # a call's timestamp may differ from the server's clock by this much


def sign_call(
    secret: bytes | str,
    method: str,
    request: bytes,
    *,
    server_id: str = "",
    run_id: str = "",
    now: float | None = None,
) -> tuple[tuple[str, str], ...]:
    """gRPC metadata that authenticates one call of ``method`` with body ``request``, for the
    StageServer ``server_id`` (its Hello) in run ``run_id``."""
    stamp = str(int((time.time() if now is None else now) * 1000))
    nonce = _b64(secrets.token_bytes(16))
    run = _b64(run_id.encode())
    mac = _mac(derive_key(secret, "control"), method, stamp, nonce, server_id, run, request)
    return ((CONTROL_HEADER, f"{_VERSION}.{stamp}.{nonce}.{server_id}.{run}.{mac}"),)


@dataclass(frozen=True)
class SignedCall:
    """What a verified control call says of itself beyond its request: the run it names."""

    run_id: str


class ControlVerifier:
    """Checks a control call's MAC, freshness and nonce; raises `AuthError` saying what failed."""

    def __init__(
        self, secret: bytes | str, *, server_id: str = "", window_s: float = WINDOW_S
    ) -> None:
        self._key = derive_key(secret, "control")
        self.server_id = server_id
        self.window_s = window_s
        self._seen: dict[str, float] = {}  # nonce -> timestamp (s), kept for the window
        self._lock = threading.Lock()

    def __call__(
        self,
        method: str,
        request: bytes,
        metadata: Sequence[tuple[str, str | bytes]],
        *,
        now: float | None = None,
    ) -> SignedCall:
        header = next((str(v) for k, v in metadata if k == CONTROL_HEADER), "")
        parts = header.split(".")
        if len(parts) != 6 or parts[0] != _VERSION or not parts[1].isdigit():
            raise AuthError(
                f"control call {method} refused: no valid {CONTROL_HEADER} header (the ServerApp "
                "signs control calls with the StageServer's secret: pass its --secret-file to "
                "fedpipe run)"
            )
        _, stamp, nonce, server_id, run, mac = parts
        expected = _mac(self._key, method, stamp, nonce, server_id, run, request)
        if not hmac.compare_digest(mac, expected):
            raise AuthError(
                f"control call {method} refused: MAC does not match (the ServerApp and the "
                "StageServer hold different secrets, or the request was altered)"
            )
        if server_id != self.server_id:
            raise AuthError(
                f"control call {method} refused: it was signed for StageServer {server_id!r}, "
                f"this is {self.server_id!r} (another server sharing the secret, or this one "
                "before it restarted)"
            )
        self._fresh(method, int(stamp) / 1000, nonce, time.time() if now is None else now)
        try:
            return SignedCall(run_id=_unb64(run).decode())
        except (ValueError, UnicodeDecodeError):
            raise AuthError(f"control call {method} refused: its run id is malformed") from None

    def _fresh(self, method: str, sent: float, nonce: str, now: float) -> None:
        if abs(now - sent) > self.window_s:
            raise AuthError(
                f"control call {method} refused: its timestamp is {now - sent:+.0f} s off this "
                f"server's clock (window {self.window_s:.0f} s): sync the clocks (NTP)"
            )
        with self._lock:
            self._seen = {n: t for n, t in self._seen.items() if now - t <= self.window_s}
            if nonce in self._seen:
                raise AuthError(f"control call {method} refused: a replay (nonce seen before)")
            self._seen[nonce] = sent


def _mac(
    key: bytes, method: str, stamp: str, nonce: str, server_id: str, run: str, request: bytes
) -> str:
    head = f"{_VERSION}\n{method}\n{stamp}\n{nonce}\n{server_id}\n{run}\n".encode()
    return _b64(hmac.new(key, head + request, hashlib.sha256).digest())


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
