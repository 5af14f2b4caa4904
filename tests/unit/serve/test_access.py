"""Who may call a model server (gpuyard.serve.access): the server's key, its team's tokens, admins';
401 without, 403 for another team, /health and /ready open; keys are checked, never shown."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpuyard.errors import ConfigError
from gpuyard.serve.access import (
    KEY_ENV,
    Access,
    KeyGate,
    check_key,
    hand_key,
    key_hash,
    new_key,
    openai_body,
)

pytestmark = pytest.mark.unit

KEY = "gyk_unit-test-key-0123456789"


async def _ok(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def _get(app: Any, path: str, token: str | None = None) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://s") as c:
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            return await c.get(path, headers=headers)

    return asyncio.run(go())


def test_the_key_gate_without_tokens() -> None:
    gate = KeyGate(_ok, Access(key_hash(KEY), "t", tokens=False))
    assert _get(gate, "/v1/x").status_code == 401
    assert _get(gate, "/v1/x", "gyk_another-key-0123456789").status_code == 401
    assert _get(gate, "/v1/x", "gy_a-token-but-tokens-are-off").status_code == 401
    assert _get(gate, "/v1/x", KEY).text == "ok"
    assert _get(gate, "/health").text == "ok" and _get(gate, "/ready").text == "ok"
    assert _get(gate, "/metrics").status_code == 401 and _get(gate, "/health/x").status_code == 401
    shaped = _get(KeyGate(_ok, Access(None, None), openai_body), "/v1/models")
    assert shaped.json()["error"]["type"] == "authentication_error"


def test_tokens_of_the_team_and_admins_pass_others_get_403(gpuyard_home: Path) -> None:
    from gpuyard.auth import add_user, create_token

    add_user("ann", "nlp")
    add_user("ben", "vision")
    add_user("boss", "ops", "admin")
    ann, ben, boss = (create_token(u)[0] for u in ("ann", "ben", "boss"))
    gate = KeyGate(_ok, Access(None, "nlp"))
    assert _get(gate, "/v1/x", ann).status_code == 200 and _get(gate, "/v1/x", boss).status_code == 200
    denied = _get(gate, "/v1/x", ben)
    assert denied.status_code == 403 and "team 'nlp'" in denied.json()["detail"]
    assert _get(gate, "/v1/x", "gy_unknown-token").status_code == 401
    # A folder's server belongs to no team: admins only.
    nobody = KeyGate(_ok, Access(None, None))
    assert _get(nobody, "/v1/x", ann).status_code == 403 and _get(nobody, "/v1/x", boss).status_code == 200


def test_keys_given_by_hand_are_checked_and_a_generated_one_is_new(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    key, generated = hand_key(None)
    assert generated and key.startswith("gyk_") and len(key) > 40 and key != new_key()
    assert hand_key(KEY) == (KEY, False)
    monkeypatch.setenv(KEY_ENV, KEY)
    assert hand_key(None) == (KEY, False)
    for bad in ("short", "has a space in it 0123", "tab\tinside-the-key-0123"):
        with pytest.raises(ConfigError, match="--api-key: a server key needs at least 16") as err:
            check_key(bad, "--api-key")
        assert bad not in str(err.value)


def test_replicas_get_the_hash_and_the_team_never_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    access = Access(key_hash(KEY), "nlp")
    env = access.replica_env()
    assert KEY not in env.values()
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert Access.from_env() == access
