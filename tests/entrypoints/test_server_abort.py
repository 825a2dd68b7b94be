"""Client disconnects abort their requests at once (KV freed), and /metrics shows it."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from pagedserve.bench.monitor import parse_cache_config
from tests.utils import parse_metrics

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
LABEL = f'{{model_name="{MODEL}"}}'  # per-request series
ENGINE = f'{{model_name="{MODEL}",replica="0"}}'  # engine-state series: one per replica
LONG = {"max_tokens": 4000, "min_tokens": 4000, "ignore_eos": True}


def metrics(server) -> dict[str, float]:
    return parse_metrics(httpx.get(server.url + "/metrics", timeout=30).text)


def wait_idle(server, deadline_s: float = 120.0) -> dict[str, float]:
    """Poll until no request runs or waits (the aborts are asynchronous); returns the last sample."""
    end = time.monotonic() + deadline_s
    while True:
        values = metrics(server)
        idle = (
            values[f"pagedserve:num_requests_running{ENGINE}"] == 0
            and values[f"pagedserve:num_requests_waiting{ENGINE}"] == 0
        )
        if idle or time.monotonic() > end:
            return values
        time.sleep(0.2)


def test_metrics_names_and_counts(server, client):
    before = metrics(server)
    for _ in range(3):
        client.completions.create(
            model=MODEL, prompt="Tell me about metrics", max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
        )
    after = wait_idle(server)
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "num_preemptions_total",
    ):
        assert f"pagedserve:{name}{ENGINE}" in after
    for name in ("prompt_tokens_total", "generation_tokens_total"):
        assert f"pagedserve:{name}{LABEL}" in after
    for name in (
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
    ):
        assert f"pagedserve:{name}_count{LABEL}" in after
    assert "process_resident_memory_bytes" in after
    info = [key for key in after if key.startswith("pagedserve:cache_config_info{")]
    assert len(info) == 1 and after[info[0]] == 1.0
    shape = parse_cache_config(f"{info[0]} 1.0\n")  # vLLM's label names: block_size, num_gpu_blocks
    assert shape is not None and shape["num_gpu_blocks"] > 0 and shape["block_size"] > 0

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    success = f'pagedserve:request_success_total{{finished_reason="length",model_name="{MODEL}"}}'
    assert delta(success) == 3
    assert delta(f"pagedserve:generation_tokens_total{LABEL}") == 15
    assert delta(f"pagedserve:time_to_first_token_seconds_count{LABEL}") == 3
    assert delta(f"pagedserve:e2e_request_latency_seconds_count{LABEL}") == 3
    assert delta(f"pagedserve:inter_token_latency_seconds_count{LABEL}") == 3 * 4
    for name in ("queue_time", "prefill_time", "decode_time", "inference_time", "time_per_output_token"):
        assert delta(f"pagedserve:request_{name}_seconds_count{LABEL}") == 3
    prefill, decode, inference = (
        delta(f"pagedserve:request_{phase}_time_seconds_sum{LABEL}") for phase in ("prefill", "decode", "inference")
    )
    assert prefill > 0 and decode > 0 and inference == pytest.approx(prefill + decode)  # per request, summed
    assert inference <= delta(f"pagedserve:e2e_request_latency_seconds_sum{LABEL}")
    # one request at a time: a prefill step (the prompt) and 4 one-token decode steps each
    assert delta(f"pagedserve:iteration_tokens_total_count{ENGINE}") == 3 * 5
    assert (
        delta(f"pagedserve:iteration_tokens_total_sum{ENGINE}")
        == delta(f"pagedserve:prompt_tokens_total{LABEL}") + 3 * 4
    )
    assert delta(f'pagedserve:iteration_tokens_total_bucket{{le="1.0",model_name="{MODEL}",replica="0"}}') == 3 * 4
    assert delta(f"pagedserve:prompt_tokens_total{LABEL}") > 0
    busy, forward = (
        delta(f"pagedserve:engine_busy_seconds_total{ENGINE}"),
        delta(f"pagedserve:model_forward_seconds_total{ENGINE}"),
    )
    assert 0 < forward <= busy  # the forward is part of the busy time, never more
    forward_cpu = delta(f"pagedserve:model_forward_cpu_seconds_total{ENGINE}")
    assert 0 < forward_cpu <= delta(f"pagedserve:engine_core_cpu_seconds_total{ENGINE}")  # CPU of the core's process


def test_streaming_disconnects_free_everything(server):
    """50 long streams abandoned by their clients mid-stream: nothing keeps running, KV usage returns to idle.

    Half close the connection after reading a few chunks, half are cancelled by a wall-clock deadline
    (whatever they have read by then); neither depends on how fast the server produces tokens.
    """
    idle_kv = wait_idle(server)[f"pagedserve:kv_cache_usage_perc{ENGINE}"]

    async def one(client: openai.AsyncOpenAI, i: int) -> str:
        messages = [{"role": "user", "content": f"Write a very long story number {i}."}]

        async def consume() -> str:
            stream = await client.chat.completions.create(model=MODEL, messages=messages, stream=True, extra_body=LONG)
            async with stream:
                chunks = 0
                async for _ in stream:
                    chunks += 1
                    if i % 2 == 0 and chunks == 3:
                        return "closed"
            return "completed"

        try:
            return await asyncio.wait_for(consume(), timeout=1.0 + (i % 5) * 0.2)
        except (TimeoutError, openai.APITimeoutError):
            return "cancelled"

    async def run() -> list[str]:
        client = server.async_openai_client(timeout=120)
        try:
            return await asyncio.gather(*(one(client, i) for i in range(50)))
        finally:
            await client.close()

    outcomes = asyncio.run(run())
    assert "completed" not in outcomes
    assert outcomes.count("cancelled") >= 25
    values = wait_idle(server)
    assert values[f"pagedserve:num_requests_running{ENGINE}"] == 0
    assert values[f"pagedserve:num_requests_waiting{ENGINE}"] == 0
    assert values[f"pagedserve:kv_cache_usage_perc{ENGINE}"] == idle_kv == 0.0
    abort = f'pagedserve:request_success_total{{finished_reason="abort",model_name="{MODEL}"}}'
    assert values[abort] >= 50
    fresh = server.openai_client().completions.create(model=MODEL, prompt="Fresh request:", max_tokens=8)
    assert fresh.choices[0].finish_reason in ("length", "stop")


def test_non_streaming_disconnect_aborts(server):
    idle = wait_idle(server)
    aborted_before = idle.get(f'pagedserve:request_success_total{{finished_reason="abort",model_name="{MODEL}"}}', 0)
    body = {"model": MODEL, "prompt": "Write forever:", **LONG}
    for _ in range(3):
        with pytest.raises(httpx.TimeoutException):
            server.post("/v1/completions", json=body, timeout=0.5)
        with pytest.raises(httpx.TimeoutException):
            server.post(
                "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Go on"}], **LONG}, timeout=0.5
            )
    values = wait_idle(server)
    assert values[f"pagedserve:num_requests_running{ENGINE}"] == 0
    assert values[f"pagedserve:kv_cache_usage_perc{ENGINE}"] == 0.0
    aborted = values[f'pagedserve:request_success_total{{finished_reason="abort",model_name="{MODEL}"}}']
    assert aborted - aborted_before == 6
    assert server.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 3}}).status_code == 200
