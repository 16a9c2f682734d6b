"""Session tokens: round trip, and every way a token must be refused."""

from __future__ import annotations

import pytest

from fedpipe.federated.tokens import (
    InvalidTokenError,
    TokenClaims,
    issue_token,
    new_secret,
    verify_token,
)

SECRET = new_secret()


def test_round_trip_carries_claims() -> None:
    token = issue_token(SECRET, run_id="run-7", round=3, device_id="jetson/0")
    claims = verify_token(SECRET, token, round=3, device_id="jetson/0")
    assert isinstance(claims, TokenClaims)
    assert (claims.run_id, claims.round, claims.device_id) == ("run-7", 3, "jetson/0")
    assert verify_token(SECRET.encode(), token, round=3).device_id == "jetson/0"


def test_token_is_url_safe_and_unique() -> None:
    first = issue_token(SECRET, run_id="r", round=1, device_id="d ä/+")
    second = issue_token(SECRET, run_id="r", round=1, device_id="d ä/+")
    assert first != second  # fresh nonce each time
    assert set(first) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


def test_wrong_secret_is_refused() -> None:
    token = issue_token(SECRET, run_id="r", round=1, device_id="d")
    with pytest.raises(InvalidTokenError, match="MAC"):
        verify_token(new_secret(), token, round=1)


def test_wrong_round_and_device_are_refused() -> None:
    token = issue_token(SECRET, run_id="r", round=1, device_id="d")
    with pytest.raises(InvalidTokenError, match="round 1, this is round 2"):
        verify_token(SECRET, token, round=2)
    with pytest.raises(InvalidTokenError, match="device"):
        verify_token(SECRET, token, round=1, device_id="other")


@pytest.mark.parametrize("index", [1, 2, 3, 4])
def test_tampered_claims_are_refused(index: int) -> None:
    token = issue_token(SECRET, run_id="r", round=1, device_id="d")
    parts = token.split(".")
    parts[index] = "2" if index == 2 else parts[index][::-1] + "A"
    with pytest.raises(InvalidTokenError):
        verify_token(SECRET, ".".join(parts), round=2 if index == 2 else 1)


@pytest.mark.parametrize(
    "token", ["", "abc", "v1.a.b.c.d", "v2.a.1.b.c.d", "v1.a.1.b.c.d.e", "v1.a.1.b.c.é", None]
)
def test_malformed_tokens_are_refused(token: object) -> None:
    with pytest.raises(InvalidTokenError):
        verify_token(SECRET, token, round=1)  # type: ignore[arg-type]


def test_short_secret_and_negative_round_are_rejected() -> None:
    with pytest.raises(ValueError, match="at least 16"):
        issue_token("short", run_id="r", round=1, device_id="d")
    with pytest.raises(ValueError, match="round"):
        issue_token(SECRET, run_id="r", round=-1, device_id="d")
