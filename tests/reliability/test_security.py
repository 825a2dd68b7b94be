"""The defences docs/security.md lists, each checked against a real server (or, for the key comparison
and the code-loading rule, against the code itself)."""

from __future__ import annotations

import ast
import asyncio
import hashlib
from pathlib import Path

import httpx
import pytest

from pagedserve.entrypoints import middleware
from pagedserve.entrypoints.middleware import APIKeyMiddleware
from tests.utils import RemoteServer

MODEL = "SmolLM2-135M-Instruct"
KEY, ADMIN_KEY = "sk-tenant-key-0123", "adm-secret-4567"
SECRET_PROMPT = "Confidential: the launch code is PURPLE-HIPPO-9911."
PACKAGE = Path(__file__).resolve().parents[2] / "pagedserve"


@pytest.fixture(scope="module")
def secured():
    args = ["--api-key", KEY, "--admin-key", ADMIN_KEY, "--protect-metrics", "--log-stats-interval", "0"]
    with RemoteServer(args, api_key=KEY) as server:
        yield server


def auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


@pytest.mark.slow
def test_every_route_that_declares_a_key_refuses_a_missing_or_wrong_one(secured):
    schema = httpx.get(secured.url + "/openapi.json").json()
    guarded = [
        (method, path.replace("{model_id}", MODEL).replace("{name}", MODEL))
        for path, operations in schema["paths"].items()
        for method, operation in operations.items()
        if operation.get("security")
    ]
    assert set(guarded) == {
        ("post", "/v1/completions"),
        ("post", "/v1/chat/completions"),
        ("post", "/tokenize"),
        ("post", "/detokenize"),
        ("get", "/v1/models"),
        ("get", f"/v1/models/{MODEL}"),
        ("post", "/generate"),
        ("post", "/generate_stream"),
        ("post", "/"),
        ("get", "/admin/models"),
        ("post", "/admin/models"),
        ("delete", f"/admin/models/{MODEL}"),
        ("get", "/metrics"),
    }
    for method, path in guarded:
        for key in (None, "wrong", KEY if path.startswith("/admin") else ADMIN_KEY):
            response = httpx.request(method.upper(), secured.url + path, headers=auth(key), json={}, timeout=30)
            assert response.status_code == 401, (method, path, key, response.text)
            body = response.json()
            if path in ("/", "/generate", "/generate_stream"):
                assert body["error_type"] == "authentication"
            else:
                assert body["error"]["code"] in ("invalid_api_key", "invalid_admin_key")
    assert httpx.get(secured.url + "/health").status_code == 200  # probes stay open
    assert httpx.get(secured.url + "/metrics", headers=auth(KEY)).status_code == 200


@pytest.mark.slow
def test_cache_salt_keeps_tenants_prefix_caches_apart(secured):
    prompt = "The history of the river valley, told slowly. " * 40  # several full KV blocks

    def cached(salt: str | None) -> int:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
        if salt is not None:
            body["cache_salt"] = salt
        response = secured.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 0  # the same tenant hits its own cache
    assert cached("tenant-b") == 0  # another salt: no hit, so no timing signal
    assert cached(None) == 0  # nor without a salt
    assert cached(None) > 0


@pytest.mark.slow
def test_client_request_ids_never_collide(secured):
    """Many requests with one client-chosen X-Request-Id run side by side, each with its own answer."""

    async def one(client: httpx.AsyncClient, i: int) -> tuple[str, str, str]:
        body = {"model": MODEL, "prompt": f"{i} + {i} =", "max_tokens": 4, "temperature": 0}
        response = await client.post("/v1/completions", json=body, headers={"X-Request-Id": "same-id"})
        assert response.status_code == 200, response.text
        return response.headers["x-request-id"], response.json()["id"], response.json()["choices"][0]["text"]

    async def run() -> list[tuple[str, str, str]]:
        async with httpx.AsyncClient(base_url=secured.url, headers=auth(KEY), timeout=60) as client:
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    results = asyncio.run(run())
    assert {echoed for echoed, _, _ in results} == {"same-id"}  # echoed for tracing ...
    assert len({engine_id for _, engine_id, _ in results}) == 16  # ... never used as the engine's id


@pytest.mark.slow
def test_prompts_and_keys_stay_out_of_the_log(secured):
    body = {"model": MODEL, "messages": [{"role": "user", "content": SECRET_PROMPT}], "max_tokens": 2}
    assert secured.post("/v1/chat/completions", json=body).status_code == 200
    assert secured.post("/v1/completions", json={"prompt": SECRET_PROMPT, "max_tokens": 2}).status_code == 200
    assert httpx.post(secured.url + "/v1/completions", headers=auth("sk-guess-8888"), json={}).status_code == 401
    log = secured.log_text()
    assert "PURPLE-HIPPO" not in log
    for secret in (KEY, ADMIN_KEY, "sk-guess-8888"):
        assert secret not in log


def test_api_keys_compared_in_constant_time_against_every_key(monkeypatch):
    """Every configured key is compared (no early exit), by SHA-256 digest with compare_digest (the
    same length whatever the key), so timing says nothing about which key or how much of one matched."""
    calls: list[tuple[bytes, bytes]] = []
    real = middleware.secrets.compare_digest

    def recording(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(middleware.secrets, "compare_digest", recording)
    guard = APIKeyMiddleware(app=None, api_keys=["first-key", "second-key", "third-key"])  # type: ignore[arg-type]
    assert guard._authorized(b"Bearer first-key")
    assert len(calls) == 3  # it kept comparing after the first matched
    calls.clear()
    assert not guard._authorized(b"Bearer x")
    assert len(calls) == 3 and all(len(a) == len(b) == 32 for a, b in calls)
    assert calls[0][0] == hashlib.sha256(b"x").digest()
    assert not guard._authorized(b"Basic first-key") and not guard._authorized(None)


def test_no_code_loading_data_from_user_input():
    """No pickle / marshal loads, eval / exec, or torch.load without weights_only in the package: nothing
    a client sends is ever turned into code. (Engine messages cross the pipe as server-built objects.)"""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            owner = getattr(func.value, "id", "") if isinstance(func, ast.Attribute) else ""
            if isinstance(func, ast.Name) and name in ("eval", "exec"):
                offenders.append(f"{path.name}:{node.lineno} {name}")
            if owner in ("pickle", "marshal", "dill", "cloudpickle") and name in ("load", "loads"):
                offenders.append(f"{path.name}:{node.lineno} {owner}.{name}")
            if owner == "torch" and name == "load":
                weights_only = [k for k in node.keywords if k.arg == "weights_only"]
                if not weights_only or getattr(weights_only[0].value, "value", None) is not True:
                    offenders.append(f"{path.name}:{node.lineno} torch.load")
    assert offenders == []
