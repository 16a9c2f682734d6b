"""Control calls authenticated by a MAC of the request, never by sending the secret.

The ServerApp signs each StageControl call: an HMAC-SHA256, keyed by a key derived from the
master secret for this purpose only, over the method name, a timestamp, a fresh nonce and the
request's bytes. It travels in gRPC metadata as ``fedpipe-control-auth:
v1.<unix ms>.<nonce>.<mac>``. The StageServer recomputes it, refuses timestamps outside a
freshness window, and remembers the nonces it saw within that window, so a recorded call can
neither be replayed nor bent into another method or request. A listener on a plaintext link
learns the request (use TLS to hide it) but never the secret.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import threading
import time
from collections.abc import Sequence

from fedpipe.auth.tokens import derive_key
from fedpipe.errors import AuthError

__all__ = ["CONTROL_HEADER", "ControlVerifier", "sign_call"]

CONTROL_HEADER = "fedpipe-control-auth"
_VERSION = "v1"
WINDOW_S = 60.0  # a call's timestamp may differ from the server's clock by this much


def sign_call(
    secret: bytes | str, method: str, request: bytes, *, now: float | None = None
) -> tuple[tuple[str, str], ...]:
    """gRPC metadata that authenticates one call of ``method`` with body ``request``."""
    stamp = str(int((time.time() if now is None else now) * 1000))
    nonce = base64.urlsafe_b64encode(secrets.token_bytes(16)).rstrip(b"=").decode()
    mac = _mac(derive_key(secret, "control"), method, stamp, nonce, request)
    return ((CONTROL_HEADER, f"{_VERSION}.{stamp}.{nonce}.{mac}"),)


class ControlVerifier:
    """Checks a control call's MAC, freshness and nonce; raises `AuthError` saying what failed."""

    def __init__(self, secret: bytes | str, *, window_s: float = WINDOW_S) -> None:
        self._key = derive_key(secret, "control")
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
    ) -> None:
        header = next((str(v) for k, v in metadata if k == CONTROL_HEADER), "")
        parts = header.split(".")
        if len(parts) != 4 or parts[0] != _VERSION or not parts[1].isdigit():
            raise AuthError(
                f"control call {method} refused: no valid {CONTROL_HEADER} header (the ServerApp "
                "signs control calls with the StageServer's secret: pass its --secret-file to "
                "fedpipe run)"
            )
        _, stamp, nonce, mac = parts
        if not hmac.compare_digest(mac, _mac(self._key, method, stamp, nonce, request)):
            raise AuthError(
                f"control call {method} refused: MAC does not match (the ServerApp and the "
                "StageServer hold different secrets, or the request was altered)"
            )
        self._fresh(method, int(stamp) / 1000, nonce, time.time() if now is None else now)

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


def _mac(key: bytes, method: str, stamp: str, nonce: str, request: bytes) -> str:
    head = f"{_VERSION}\n{method}\n{stamp}\n{nonce}\n".encode()
    digest = hmac.new(key, head + request, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
