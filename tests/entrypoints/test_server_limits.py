"""Overload (bounded queue -> 429 + Retry-After), rate limit, API keys from flags and env, CORS,
the per-request timeout and the SIGTERM drain, on one server started with tiny limits."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest

from tests.utils import RemoteServer

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
KEY_BURST, KEY_RATE, KEY_ENV = "k-burst", "k-rate", "k-env"
RATE = 40  # per minute, per key
ORIGIN = "https://app.example.com"
TIMEOUT_S = 8


@pytest.fixture(scope="module")
def limited():
    args = [
        "--max-num-seqs",
        "2",
        "--max-queued-requests",
        "2",
        "--rate-limit",
        f"{RATE}/minute",
        "--api-key",
        KEY_BURST,
        "--api-key",
        KEY_RATE,
        "--allowed-origins",
        f'["{ORIGIN}"]',
        "--request-timeout",
        str(TIMEOUT_S),
        "--shutdown-timeout",
        "60",
        "--engine-core",
        "thread",  # NOTE: the other servers run the default engine-core process
        "--event-loop",
        "asyncio",
        "--http",
        "h11",
    ]  # and the defaults: uvloop, httptools
    with RemoteServer(args, env={"PAGEDSERVE_API_KEY": KEY_ENV}) as remote:
        yield remote


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_overload_burst_gets_429_and_accepted_ones_complete(limited):
    async def one(client: httpx.AsyncClient, i: int):
        body = {"model": MODEL, "prompt": f"Request {i}:", "max_tokens": 12, "ignore_eos": True}
        response = await client.post(limited.base_url + "/completions", json=body, headers=auth(KEY_BURST))
        return response

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(10)))

    responses = asyncio.run(run())
    statuses = sorted(r.status_code for r in responses)
    accepted = [r for r in responses if r.status_code == 200]
    rejected = [r for r in responses if r.status_code == 429]
    assert len(accepted) + len(rejected) == 10, statuses
    assert accepted and rejected
    for response in rejected:
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "server_overloaded"
    for response in accepted:
        body = response.json()
        assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 12


def test_tgi_overload_shape(limited):
    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            body = {"inputs": "Hello", "parameters": {"max_new_tokens": 12}}
            return await asyncio.gather(
                *(client.post(limited.url + "/generate", json=body, headers=auth(KEY_BURST)) for _ in range(8))
            )

    responses = asyncio.run(run())
    rejected = [r for r in responses if r.status_code == 429]
    assert rejected and all(r.json() == {"error": "Model is overloaded", "error_type": "overloaded"} for r in rejected)
    assert all(r.status_code in (200, 429) for r in responses)


def test_rate_limit_per_key(limited):
    def tokenize() -> httpx.Response:
        return limited.post("/tokenize", json={"prompt": "hi"}, headers=auth(KEY_RATE))

    statuses = [tokenize().status_code for _ in range(RATE + 10)]
    assert statuses[:RATE].count(200) == RATE  # this key's bucket starts full
    # one token comes back every 60 / RATE s, so a slow moment may let one more request through,
    # but not ten in a row
    assert 429 in statuses[RATE:]
    limited_response = next(r for r in (tokenize() for _ in range(10)) if r.status_code == 429)
    assert int(limited_response.headers["retry-after"]) >= 1
    assert limited_response.json()["error"]["code"] == "rate_limit_exceeded"
    # another key has its own bucket; open routes are never limited
    assert limited.post("/tokenize", json={"prompt": "hi"}, headers=auth(KEY_ENV)).status_code == 200
    assert all(httpx.get(limited.url + "/health").status_code == 200 for _ in range(3))


def test_api_key_from_environment(limited):
    client = openai.OpenAI(base_url=limited.base_url, api_key=KEY_ENV, max_retries=0)
    assert client.models.list().data[0].id == MODEL
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=limited.base_url, api_key="wrong", max_retries=0).models.list()
    assert httpx.get(limited.url + "/metrics").status_code == 200  # open without a key


def test_cors(limited):
    preflight = httpx.options(
        limited.base_url + "/chat/completions",
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
    )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(
        limited.base_url + "/chat/completions",
        headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert "access-control-allow-origin" not in other.headers


def test_request_timeout_aborts(limited):
    body = {"model": MODEL, "prompt": "Never stop:", "max_tokens": 4000, "min_tokens": 4000, "ignore_eos": True}
    response = limited.post("/v1/completions", json=body, headers=auth(KEY_ENV))
    assert response.status_code == 408
    assert response.json()["error"]["code"] == "request_timeout"
    running = 'pagedserve:num_requests_running{model_name="SmolLM2-135M-Instruct",replica="0"} 0.0'
    for _ in range(300):  # the abort reaches the engine thread asynchronously
        if running in httpx.get(limited.url + "/metrics").text:
            break
        time.sleep(0.1)
    assert running in httpx.get(limited.url + "/metrics").text


def test_sigterm_drains_in_flight_then_exits_cleanly(limited):
    """Last in this module: it stops the server."""
    result: dict = {}

    def stream_one():
        client = openai.OpenAI(base_url=limited.base_url, api_key=KEY_ENV, max_retries=0, timeout=120)
        text, finishes = "", []
        for chunk in client.completions.create(
            model=MODEL,
            prompt="Slowly count:",
            max_tokens=40,
            stream=True,
            extra_body={"ignore_eos": True, "min_tokens": 40},
        ):
            text += chunk.choices[0].text if chunk.choices else ""
            if chunk.choices and chunk.choices[0].finish_reason:
                finishes.append(chunk.choices[0].finish_reason)
            result.setdefault("first_chunk", threading.Event()).set()
        result["finishes"] = finishes

    result["first_chunk"] = threading.Event()
    thread = threading.Thread(target=stream_one)
    thread.start()
    assert result["first_chunk"].wait(60)
    limited.proc.terminate()  # SIGTERM
    refused = None
    for _ in range(50):
        try:
            refused = limited.post(
                "/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=auth(KEY_ENV), timeout=10
            )
        except httpx.HTTPError:
            break  # the listener is already closed: also a refusal
        if refused.status_code == 503:
            break
        time.sleep(0.05)
    assert refused is None or refused.status_code == 503
    thread.join(120)
    assert result.get("finishes") == ["length"]  # the in-flight stream finished normally
    assert limited.proc.wait(60) == 0
