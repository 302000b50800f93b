"""The HTTP API's gate: API keys → tenants, OpenAI's 401 bodies, cross-origin requests refused, keys reloaded,
the per-key bound on open requests."""

from __future__ import annotations

from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from kvpool.services.router.auth import MISSING_KEY, ApiKeys, KeyRing, authenticated, gate, tenant_of
from kvpool.services.router.open_requests import OpenRequests

ALICE, BOB = "sk-alice-0123456789", "sk-bob-9876543210"


async def whoami(request: Request) -> JSONResponse:
    return JSONResponse({"tenant": tenant_of(request.scope)})


async def health(request: Request) -> JSONResponse:
    return JSONResponse({"tenant": tenant_of(request.scope), "authenticated": authenticated(request.scope)})


def client(keys: ApiKeys | KeyRing, cors: tuple[str, ...] = (), rate: float = 0.0, burst: int = 1,
           open_requests: OpenRequests | None = None) -> TestClient:
    app = Starlette(routes=[Route("/v1/completions", whoami, methods=["POST"]),
                            Route("/v1/models", whoami, methods=["GET"]),
                            Route("/health", health, methods=["GET"])])
    return TestClient(gate(app, keys, cors, rate, burst, open_requests), base_url="http://127.0.0.1:8000")


KEYS = ApiKeys.parse([f"alice={ALICE}", f"bob={BOB}", "# a comment", "", "sk-plain-key-1"], "test")


def test_each_key_is_its_tenant_and_a_bare_key_is_default() -> None:
    c = client(KEYS)
    for key, tenant in ((ALICE, "alice"), (BOB, "bob"), ("sk-plain-key-1", "default")):
        r = c.post("/v1/completions", headers={"Authorization": f"Bearer {key}"}, json={})
        assert (r.status_code, r.json()) == (200, {"tenant": tenant})


def test_a_missing_key_gets_openais_401() -> None:
    c = client(KEYS)
    for headers in ({}, {"Authorization": "Basic abc"}, {"Authorization": "Bearer "}):
        r = c.post("/v1/completions", headers=headers, json={})
        assert r.status_code == 401
        assert r.headers["www-authenticate"] == "Bearer"
        assert r.json() == {"error": {"message": MISSING_KEY, "type": "invalid_request_error", "param": None,
                                      "code": None}}
    assert c.get("/v1/models").status_code == 401  # every route but /health


def test_a_wrong_key_gets_invalid_api_key_and_is_not_echoed() -> None:
    r = client(KEYS).post("/v1/completions", headers={"Authorization": "Bearer sk-alice-0123456780"}, json={})
    assert r.status_code == 401
    error = r.json()["error"]
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
    assert "sk-alice-0123456780" not in error["message"]
    assert error["message"] == "Incorrect API key provided: sk-************6780."


def test_health_stays_open_and_only_a_valid_key_makes_its_caller_authenticated() -> None:
    c = client(KEYS)
    assert (c.get("/health").status_code, c.get("/health").json()) == (
        200, {"tenant": "default", "authenticated": False})
    wrong = c.get("/health", headers={"Authorization": "Bearer sk-alice-0123456780"})
    assert (wrong.status_code, wrong.json()) == (200, {"tenant": "default", "authenticated": False})
    right = c.get("/health", headers={"Authorization": f"Bearer {ALICE}"})
    assert right.json() == {"tenant": "alice", "authenticated": True}
    assert client(ApiKeys()).get("/health").json() == {"tenant": "default", "authenticated": True}  # open API


def test_without_keys_the_api_is_open_as_tenant_default() -> None:
    r = client(ApiKeys()).post("/v1/completions", json={})
    assert (r.status_code, r.json()) == (200, {"tenant": "default"})


@pytest.mark.parametrize("keys", [ApiKeys(), KEYS])
def test_a_cross_origin_post_is_refused_even_a_simple_text_plain_one(keys: ApiKeys) -> None:
    c = client(keys)
    headers = {"Origin": "http://evil.example", "Content-Type": "text/plain", "Authorization": f"Bearer {ALICE}"}
    r = c.post("/v1/completions", headers=headers, content=b'{"prompt": "x"}')
    assert r.status_code == 403
    assert r.json()["error"]["code"] == "cross_origin_refused"
    assert "access-control-allow-origin" not in r.headers
    for origin in ("null", "http://127.0.0.1:8001", "https://127.0.0.1:8000x"):
        assert c.post("/v1/completions", headers={**headers, "Origin": origin}).status_code == 403
    preflight = c.options("/v1/completions", headers={"Origin": "http://evil.example",
                                                       "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 403
    # the server's own origin (a page it served) is not cross-origin
    same = c.post("/v1/completions", headers={**headers, "Origin": "http://127.0.0.1:8000"})
    assert same.status_code == 200


def test_a_configured_origin_gets_cors_answers() -> None:
    c = client(KEYS, ("https://ide.example",))
    preflight = c.options("/v1/completions", headers={"Origin": "https://ide.example",
                                                       "Access-Control-Request-Method": "POST",
                                                       "Access-Control-Request-Headers": "authorization"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "https://ide.example"
    r = c.post("/v1/completions", headers={"Origin": "https://ide.example", "Authorization": f"Bearer {BOB}"},
               json={})
    assert (r.status_code, r.json()) == (200, {"tenant": "bob"})
    assert r.headers["access-control-allow-origin"] == "https://ide.example"
    assert c.post("/v1/completions", headers={"Origin": "https://ide.example"}, json={}).status_code == 401
    assert c.post("/v1/completions", headers={"Origin": "https://other.example"}, json={}).status_code == 403


def test_keys_from_file_and_environment_together(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"# tenants\nbob={BOB}\nalice={ALICE}\n")
    keys = ApiKeys.load(str(path), {"KVPOOL_API_KEY": "carol=sk-carol-55555555"})
    assert sorted(keys.tenants.values()) == ["alice", "bob", "carol"]
    assert keys.tenant_of("sk-carol-55555555") == "carol"
    assert keys.tenant_of("sk-carol-5555555") is None


@pytest.mark.parametrize(("entries", "message"), [
    (["bad tenant=sk-0123456789"], "tenant 'bad tenant'"),
    (["alice=short"], "shorter than 8"),
    ([f"alice={ALICE}", f"bob={ALICE}"], "one key is given to tenants 'alice' and 'bob'"),
])
def test_bad_keys_are_refused_naming_why(entries: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ApiKeys.parse(entries, "api_key")


def test_a_missing_keys_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="api_keys_file: .* is not a file"):
        ApiKeys.load(str(tmp_path / "nope"), {})


def test_a_flooding_tenant_is_held_to_its_rate_and_others_are_not() -> None:
    c = client(KEYS, rate=0.001, burst=2)  # two now, the next in 1000 s
    alice, bob = {"Authorization": f"Bearer {ALICE}"}, {"Authorization": f"Bearer {BOB}"}
    assert [c.post("/v1/completions", headers=alice, json={}).status_code for _ in range(4)] == [200, 200, 429, 429]
    refused = c.post("/v1/completions", headers=alice, json={})
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(refused.headers["retry-after"]) >= 999
    assert [c.post("/v1/completions", headers=bob, json={}).status_code for _ in range(2)] == [200, 200]
    assert c.get("/v1/models", headers=alice).status_code == 200  # only starting requests count


def test_a_reload_puts_new_keys_in_force_and_removed_ones_out_at_the_next_request(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"alice={ALICE}\n")
    ring = KeyRing.load(str(path), {})
    c = client(ring)
    alice, bob = {"Authorization": f"Bearer {ALICE}"}, {"Authorization": f"Bearer {BOB}"}
    assert [c.post("/v1/completions", headers=h, json={}).status_code for h in (alice, bob)] == [200, 401]
    path.write_text(f"bob={BOB}\n")
    ring.reload()
    assert [c.post("/v1/completions", headers=h, json={}).status_code for h in (alice, bob)] == [401, 200]


@pytest.mark.parametrize(("text", "message"), [
    ("alice=short\n", "shorter than 8"),
    ("# every key gone\n", "holds no key now; refusing to open the API"),
])
def test_a_reload_that_fails_keeps_the_keys_in_force(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "keys"
    path.write_text(f"alice={ALICE}\n")
    ring = KeyRing.load(str(path), {})
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        ring.reload()
    assert ring.keys.tenant_of(ALICE) == "alice"
    assert client(ring).post("/v1/completions", headers={"Authorization": f"Bearer {ALICE}"}, json={}).status_code \
        == 200


def test_a_key_at_its_bound_of_open_requests_gets_429_and_other_keys_do_not() -> None:
    open_requests = OpenRequests(max_per_key=2)
    c = client(KEYS, open_requests=open_requests)
    alice_caller = KEYS.caller(ALICE)
    assert alice_caller is not None
    assert open_requests.open(alice_caller.key_id) and open_requests.open(alice_caller.key_id)  # two in flight
    refused = c.post("/v1/completions", headers={"Authorization": f"Bearer {ALICE}"}, json={})
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "too_many_open_requests"
    assert "--max-requests-per-key" in refused.json()["error"]["message"]
    assert c.post("/v1/completions", headers={"Authorization": f"Bearer {BOB}"}, json={}).status_code == 200
    assert open_requests.open_by_key == {alice_caller.key_id: 2}  # bob's request was counted, then closed
    open_requests.close(alice_caller.key_id)
    assert c.post("/v1/completions", headers={"Authorization": f"Bearer {ALICE}"}, json={}).status_code == 200
    assert open_requests.open_by_key == {alice_caller.key_id: 1}


def test_open_requests_are_counted_per_key_up_to_the_bound() -> None:
    bound = OpenRequests(max_per_key=1)
    assert bound.open(b"a") and not bound.open(b"a") and bound.open(b"b")
    bound.close(b"a")
    assert bound.open_by_key == {b"b": 1}
    assert bound.open(b"a")
