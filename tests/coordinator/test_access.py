"""API keys, admin users and sessions over a real (in-memory) registry."""

from __future__ import annotations

import pytest

from stratamesh.coordinator.access import AccessStore, Principal, hash_password, verify_password
from stratamesh.coordinator.registry import Registry
from stratamesh.fleet.errors import InvalidInput

NOW = 1_800_000_000.0


@pytest.fixture
def registry() -> Registry:
    return Registry(":memory:")


@pytest.fixture
def store(registry: Registry) -> AccessStore:
    return AccessStore(registry)


def test_a_key_is_shown_once_and_only_its_hash_is_kept(store: AccessStore, registry: Registry) -> None:
    text, record = store.create_key("client", "app-1", NOW)
    assert text.startswith(f"sk-sm-{record.key_id}-")
    assert store.check_key(text, NOW) == Principal(f"key {record.key_id} (app-1)", "client", "key")
    [row] = registry.query("SELECT * FROM api_keys")
    secret = text.split("-", 3)[3]          # sk-sm-<hex id>-<secret>: the secret may itself hold "-"
    assert secret not in str(row) and text not in str(row)


@pytest.mark.parametrize("mangle", [
    lambda t: t[:-1] + ("A" if t[-1] != "A" else "B"),     # a wrong secret
    lambda t: t.replace("sk-sm-", "sk-xx-"),               # a wrong prefix
    lambda t: "sk-sm-00000000-" + t.rsplit("-", 1)[-1],    # an unknown id
    lambda t: "", lambda t: "Bearer " + t, lambda t: t + "\x00",
])
def test_a_wrong_key_is_nobody(store: AccessStore, mangle) -> None:  # noqa: ANN001
    text, _ = store.create_key("operator", "", NOW)
    assert store.check_key(mangle(text), NOW) is None


def test_an_expired_or_revoked_key_is_nobody(store: AccessStore) -> None:
    short, _ = store.create_key("client", "", NOW, ttl_s=60)
    assert store.check_key(short, NOW + 59) is not None
    assert store.check_key(short, NOW + 60) is None
    revoked, record = store.create_key("client", "", NOW)
    store.revoke_key(record.key_id, NOW + 1)
    assert store.check_key(revoked, NOW + 2) is None
    assert [k.revoked > 0 for k in store.keys()] == [False, True]
    with pytest.raises(InvalidInput):
        store.revoke_key("ffffffff", NOW)


def test_roles_are_ordered() -> None:
    viewer = Principal("v", "viewer", "user")
    assert viewer.may("client") and viewer.may("viewer") and not viewer.may("operator")
    assert Principal("o", "operator", "key").may("operator")
    assert not Principal("c", "client", "key").may("viewer")


def test_a_user_logs_in_with_the_right_password_only(store: AccessStore) -> None:
    store.add_user("ada", "correct horse", "viewer", NOW)
    assert store.login("ada", "wrong horse", NOW) is None
    assert store.login("nobody", "correct horse", NOW) is None
    token = store.login("ada", "correct horse", NOW)
    assert token is not None
    assert store.check_session(token, NOW + 1) == Principal("ada", "viewer", "user")
    assert store.check_session(token + "x", NOW + 1) is None
    assert store.check_session(token, NOW + 12 * 3600) is None          # sessions expire
    store.logout(token)
    assert store.check_session(token, NOW + 1) is None


def test_a_new_password_or_removal_ends_the_users_sessions(store: AccessStore) -> None:
    store.add_user("ada", "correct horse", "operator", NOW)
    token = store.login("ada", "correct horse", NOW)
    store.add_user("ada", "battery staple", "viewer", NOW)
    assert store.check_session(token, NOW) is None
    token = store.login("ada", "battery staple", NOW)
    assert store.check_session(token, NOW).role == "viewer"
    store.remove_user("ada")
    assert store.check_session(token, NOW) is None and store.users() == []
    with pytest.raises(InvalidInput):
        store.remove_user("ada")


@pytest.mark.parametrize("username, password, role", [
    ("", "long enough", "viewer"), ("a b", "long enough", "viewer"), ("ada", "short", "viewer"),
    ("ada", "long enough", "client"), ("ada", "long enough", "root")])
def test_bad_users_are_refused(store: AccessStore, username: str, password: str, role: str) -> None:
    with pytest.raises(InvalidInput):
        store.add_user(username, password, role, NOW)


def test_passwords_are_salted_scrypt() -> None:
    first, second = hash_password("pw-123456"), hash_password("pw-123456")
    assert first != second and first.startswith("scrypt$")
    assert verify_password("pw-123456", first) and verify_password("pw-123456", second)
    assert not verify_password("pw-123457", first)
    assert not verify_password("pw-123456", "garbage") and not verify_password("pw", "scrypt$1$1$1$zz$zz")
