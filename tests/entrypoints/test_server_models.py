"""Several models in one `pagedserve serve`, and the admin API: each request answered by its own model,
/v1/models and /metrics per model, the admin key (401 / 404), loading and removing a model, a blue/green
swap under streaming load that loses no request, and failed swaps that leave the old engine serving."""

from __future__ import annotations

import asyncio
import os
import time

import httpx
import pytest

from pagedserve.models.default_model import default_model_path
from tests.utils import RemoteServer, parse_metrics

pytestmark = pytest.mark.slow

ADMIN_KEY = "admin-secret"
API_KEY = "sk-models-test"
DEFAULT = "SmolLM2-135M-Instruct"
ALT = "alt"
SMALL_ENGINE = ["--kv-cache-memory", "64MiB", "--max-num-seqs", "16", "--log-stats-interval", "0"]
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
LOAD_TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def other_path(tmp_path_factory):
    """The default model's GGUF under another path (what a swap loads)."""
    link = tmp_path_factory.mktemp("models") / "SmolLM2-copy.gguf"
    os.symlink(default_model_path(), link)
    return str(link)


@pytest.fixture(scope="module")
def models_server():
    """The default model under two names (its own and ``alt``), an API key and the admin key."""
    path = default_model_path()
    args = ["--model", path, "--model", f"{ALT}={path}", "--api-key", API_KEY, "--admin-key", ADMIN_KEY]
    with RemoteServer([*args, *SMALL_ENGINE], api_key=API_KEY) as remote:
        yield remote


def admin_get(server) -> list[dict]:
    response = httpx.get(server.url + "/admin/models", headers=ADMIN, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["models"]


def admin_post(server, body: dict, wait: bool = True) -> httpx.Response:
    return httpx.post(
        server.url + "/admin/models",
        json=body,
        params={"wait": str(wait).lower()},
        headers=ADMIN,
        timeout=LOAD_TIMEOUT_S,
    )


def complete(server, model: str, **kwargs) -> dict:
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, **kwargs}
    response = server.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def wait_for_entries(server, done, timeout: float = LOAD_TIMEOUT_S) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        entries = admin_get(server)
        if done(entries) or time.monotonic() > deadline:
            return entries
        time.sleep(0.5)


def test_two_models_each_answers_its_requests(models_server):
    ids = [card["id"] for card in models_server.get("/v1/models").json()["data"]]
    assert ids == [DEFAULT, ALT]
    cards = {card["id"]: card for card in models_server.get("/v1/models").json()["data"]}
    assert cards[ALT]["root"] == default_model_path()
    assert models_server.get(f"/v1/models/{ALT}").json()["id"] == ALT

    def generated(model: str) -> float:
        values = parse_metrics(httpx.get(models_server.url + "/metrics", timeout=30).text)
        return values.get(f'pagedserve:generation_tokens_total{{model_name="{model}"}}', 0.0)

    before = {name: generated(name) for name in (DEFAULT, ALT)}
    assert complete(models_server, ALT)["model"] == ALT
    assert complete(models_server, ALT)["model"] == ALT
    assert complete(models_server, DEFAULT)["model"] == DEFAULT
    assert complete(models_server, "")["model"] == DEFAULT  # no model: the default (first) one
    assert generated(ALT) - before[ALT] == 8 and generated(DEFAULT) - before[DEFAULT] == 8
    text = httpx.get(models_server.url + "/metrics", timeout=30).text
    for name in (DEFAULT, ALT):
        assert f'pagedserve:num_requests_running{{model_name="{name}",replica="0"}}' in text
    assert models_server.post("/v1/completions", json={"model": "nope", "prompt": "x"}).status_code == 404
    # TGI routes: the default model
    info = httpx.get(models_server.url + "/info", timeout=30).json()
    assert info["model_id"] == DEFAULT
    assert httpx.get(models_server.url + "/health", timeout=30).status_code == 200


def test_admin_auth(models_server, server):
    url = models_server.url + "/admin/models"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {API_KEY}"}):
        response = httpx.get(url, headers=headers, timeout=30)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_admin_key"
    # the admin key opens the admin API only, not the inference routes (which want an API key)
    assert httpx.get(models_server.base_url + "/models", headers=ADMIN, timeout=30).status_code == 401
    entries = admin_get(models_server)
    assert [(e["name"], e["state"], e["engine"]) for e in entries] == [
        (DEFAULT, "ready", "paged"),
        (ALT, "ready", "paged"),
    ]
    replica = entries[0]["replicas"][0]
    assert replica["id"] == "0" and replica["pid"] > 0 and replica["running"] == 0 and 0 <= replica["kv_usage"] <= 1
    # a server started without --admin-key has no admin API
    off = httpx.get(server.url + "/admin/models", headers={"Authorization": "Bearer x"}, timeout=30)
    assert off.status_code == 404 and "--admin-key" in off.json()["error"]["message"]


def test_bad_loads_are_400s_and_leave_the_old_engine(models_server, tmp_path):
    not_a_model = tmp_path / "notes.txt"
    not_a_model.write_text("hello")
    for body, param in (
        ({"name": ALT, "model": str(tmp_path / "missing.gguf")}, "model"),
        ({"name": ALT, "model": str(not_a_model)}, "model"),
        ({"name": ALT, "model": default_model_path(), "quantization": "awq"}, "quantization"),
        ({"name": ALT, "model": str(tmp_path), "quantization": "gguf"}, "quantization"),  # not a .gguf file
        ({"name": ALT, "model": default_model_path(), "dtype": "int4"}, "dtype"),
        ({"name": ALT, "model": default_model_path(), "engine": "vllm"}, "engine"),
        ({"name": ALT, "model": default_model_path(), "replicas": 2}, None),
        ({"name": ALT}, "model"),
    ):
        response = admin_post(models_server, body)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["param"] == param
    assert complete(models_server, ALT)["model"] == ALT


def test_failed_swap_leaves_the_old_engine_serving(models_server, tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\x00" * 64)  # passes the first look, fails to load
    pid_before = {e["name"]: e for e in admin_get(models_server)}[ALT]["replicas"][0]["pid"]
    response = admin_post(models_server, {"name": ALT, "model": str(broken)})
    assert response.status_code == 500 and "failed" in response.json()["error"]["message"]
    entries = admin_get(models_server)
    current = [e for e in entries if e["name"] == ALT and e["state"] == "ready"]
    assert len(current) == 1 and current[0]["model"] == default_model_path()
    assert current[0]["replicas"][0]["pid"] == pid_before
    failed = [e for e in entries if e["name"] == ALT and e["state"] == "failed"]
    assert len(failed) == 1 and failed[0]["model"] == str(broken) and failed[0]["error"]
    assert complete(models_server, ALT)["model"] == ALT
    assert httpx.get(models_server.url + "/health", timeout=30).status_code == 200


def test_load_a_new_model_then_delete_it(models_server):
    response = admin_post(models_server, {"name": "f32", "model": default_model_path(), "dtype": "float32"})
    assert response.status_code == 200, response.text
    entry = response.json()
    assert entry["name"] == "f32" and entry["state"] == "ready" and entry["dtype"] == "float32"
    assert [card["id"] for card in models_server.get("/v1/models").json()["data"]] == [DEFAULT, ALT, "f32"]
    assert complete(models_server, "f32")["model"] == "f32"
    deleted = httpx.delete(models_server.url + "/admin/models/f32", headers=ADMIN, timeout=30)
    assert deleted.status_code == 200 and deleted.json() == {"name": "f32", "state": "draining"}
    assert models_server.post("/v1/completions", json={"model": "f32", "prompt": "x"}).status_code == 404
    assert httpx.delete(models_server.url + "/admin/models/f32", headers=ADMIN, timeout=30).status_code == 404
    entries = wait_for_entries(models_server, lambda es: all(e["name"] != "f32" for e in es), 60)
    assert [e["name"] for e in entries if e["state"] != "failed"] == [DEFAULT, ALT]


def test_swap_under_streaming_load_loses_no_request(models_server, other_path):
    results: list[list[str]] = []
    served_by: set[str] = set()

    async def scenario() -> None:
        client = models_server.async_openai_client()
        swapped = asyncio.Event()

        async def worker(index: int) -> None:
            while True:
                last = swapped.is_set()  # one more full request once the swap is done
                stream = await client.completions.create(
                    model=ALT,
                    prompt=f"Story number {index}:",
                    max_tokens=16,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                finishes = []
                async for chunk in stream:
                    served_by.add(chunk.model)
                    finishes += [c.finish_reason for c in chunk.choices if c.finish_reason is not None]
                results.append(finishes)
                if last:
                    return

        workers = [asyncio.create_task(worker(i)) for i in range(16)]
        await asyncio.sleep(2.0)
        async with httpx.AsyncClient(base_url=models_server.url, headers=ADMIN, timeout=60) as admin:
            body = {"name": ALT, "model": other_path, "dtype": "float32"}
            started = await admin.post("/admin/models", params={"wait": "false"}, json=body)
            assert started.status_code == 202 and started.json() == {"name": ALT, "state": "loading"}
            again = await admin.post("/admin/models", params={"wait": "false"}, json=body)
            assert again.status_code == 409
            deadline = time.monotonic() + LOAD_TIMEOUT_S
            while time.monotonic() < deadline:
                entries = (await admin.get("/admin/models")).json()["models"]
                if any(e["name"] == ALT and e["model"] == other_path and e["state"] == "ready" for e in entries):
                    break
                await asyncio.sleep(0.5)
        swapped.set()
        await asyncio.wait_for(asyncio.gather(*workers), LOAD_TIMEOUT_S)

    asyncio.run(scenario())
    assert len(results) >= 32 and all(finishes == ["length"] for finishes in results)
    assert served_by == {ALT}
    cards = {card["id"]: card for card in models_server.get("/v1/models").json()["data"]}
    assert cards[ALT]["root"] == other_path and cards[DEFAULT]["root"] == default_model_path()
    entries = wait_for_entries(models_server, lambda es: len([e for e in es if e["name"] == ALT]) == 1, 120)
    (alt,) = [e for e in entries if e["name"] == ALT]  # the failed load's entry went with this load
    assert alt["model"] == other_path and alt["state"] == "ready" and alt["dtype"] == "float32"
    assert complete(models_server, ALT)["model"] == ALT
    assert httpx.get(models_server.url + "/health", timeout=30).status_code == 200


def test_the_last_model_cannot_be_removed(models_server):
    assert httpx.delete(models_server.url + f"/admin/models/{DEFAULT}", headers=ADMIN, timeout=30).status_code == 200
    assert [card["id"] for card in models_server.get("/v1/models").json()["data"]] == [ALT]
    assert complete(models_server, "")["model"] == ALT  # the default moved to the next model
    last = httpx.delete(models_server.url + f"/admin/models/{ALT}", headers=ADMIN, timeout=30)
    assert last.status_code == 409
