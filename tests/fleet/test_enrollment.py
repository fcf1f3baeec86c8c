"""Join tokens and the MACs that prove an enrollment without sending the token's secret."""

from __future__ import annotations

import pytest

from stratamesh.fleet.enrollment import (EnrollmentRefused, JoinToken, check_mac, parse_token, reply_mac,
                                         request_mac, token_for)
from stratamesh.fleet.errors import InvalidInput


def test_a_token_prints_and_parses_back() -> None:
    token = token_for(b"k" * 32, "0a1b2c3d")
    assert parse_token(str(token)) == token
    assert parse_token(f"  {token}\n") == token
    assert str(token).startswith("smj1.0a1b2c3d.") and len(token.secret) == 32


def test_the_secret_derives_from_the_key_and_id() -> None:
    assert token_for(b"k" * 32, "0a1b2c3d") == token_for(b"k" * 32, "0a1b2c3d")
    assert token_for(b"k" * 32, "0a1b2c3d").secret != token_for(b"j" * 32, "0a1b2c3d").secret
    assert token_for(b"k" * 32, "0a1b2c3d").secret != token_for(b"k" * 32, "0a1b2c3e").secret


@pytest.mark.parametrize("text", ["", "smj1", "smj1.0a1b2c3d", "smj2.0a1b2c3d." + "0" * 32,
                                  "smj1.0A1B2C3D." + "0" * 32, "smj1.0a1b2c3d." + "0" * 31,
                                  "smj1.0a1b2c3d." + "g" * 32, None, 7])
def test_malformed_tokens_are_named_without_their_secret(text: object) -> None:
    with pytest.raises(InvalidInput) as err:
        parse_token(text)  # type: ignore[arg-type]
    assert "0" * 20 not in str(err.value)


def test_every_field_of_a_request_is_bound_by_its_mac() -> None:
    secret = JoinToken("0a1b2c3d", "f" * 32).secret
    base = ("m", "0a1b2c3d", "agent-1", b"csr")
    mac = request_mac(secret, *base)
    for i in range(len(base)):
        changed = list(base)
        changed[i] = changed[i] + (b"x" if isinstance(changed[i], bytes) else "x")
        assert request_mac(secret, *changed) != mac
    assert request_mac("e" * 32, *base) != mac
    # length-prefixed fields: moving a byte from one field to the next changes the MAC
    assert request_mac(secret, "m", "0a1b2c3d", "agent-1c", b"sr") != mac


def test_a_reply_mac_is_bound_to_the_request_it_answers() -> None:
    mac = reply_mac("f" * 32, b"request-1", b"cert", b"ca")
    assert reply_mac("f" * 32, b"request-2", b"cert", b"ca") != mac
    assert reply_mac("f" * 32, b"request-1", b"cert", b"other ca") != mac
    check_mac(mac, reply_mac("f" * 32, b"request-1", b"cert", b"ca"), "the reply")
    with pytest.raises(EnrollmentRefused):
        check_mac(mac, reply_mac("f" * 32, b"request-1", b"cert2", b"ca"), "the reply")
