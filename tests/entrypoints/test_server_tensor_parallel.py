"""`pagedserve serve --tensor-parallel-size 2`: a real server whose model is split over two processes
serves the OpenAI and TGI clients (greedy, sampled with n > 1, streamed, JSON-schema output), and a
killed worker process takes the server down with a non-zero exit and a message naming the rank,
whether a request was running or the server was idle."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx
import pytest

from tests.utils import RemoteServer

pytestmark = pytest.mark.slow

TP_ARGS = ["--tensor-parallel-size", "2", "--kv-cache-memory", "512MiB"]


def worker_pid(server: RemoteServer) -> int:
    match = re.search(r"tensor parallelism: 2 ranks \(workers rank 1 pid (\d+)\)", server.log_text())
    assert match, server.log_text()[-3000:]
    return int(match.group(1))


def wait_for_exit(server: RemoteServer, timeout: float = 60.0) -> int:
    code = server.proc.wait(timeout)
    assert code != 0
    return code


def test_clients_then_a_worker_killed_mid_request():
    with RemoteServer(TP_ARGS) as server:
        assert "tensor parallel: 2 ranks" in server.log_text()
        client = server.openai_client()
        model = client.models.list().data[0].id
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Name three colors."}], max_tokens=24, temperature=0
        )
        assert chat.choices[0].message.content.strip() and chat.usage.completion_tokens > 0
        schema = {
            "type": "object",
            "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
            "required": ["city", "population"],
            "additionalProperties": False,
        }
        structured = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "A city and its population as JSON."}],
            max_tokens=80,
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
        )
        value = json.loads(structured.choices[0].message.content)
        assert set(value) == {"city", "population"} and isinstance(value["population"], int)
        texts: dict[int, str] = {}
        stream = client.completions.create(
            model=model, prompt="Once upon a time", max_tokens=16, n=2, seed=5, temperature=0.9, stream=True
        )
        for chunk in stream:
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + choice.text
        assert set(texts) == {0, 1} and all(texts.values())

        from text_generation import Client

        tgi = Client(server.url, timeout=60).generate("The capital of France is", max_new_tokens=8)
        assert tgi.details.generated_tokens == 8

        # a worker dies while a long request runs: the request fails with a 500 naming it, the server exits
        result: dict[str, httpx.Response] = {}

        def long_request() -> None:
            result["response"] = server.post(
                "/v1/completions", json={"prompt": "Tell me a story", "max_tokens": 3000, "ignore_eos": True}
            )

        thread = threading.Thread(target=long_request)
        thread.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and "pagedserve:num_requests_running" not in _running(server):
            time.sleep(0.2)
        os.kill(worker_pid(server), signal.SIGKILL)
        thread.join(120)
        response = result["response"]
        assert response.status_code == 500
        assert "tensor-parallel worker rank 1" in response.json()["error"]["message"]
        wait_for_exit(server)
        assert "was killed by signal 9" in server.log_text()


def _running(server: RemoteServer) -> str:
    """The metrics lines saying a request runs ("" while none does)."""
    text = server.get("/metrics").text
    return "\n".join(
        line
        for line in text.splitlines()
        if line.startswith("pagedserve:num_requests_running") and not line.endswith(" 0.0")
    )


def test_a_worker_killed_while_idle_stops_the_server():
    with RemoteServer(TP_ARGS) as server:
        ok = server.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
        assert ok.status_code == 200
        os.kill(worker_pid(server), signal.SIGKILL)
        wait_for_exit(server)  # found by the idle engine's health check, no request needed
        assert re.search(r"tensor-parallel worker rank 1 \(pid \d+\) was killed by signal 9", server.log_text())
