"""Faults injected into real servers: the engine core killed mid-stream, clients that vanish with a TCP
reset, a client that stops reading, an overload burst. Each ends every request explicitly (completed,
an error event, or a 429 that never started it) and leaves nothing running or holding KV blocks."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import httpx
import psutil
import pytest

from tests.reliability.streams import request_bytes, slow_reader_socket, stream_then_reset
from tests.utils import RemoteServer, free_port, parse_metrics

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
ENGINE = f'{{model_name="{MODEL}",replica="0"}}'
QUIET = ["--log-stats-interval", "0", "--disable-access-log"]
LONG = {"max_tokens": 2000, "min_tokens": 2000, "ignore_eos": True}


def metrics(server: RemoteServer) -> dict[str, float]:
    return parse_metrics(httpx.get(server.url + "/metrics", timeout=30).text)


def wait_idle(server: RemoteServer, deadline_s: float = 120.0) -> dict[str, float]:
    end = time.monotonic() + deadline_s
    while True:
        values = metrics(server)
        idle = values[f"pagedserve:num_requests_running{ENGINE}"] == 0
        idle = idle and values[f"pagedserve:num_requests_waiting{ENGINE}"] == 0
        if idle or time.monotonic() > end:
            return values
        time.sleep(0.2)


def engine_core_process(server: RemoteServer) -> psutil.Process:
    """The forked engine core: the server's child holding the model (the largest one)."""
    children = psutil.Process(server.pid).children()
    assert children, "no engine core process"
    return max(children, key=lambda child: child.memory_info().rss)


async def status_until_503(call: Callable[[], Awaitable[httpx.Response]]) -> int | None:
    """Repeat ``call`` (100 tries, 50 ms apart) until it answers 503; its last status, or None once the
    connection is refused (the listener closed: also a refusal)."""
    status = None
    for _ in range(100):
        try:
            status = (await call()).status_code
        except httpx.HTTPError:
            return None
        if status == 503:
            break
        await asyncio.sleep(0.05)
    return status


def sse_data(lines: list[str]) -> list[str]:
    return [line[5:].strip() for line in lines if line.startswith("data:")]


def test_engine_core_killed_mid_stream_ends_every_stream_with_an_error():
    """SIGKILL the engine core under 32 streams: each ends with an error event (no hang, no silent end),
    /health answers 503 at once, and the server exits non-zero on its own so a supervisor restarts it."""
    with RemoteServer(QUIET) as server:
        core = engine_core_process(server)
        started: set[int] = set()

        async def one(client: httpx.AsyncClient, i: int) -> list[str]:
            body = {"model": MODEL, "prompt": f"Story number {i}:", "stream": True, **LONG}
            lines: list[str] = []
            try:
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        lines.append(line)
                        started.add(i)
            except httpx.HTTPError as exc:  # the connection dropped without an error event
                lines.append(f"transport error: {exc!r}")
            return lines

        async def run() -> tuple[list[list[str]], int | None]:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                tasks = [asyncio.create_task(one(client, i)) for i in range(32)]
                while len(started) < 32:
                    await asyncio.sleep(0.05)
                os.kill(core.pid, signal.SIGKILL)
                health = await status_until_503(lambda: client.get("/health", timeout=5))
                return await asyncio.wait_for(asyncio.gather(*tasks), 60), health

        streams, health = asyncio.run(run())
        assert health in (503, None)
        for lines in streams:
            events = sse_data(lines)
            errors = [json.loads(e) for e in events if e.startswith("{") and '"error"' in e]
            assert errors, f"a stream ended without an error event: {lines[-3:]}"
            assert all(e["error"]["message"] for e in errors)
            finished = [json.loads(e) for e in events if e.startswith("{") and '"finish_reason":"length"' in e]
            assert not finished  # nothing claims to have completed
        assert server.proc.wait(10) != 0


@pytest.fixture(scope="module")
def faulty_clients():
    """One server for the clients that vanish or stall; a short stall timeout."""
    with RemoteServer([*QUIET, "--stream-stall-timeout", "4"]) as server:
        yield server


def test_clients_vanishing_with_tcp_resets_leak_nothing(faulty_clients):
    server = faulty_clients
    rng = random.Random(0)
    host, port = server.host, server.port

    async def run() -> list[int]:
        jobs = []
        for i in range(200):
            if i % 2:
                path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": f"Tell story {i}."}]}
            else:
                path, body = "/v1/completions", {"prompt": f"Story {i}:"}
            body = {"model": MODEL, "stream": True, **body, **LONG}
            read = rng.choice([0, 0, 1, 200, 1000, 4000, 12000, 30000])  # 0: reset before the response
            jobs.append(stream_then_reset(host, port, path, body, read))
        return await asyncio.gather(*jobs)

    read = asyncio.run(run())
    assert sum(1 for got in read if got == 0) >= 20 and max(read) >= 12000
    values = wait_idle(server)
    assert values[f"pagedserve:num_requests_running{ENGINE}"] == 0
    assert values[f"pagedserve:num_requests_waiting{ENGINE}"] == 0
    assert values[f"pagedserve:kv_cache_usage_perc{ENGINE}"] == 0.0
    fresh = server.post("/v1/completions", json={"model": MODEL, "prompt": "Fresh:", "max_tokens": 8}, timeout=5)
    assert fresh.status_code == 200 and fresh.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_a_client_that_stops_reading_stalls_no_one_and_is_aborted(faulty_clients):
    server = faulty_clients
    aborts = f'pagedserve:slow_client_aborts_total{{model_name="{MODEL}"}}'
    before = metrics(server).get(aborts, 0.0)
    # big events (20 top logprobs each, 8 samples a step) fill the socket and transport buffers quickly
    body = {"model": MODEL, "stream": True, "logprobs": True, "top_logprobs": 20, "n": 8, **LONG}
    body["messages"] = [{"role": "user", "content": "Write a long essay."}]
    slow = slow_reader_socket(server.host, server.port)
    try:
        slow.sendall(request_bytes(server.host, server.port, "/v1/chat/completions", body))
        time.sleep(2)  # the slow stream's buffers fill; it reads nothing from here on

        async def normal(client: httpx.AsyncClient, i: int) -> tuple[int, str | None]:
            body = {"model": MODEL, "prompt": f"Count {i}:", "max_tokens": 48, "min_tokens": 48, "ignore_eos": True}
            body["stream"], tokens, finish = True, 0, None
            async with client.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    data = line[5:].strip() if line.startswith("data:") else ""
                    if data.startswith("{"):
                        choice = json.loads(data)["choices"][0]
                        tokens += 1
                        finish = choice["finish_reason"] or finish
            return tokens, finish

        async def run() -> list[tuple[int, str | None]]:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                return await asyncio.gather(*(normal(client, i) for i in range(4)))

        results = asyncio.run(run())
        during = metrics(server)
        assert all(finish == "length" and tokens >= 48 for tokens, finish in results), results
        assert during.get(aborts, 0.0) == before  # the others finished while the slow stream was held
        assert during[f"pagedserve:num_requests_running{ENGINE}"] >= 1  # ... and it still was
        end = time.monotonic() + 120
        while metrics(server).get(aborts, 0.0) == before and time.monotonic() < end:
            time.sleep(0.5)
        assert metrics(server).get(aborts, 0.0) == before + 1
    finally:
        slow.close()
    values = wait_idle(server)
    assert values[f"pagedserve:num_requests_running{ENGINE}"] == 0
    assert values[f"pagedserve:kv_cache_usage_perc{ENGINE}"] == 0.0


def test_overload_each_request_completes_fully_or_gets_429():
    """200 at once against 16 running + 16 queued: a 200 is a whole answer, a 429 carries Retry-After;
    nothing is truncated and nothing answers 5xx."""
    args = [*QUIET, "--max-num-seqs", "16", "--max-queued-requests", "16"]
    tokens = {"max_tokens": 24, "min_tokens": 24, "ignore_eos": True}
    with RemoteServer(args) as server:

        async def one(client: httpx.AsyncClient, i: int) -> str:
            if i % 2:
                body = {"model": MODEL, "prompt": f"Item {i}:", **tokens}
                response = await client.post("/v1/completions", json=body)
                if response.status_code == 200:
                    answer = response.json()
                    assert answer["usage"]["completion_tokens"] == 24
                    assert answer["choices"][0]["finish_reason"] == "length"
                    return "completed"
                return refused(response)
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"Item {i}"}], "stream": True, **tokens}
            body["stream_options"] = {"include_usage": True}
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    return refused(response)
                events = [line[5:].strip() async for line in response.aiter_lines() if line.startswith("data:")]
            assert events[-1] == "[DONE]"
            usage = json.loads(events[-2])["usage"]
            assert usage["completion_tokens"] == 24
            return "completed"

        def refused(response: httpx.Response) -> str:
            assert response.status_code == 429, response.text
            assert int(response.headers["retry-after"]) >= 1
            assert response.json()["error"]["type"] == "overloaded_error" and response.json()["error"]["message"]
            return "refused"

        async def run() -> list[str]:
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
                return await asyncio.gather(*(one(client, i) for i in range(200)))

        outcomes = asyncio.run(run())
        assert outcomes.count("completed") >= 32 and outcomes.count("refused") >= 1
        assert outcomes.count("completed") + outcomes.count("refused") == 200
        values = wait_idle(server)
        assert values[f"pagedserve:kv_cache_usage_perc{ENGINE}"] == 0.0
        # a refused request never started: the engine finished exactly the completed ones
        finished = [v for k, v in values.items() if k.startswith("pagedserve:request_success_total{")]
        assert sum(finished) == outcomes.count("completed")


@pytest.fixture(scope="module")
def small_cache():
    """A KV cache of 960 tokens (15 blocks of 64) under a 256-token context; the SIGTERM test ends it."""
    args = [*QUIET, "--max-model-len", "256", "--kv-cache-memory", "24MiB", "--block-size", "64"]
    with RemoteServer([*args, "--shutdown-timeout", "60"]) as server:
        yield server


def test_n_samples_beyond_the_cache_complete_through_preemption(small_cache):
    """8 samples of 200 tokens need some 1,700 tokens of KV at once and the cache holds 960: samples are
    preempted and recomputed in turn, and all complete (no 400, no preemption loop)."""
    server = small_cache
    body = {"model": MODEL, "prompt": "List animals:", "n": 8, "max_tokens": 200, "min_tokens": 200}
    body |= {"ignore_eos": True, "temperature": 0.8, "seed": 1}
    response = server.post("/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["usage"]["completion_tokens"] == 8 * 200
    assert {choice["finish_reason"] for choice in answer["choices"]} == {"length"}
    assert metrics(server)[f"pagedserve:num_preemptions_total{ENGINE}"] > 0


def test_sigterm_to_the_process_group_drains_streams_then_exits_zero(small_cache):
    """SIGTERM to the whole group (systemd's default, `timeout`): the engine core ignores it, the server
    refuses new work with 503 and lets its 8 in-flight streams finish, then exits 0. Last to use the
    small-cache server: it stops it."""
    server = small_cache
    started: set[int] = set()

    async def one(client: httpx.AsyncClient, i: int) -> list[str]:
        body = {"model": MODEL, "prompt": f"Count {i}:", "stream": True}
        body |= {"max_tokens": 60, "min_tokens": 60, "ignore_eos": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            events = []
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    events.append(line[5:].strip())
                    started.add(i)
        return events

    async def run() -> tuple[list[list[str]], int | None]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            tasks = [asyncio.create_task(one(client, i)) for i in range(8)]
            while len(started) < 8:
                await asyncio.sleep(0.05)
            os.killpg(server.pid, signal.SIGTERM)
            refused = await status_until_503(lambda: client.post("/v1/completions", json={"prompt": "x"}, timeout=10))
            return await asyncio.gather(*tasks), refused

    streams, refused = asyncio.run(run())
    assert refused in (503, None)
    for events in streams:
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert not any("error" in chunk for chunk in chunks)
    assert server.proc.wait(60) == 0


def test_kv_cache_smaller_than_one_request_is_refused_at_start_up():
    launcher = [sys.executable, "-m", "pagedserve.cli", "serve", "--port", str(free_port())]
    done = subprocess.run(
        [*launcher, "--kv-cache-memory", "1MiB", "--max-model-len", "2048"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode != 0
    assert "fewer than one request of max_model_len=2048 needs" in done.stdout + done.stderr
