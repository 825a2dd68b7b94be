"""The middleware list on a real server: the Host check, GZip (never on event streams), CORS, request
ids and the timing header, API keys on the inference routes only, and a user's --middleware class; the
function form and bad --middleware values on an in-process app."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from fastapi import FastAPI
from starlette.responses import PlainTextResponse
from starlette.testclient import TestClient

from pagedserve.entrypoints.api_server import add_user_middleware
from tests.web.conftest import API_KEY, DEFAULT, running_now
from tests.web.sample_middleware import ORDER_HEADER


@pytest.mark.slow
def test_host_header_check(web_server):
    assert web_server.get("/health").status_code == 200  # Host: 127.0.0.1:<port>
    assert web_server.get("/health", headers={"Host": "api.example.test"}).status_code == 200
    assert web_server.get("/health", headers={"Host": "localhost:8000"}).status_code == 200
    for host in ("evil.test", "example.test.evil.test", "api.example.test.evil"):
        response = web_server.get("/v1/models", headers={"Host": host, "Authorization": f"Bearer {API_KEY}"})
        assert response.status_code == 400, host
        assert response.json()["error"]["code"] == "invalid_host"


@pytest.mark.slow
def test_gzip_for_large_bodies_only_and_never_for_event_streams(web_server):
    raw = httpx.get(web_server.url + "/openapi.json", headers={"Accept-Encoding": "gzip"})
    assert raw.headers["content-encoding"] == "gzip"
    assert "paths" in raw.json()  # httpx undid the gzip
    assert (
        "content-encoding"
        not in httpx.get(web_server.url + "/openapi.json", headers={"Accept-Encoding": "identity"}).headers
    )
    assert "content-encoding" not in httpx.get(web_server.url + "/version", headers={"Accept-Encoding": "gzip"}).headers

    body = {"model": DEFAULT, "prompt": "Once", "max_tokens": 600, "ignore_eos": True, "stream": True}
    headers = {**web_server.headers(), "Accept-Encoding": "gzip"}
    with httpx.stream("POST", web_server.base_url + "/completions", json=body, headers=headers, timeout=120) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        assert "content-encoding" not in stream.headers
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["text"] is not None
        # the first event arrived while the request still runs: the stream is not buffered
        deadline = time.monotonic() + 30
        while running_now(web_server) != 1 and time.monotonic() < deadline:  # the gauge follows the engine's stats
            time.sleep(0.1)
        assert running_now(web_server) == 1
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"


@pytest.mark.slow
def test_cors_request_id_and_timing_headers(web_server):
    preflight = httpx.options(
        web_server.base_url + "/chat/completions",
        headers={"Origin": "http://app.example", "Access-Control-Request-Method": "POST"},
    )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] in ("*", "http://app.example")
    response = web_server.get("/v1/models", headers={**web_server.headers(), "X-Request-Id": "trace-42"})
    assert response.headers["x-request-id"] == "trace-42"
    assert float(response.headers["x-process-time"]) >= 0.0
    assert web_server.get("/health").headers["x-request-id"]  # generated when not given


@pytest.mark.slow
def test_api_keys_guard_inference_routes_not_the_pages(web_server):
    for path in ("/", "/dashboard", "/dashboard/stats", "/ui/config", "/docs", "/redoc", "/metrics"):
        assert httpx.get(web_server.url + path).status_code == 200, path
    assert httpx.post(web_server.url + "/", json={"inputs": "hi"}).status_code == 401  # TGI's POST /
    assert httpx.get(web_server.base_url + "/models").status_code == 401
    assert httpx.get(web_server.url + "/ui/config").json()["api_key_required"] is True


@pytest.mark.slow
def test_user_middleware_class_from_the_command_line(web_server):
    assert web_server.get("/health").headers.get_list(ORDER_HEADER) == ["class"]
    assert web_server.get("/v1/models").headers.get_list(ORDER_HEADER) == ["class"]


def _app_with(*paths: str) -> FastAPI:
    app = FastAPI()

    @app.get("/")
    async def root() -> PlainTextResponse:
        return PlainTextResponse("ok")

    for path in paths:
        add_user_middleware(app, path)
    return app


def test_user_middleware_function_and_order():
    app = _app_with("tests.web.sample_middleware.StampClassMiddleware", "tests.web.sample_middleware.stamp_function")
    with TestClient(app) as client:
        response = client.get("/")
    assert response.text == "ok"
    # the last given runs first (outermost), so it stamps the response last
    assert response.headers.get_list(ORDER_HEADER) == ["class", "function"]


@pytest.mark.parametrize(
    "path, message",
    [
        ("nomodule", "expected module.Name"),
        ("tests.web.no_such_module.Thing", "cannot import"),
        ("tests.web.sample_middleware.Missing", "cannot import"),
        ("tests.web.sample_middleware.NOT_MIDDLEWARE", "expected an ASGI middleware class or an async function"),
    ],
)
def test_bad_user_middleware_is_a_clear_start_up_error(path, message):
    with pytest.raises(ValueError, match=message):
        _app_with(path)
