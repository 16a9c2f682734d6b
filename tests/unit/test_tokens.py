"""Session tokens (v2) and control-call MACs: round trips, and every way each must be refused."""

from __future__ import annotations

import pytest

from fedpipe.auth.calls import CONTROL_HEADER, ControlVerifier, sign_call
from fedpipe.auth.tokens import (
    CLOCK_SKEW_S,
    InvalidTokenError,
    TokenClaims,
    TokenLedger,
    issue_token,
    new_secret,
    verify_token,
)
from fedpipe.errors import AuthError

SECRET = new_secret()
NOW = 1_800_000_000.0


def _token(**kw) -> str:  # type: ignore[no-untyped-def]
    args = {"run_id": "r", "round": 1, "device_id": "d", "now": NOW, **kw}
    return issue_token(SECRET, **args)


def test_round_trip_carries_claims() -> None:
    token = issue_token(SECRET, run_id="run-7", round=3, device_id="jetson/0", ttl_s=60, now=NOW)
    claims = verify_token(SECRET, token, round=3, run_id="run-7", device_id="jetson/0", now=NOW)
    assert isinstance(claims, TokenClaims)
    assert (claims.run_id, claims.round, claims.device_id) == ("run-7", 3, "jetson/0")
    assert (claims.issued, claims.expires) == (int(NOW), int(NOW) + 60)
    assert verify_token(SECRET.encode(), token, round=3, now=NOW).device_id == "jetson/0"


def test_token_is_versioned_url_safe_and_unique() -> None:
    first = _token(device_id="d ä/+")
    second = _token(device_id="d ä/+")
    assert first != second  # fresh nonce each time
    assert first.startswith("v2.") and len(first.split(".")) == 8
    assert set(first) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


def test_wrong_secret_is_refused() -> None:
    with pytest.raises(InvalidTokenError, match="MAC does not match"):
        verify_token(new_secret(), _token(), round=1, now=NOW)


def test_wrong_run_round_and_device_are_refused() -> None:
    token = _token()
    with pytest.raises(InvalidTokenError, match="for run 'r', this StageServer serves run 'other'"):
        verify_token(SECRET, token, round=1, run_id="other", now=NOW)
    with pytest.raises(InvalidTokenError, match="round 1, this is round 2"):
        verify_token(SECRET, token, round=2, now=NOW)
    with pytest.raises(InvalidTokenError, match="for device 'd', not 'other'"):
        verify_token(SECRET, token, round=1, device_id="other", now=NOW)


def test_expired_token_is_refused() -> None:
    token = _token(ttl_s=30)
    verify_token(SECRET, token, round=1, now=NOW + 30)  # the last valid second
    with pytest.raises(InvalidTokenError, match="expired 1 s ago"):
        verify_token(SECRET, token, round=1, now=NOW + 31)


def test_token_from_before_the_round_began_is_refused() -> None:
    token = _token()
    verify_token(SECRET, token, round=1, now=NOW, not_before=NOW + CLOCK_SKEW_S)  # skew allowed
    with pytest.raises(InvalidTokenError, match="earlier attempt at this round"):
        verify_token(SECRET, token, round=1, now=NOW, not_before=NOW + CLOCK_SKEW_S + 5)


def test_v1_tokens_are_refused_with_the_fix() -> None:
    with pytest.raises(InvalidTokenError, match="format v1 is not accepted.*same fedpipe version"):
        verify_token(SECRET, "v1.cg.1.ZA.bm9uY2U.bWFj", round=1)


@pytest.mark.parametrize("index", [1, 2, 3, 4, 5, 6])
def test_tampered_fields_are_refused(index: int) -> None:
    parts = _token().split(".")
    parts[index] = str(int(parts[index]) + 1) if parts[index].isdigit() else parts[index] + "A"
    with pytest.raises(InvalidTokenError, match="MAC does not match"):
        verify_token(SECRET, ".".join(parts), round=int(parts[2]), now=NOW)


@pytest.mark.parametrize(
    "token", ["", "abc", "v2.a.b.c.d", "v2.a.1.b.1.2.c.d.e", "v2.a.1.b.1.2.c.é", None]
)
def test_malformed_tokens_are_refused(token: object) -> None:
    with pytest.raises(InvalidTokenError):
        verify_token(SECRET, token, round=1)  # type: ignore[arg-type]


def test_short_secret_negative_round_and_ttl_are_rejected() -> None:
    with pytest.raises(ValueError, match="at least 16"):
        issue_token("short", run_id="r", round=1, device_id="d")
    with pytest.raises(ValueError, match="round"):
        issue_token(SECRET, run_id="r", round=-1, device_id="d")
    with pytest.raises(ValueError, match="ttl_s"):
        issue_token(SECRET, run_id="r", round=1, device_id="d", ttl_s=0)


def test_ledger_admits_one_session_per_device_and_round() -> None:
    ledger = TokenLedger()
    first = verify_token(SECRET, _token(), round=1, now=NOW)
    ledger.claim(first, now=NOW)
    with pytest.raises(InvalidTokenError, match="this session token .* already used"):
        ledger.claim(first, now=NOW)  # a replay of the same token
    other = verify_token(SECRET, _token(), round=1, now=NOW)
    with pytest.raises(InvalidTokenError, match="a session token for device 'd' in round 1"):
        ledger.claim(other, now=NOW)  # a second token for the same device and round
    ledger.claim(other, epoch=NOW + 100, now=NOW)  # the round begun again (a resumed run)
    ledger.claim(verify_token(SECRET, _token(device_id="e"), round=1, now=NOW), now=NOW)
    ledger.claim(verify_token(SECRET, _token(round=2), round=2, now=NOW), now=NOW)
    assert len(ledger) == 4


def test_a_token_is_refused_again_when_its_round_is_begun_again() -> None:
    """A round begun anew (a resumed run) takes fresh tokens only: one that opened a session
    in the earlier attempt, even if issued within the clock skew of the new start, is refused."""
    ledger = TokenLedger()
    token = verify_token(SECRET, _token(), round=1, now=NOW)
    ledger.claim(token, epoch=NOW, now=NOW)
    with pytest.raises(InvalidTokenError, match="this session token .* already used"):
        ledger.claim(token, epoch=NOW + 10, now=NOW + 10)


def test_ledger_forgets_expired_tokens() -> None:
    ledger = TokenLedger()
    first = verify_token(SECRET, _token(ttl_s=10), round=1, now=NOW)
    second = verify_token(SECRET, _token(round=2), round=2, now=NOW)
    ledger.claim(first, now=NOW)
    ledger.claim(second, now=NOW + 11)
    assert len(ledger) == 1  # round 1's token expired: it cannot be used again anyway
    # The one kept is round 2's: it is still refused a second time, while round 1's is
    # forgotten (verify_token refuses it as expired before it could reach the ledger).
    with pytest.raises(InvalidTokenError, match="already used"):
        ledger.claim(second, now=NOW + 12)
    ledger.claim(first, now=NOW + 12)
    assert len(ledger) == 2


# -- control-call MACs -------------------------------------------------------------------------
METHOD = "/fedpipe.proto.StageControl/BeginRound"


def test_signed_call_is_accepted_once() -> None:
    verify = ControlVerifier(SECRET)
    metadata = sign_call(SECRET, METHOD, b"request", now=NOW)
    assert metadata[0][0] == CONTROL_HEADER and SECRET not in metadata[0][1]
    verify(METHOD, b"request", metadata, now=NOW + 1)
    with pytest.raises(AuthError, match="a replay"):
        verify(METHOD, b"request", metadata, now=NOW + 2)


@pytest.mark.parametrize(
    ("method", "body", "key"),
    [
        (METHOD, b"request", new_secret()),  # another secret
        (METHOD, b"reqUest", SECRET),  # the request altered
        ("/fedpipe.proto.StageControl/LoadAdapter", b"request", SECRET),  # another method
    ],
    ids=["another-secret", "altered-request", "another-method"],  # the same on every worker
)
def test_wrong_key_body_or_method_is_refused(method: str, body: bytes, key: str) -> None:
    metadata = sign_call(key, METHOD, b"request", now=NOW)
    with pytest.raises(AuthError, match="MAC does not match") as info:
        ControlVerifier(SECRET)(method, body, metadata, now=NOW)
    assert "\n" not in str(info.value)


def test_stale_and_unsigned_calls_are_refused() -> None:
    verify = ControlVerifier(SECRET, window_s=60)
    with pytest.raises(AuthError, match=r"-61 s off this server's clock"):
        verify(METHOD, b"x", sign_call(SECRET, METHOD, b"x", now=NOW + 61), now=NOW)
    with pytest.raises(AuthError, match=r"\+61 s off"):
        verify(METHOD, b"x", sign_call(SECRET, METHOD, b"x", now=NOW - 61), now=NOW)
    with pytest.raises(AuthError, match="no valid fedpipe-control-auth header"):
        verify(METHOD, b"x", (), now=NOW)
    with pytest.raises(AuthError, match="no valid"):
        verify(METHOD, b"x", ((CONTROL_HEADER, "v2.notanumber.n.s.r.m"),), now=NOW)


def test_a_call_is_bound_to_its_server_and_names_its_run() -> None:
    """A call signed for one StageServer is refused by another sharing the secret (or the same
    one restarted: a new identity); the verified call names the run it was made in."""
    metadata = sign_call(SECRET, METHOD, b"x", server_id="a1", run_id="run-1.ff", now=NOW)
    with pytest.raises(AuthError, match="signed for StageServer 'a1', this is 'b2'"):
        ControlVerifier(SECRET, server_id="b2")(METHOD, b"x", metadata, now=NOW)
    signed = ControlVerifier(SECRET, server_id="a1")(METHOD, b"x", metadata, now=NOW)
    assert signed.run_id == "run-1.ff"
    forged = ((CONTROL_HEADER, metadata[0][1].replace("a1", "b2", 1)),)  # the id rewritten
    with pytest.raises(AuthError, match="MAC does not match"):
        ControlVerifier(SECRET, server_id="b2")(METHOD, b"x", forged, now=NOW)


# -- who reads the secret ------------------------------------------------------------------------
def test_only_the_server_side_reads_the_secret_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from fedpipe.fl.device_work import run_settings, server_run_settings

    secret_file = tmp_path / "server-host-only" / "secret"  # absent, as on a device's host
    run_config = {"run.secret-file": str(secret_file), "run.id": "r"}
    _, run = run_settings(run_config)  # what the ClientApp calls: reads no file
    assert (run.secret, run.secret_file) == ("", str(secret_file))
    with pytest.raises(FileNotFoundError, match="the ServerApp cannot read the secret file"):
        server_run_settings(run_config)
    secret_file.parent.mkdir()
    secret_file.write_text(SECRET + "\n")
    assert server_run_settings(run_config)[1].secret == SECRET
