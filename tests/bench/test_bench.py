"""pagedserve bench: SSE parsing, per-request timing, metrics, arrivals, workloads, report and plots;
then the whole tool against a real pagedserve server (marked slow)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
from unittest import mock

import httpx
import numpy as np
import pytest

from pagedserve.bench import cli
from pagedserve.bench.datasets import GROUNDED_TASKS, WORKLOADS, PromptFactory, RequestSource, encode
from pagedserve.bench.kv_demand import demand_tokens, kv_demand_summary, reserved_tokens
from pagedserve.bench.metrics import parse_slo, stats_ms, summarize, tokens_streamed_after
from pagedserve.bench.monitor import ServerMonitor, parse_cache_config, parse_prometheus, prefix_cache_counters
from pagedserve.bench.report import build_summary, summary_json, terminal_report, write_outputs
from pagedserve.bench.request_funcs import (
    RequestFuncInput,
    RequestFuncOutput,
    SSEDecoder,
    async_request_openai,
    error_message_from_body,
)
from pagedserve.bench.runner import BenchOptions, LoadPoint, Target, arrival_times, run_sweep
from tests.utils import RemoteServer

SUMMARY_FIELDS = (
    "completed",
    "failed",
    "incomplete",
    "duration_s",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "ttft_ms",
    "ttft_started_ms",
    "started",
    "tpot_ms",
    "itl_ms",
    "e2el_ms",
    "peak_rss_bytes",
    "avg_rss_bytes",
    "memory_efficiency",
    "peak_kv_usage",
    "avg_kv_usage",
    "kv_efficiency",
    "prefix_cache_hit_rate",
    "cost_per_1k_output_tokens",
    "failures",
    "goodput",
    "peak_kv_demand_tokens",
    "avg_kv_demand_tokens",
    "kv_demand_efficiency",
    "kv_block_size",
    "kv_num_blocks",
    "kv_allocated_per_needed",
    "kv_reservation_efficiency",
    "kv_reserved_per_needed",
)


# ---- SSE parsing ------------------------------------------------------------------------------

STREAM = (
    ": keep-alive comment\r\n\r\n"
    'data: {"choices":[{"text":"héllo"}]}\r\n\r\n'
    "event: message\n"
    'data: {"choices":[{"text":" wörld ✓"}]}\n\n'
    "data: line one\ndata: line two\n\n"
    'data:{"choices":[{"text":"🙂"}]}\r\r'
    "data: [DONE]\n\n"
).encode()
EXPECTED = [
    '{"choices":[{"text":"héllo"}]}',
    '{"choices":[{"text":" wörld ✓"}]}',
    "line one\nline two",
    '{"choices":[{"text":"🙂"}]}',
    "[DONE]",
]


def _parse(chunks: list[bytes]) -> list[str]:
    decoder = SSEDecoder()
    events = []
    for chunk in chunks:
        events += decoder.feed(chunk)
    return events + decoder.flush()


def test_sse_whole_stream():
    assert _parse([STREAM]) == EXPECTED


def test_sse_split_at_every_byte_pair():
    for i in range(1, len(STREAM)):
        for j in range(i, len(STREAM), 7):
            assert _parse([STREAM[:i], STREAM[i:j], STREAM[j:]]) == EXPECTED, (i, j)


def test_sse_one_byte_at_a_time_and_random_splits():
    assert _parse([STREAM[i : i + 1] for i in range(len(STREAM))]) == EXPECTED
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(STREAM)), 6))
        parts = [STREAM[a:b] for a, b in zip([0, *cuts], [*cuts, len(STREAM)])]
        assert _parse(parts) == EXPECTED


def test_sse_last_event_without_blank_line():
    assert _parse([b'data: {"a": 1}\n\ndata: [DONE]']) == ['{"a": 1}', "[DONE]"]


def test_error_message_shapes():
    assert error_message_from_body(b'{"error": {"message": "bad key", "type": "x"}}') == "bad key"
    assert (
        error_message_from_body(b'{"error": "Model is overloaded", "error_type": "overloaded"}')
        == "Model is overloaded"
    )
    assert error_message_from_body(b'{"detail": "Not Found"}') == "Not Found"
    assert error_message_from_body(b"plain text") == "plain text"


# ---- a fake OpenAI-compatible server over httpx.MockTransport -----------------------------------


def _fake_server(delay: float = 0.002, split: int = 7, usage: bool = True, bad_key: str | None = None):
    """Streams ``max_tokens`` one-word chunks, cut into ``split``-byte pieces, with usage at the end."""

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "fake-model"}]})
        if request.url.path == "/metrics":
            return httpx.Response(
                200,
                text='process_resident_memory_bytes 1.5e8\npagedserve:kv_cache_usage_perc{m="x"} 0.25\n'
                'vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="100"} 1.0\n',
            )
        if request.url.path == "/version":
            return httpx.Response(200, json={"version": "0.0-fake"})
        if bad_key and request.headers.get("authorization") == f"Bearer {bad_key}":
            return httpx.Response(401, json={"error": {"message": "Invalid API key", "type": "Unauthorized"}})
        body = json.loads(request.content)
        num_tokens = body["max_tokens"]
        prompt = body.get("prompt") or body["messages"][0]["content"]
        if len(prompt) > 5000:
            return httpx.Response(400, json={"error": {"message": "prompt too long", "type": "BadRequestError"}})

        async def stream():
            data = b""
            for i in range(num_tokens):
                await asyncio.sleep(delay)
                chunk = {
                    "choices": [
                        {"index": 0, "text": f" w{i}", "finish_reason": "length" if i == num_tokens - 1 else None}
                    ]
                }
                data += f"data: {json.dumps(chunk)}\n\n".encode()
                while len(data) >= split:
                    yield data[:split]
                    data = data[split:]
            if usage and body.get("stream_options", {}).get("include_usage"):
                data += (
                    "data: "
                    + json.dumps(
                        {
                            "choices": [],
                            "usage": {
                                "prompt_tokens": 17,
                                "completion_tokens": num_tokens,
                                "total_tokens": 17 + num_tokens,
                            },
                        }
                    )
                    + "\n\n"
                ).encode()
            data += b"data: [DONE]\n\n"
            yield data

        return httpx.Response(200, content=stream(), headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler)


def _input(**changes) -> RequestFuncInput:
    values = dict(
        prompt="hello there", prompt_len=2, output_len=5, model="fake-model", api_url="http://fake/v1/completions"
    )
    values.update(changes)
    return RequestFuncInput(**values)


async def _one(transport: httpx.MockTransport, inp: RequestFuncInput) -> RequestFuncOutput:
    async with httpx.AsyncClient(transport=transport) as client:
        return await async_request_openai(client, inp)


def test_request_records_timing_and_usage():
    out = asyncio.run(_one(_fake_server(), _input(output_len=6)))
    assert out.success and not out.error
    assert out.generated_text == "".join(f" w{i}" for i in range(6))
    assert out.usage_reported and out.output_tokens == 6 and out.prompt_len == 17
    assert out.num_chunks == 6 and len(out.itl) == 5
    assert 0 < out.ttft <= out.latency
    assert out.ttft + sum(out.itl) <= out.latency + 1e-9
    assert out.finish_reason == "length"


def test_request_without_usage_and_chat_payload():
    out = asyncio.run(_one(_fake_server(usage=False), _input(include_usage=False)))
    assert out.success and not out.usage_reported and out.output_tokens == 0 and out.prompt_len == 2


def test_request_errors_are_recorded_not_raised():
    out = asyncio.run(_one(_fake_server(bad_key="wrong"), _input(api_key="wrong")))
    assert not out.success and out.status_code == 401
    assert out.error_reason == "HTTP 401" and out.error == "Invalid API key"

    async def in_stream_error(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            200, content=b'data: {"choices":[{"text":"a"}]}\n\ndata: {"error": {"message": "boom"}}\n\n'
        )

    out = asyncio.run(_one(httpx.MockTransport(in_stream_error), _input()))
    assert not out.success and out.error_reason == "stream error" and out.error == "boom"

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    out = asyncio.run(_one(httpx.MockTransport(refuse), _input()))
    assert not out.success and out.error_reason.startswith("connection error")


# ---- metrics ----------------------------------------------------------------------------------


def test_stats_percentiles_match_numpy_and_are_ordered():
    rng = np.random.default_rng(0)
    values = list(rng.exponential(0.1, size=501))
    stats = stats_ms(values)
    assert stats["p50"] == pytest.approx(np.percentile(values, 50) * 1000)
    assert stats["p99"] == pytest.approx(np.percentile(values, 99) * 1000)
    assert stats["min"] <= stats["p50"] <= stats["p90"] <= stats["p99"] <= stats["max"]
    assert stats["mean"] == pytest.approx(np.mean(values) * 1000)
    assert stats_ms([])["p99"] == 0.0


def test_parse_slo():
    assert parse_slo("ttft:500ms,tpot:50ms,e2el:2s") == {"ttft": 500.0, "tpot": 50.0, "e2el": 2000.0}
    assert parse_slo(None) == {}
    with pytest.raises(ValueError):
        parse_slo("latency:5ms")


def test_summarize_goodput_and_failures():
    fast = RequestFuncOutput(success=True, prompt_len=10, output_tokens=11, ttft=0.1, latency=0.6, itl=[0.05] * 10)
    slow = RequestFuncOutput(success=True, prompt_len=10, output_tokens=11, ttft=0.9, latency=2.9, itl=[0.2] * 10)
    bad = RequestFuncOutput(success=False, error="Invalid API key", error_reason="HTTP 401")
    summary = summarize([fast, slow, bad, bad], duration_s=2.0, slos=parse_slo("ttft:500ms,tpot:100ms"))
    assert summary.completed == 2 and summary.failed == 2
    assert summary.failures == {"HTTP 401": 2} and summary.failure_examples["HTTP 401"] == "Invalid API key"
    assert summary.output_throughput == pytest.approx(11.0)
    assert summary.total_token_throughput == pytest.approx(21.0)
    assert summary.goodput == pytest.approx(0.5)
    assert summary.tpot_ms["mean"] == pytest.approx((50.0 + 200.0) / 2)
    assert list(summary.to_json())[-3:] == ["slo", "goodput", "goodput_fraction"]
    bare = summarize([fast], duration_s=1.0).to_json()  # no SLOs: goodput null, no slo / goodput_fraction
    assert bare["goodput"] is None and "slo" not in bare and "goodput_fraction" not in bare


def test_summarize_counts_the_first_tokens_of_cut_off_requests():
    """TTFT 'started' covers requests cut off at the window's end that got a first token; the completed-only TTFT does not."""
    done = RequestFuncOutput(success=True, prompt_len=10, output_tokens=3, ttft=0.1, latency=0.3, itl=[0.1] * 2)
    cut = RequestFuncOutput(prompt_len=500, output_tokens=4, ttft=0.9, itl=[0.1] * 3, error_reason="incomplete")
    queued = RequestFuncOutput(prompt_len=500, error_reason="incomplete")  # no first token yet
    summary = summarize([done, cut, queued], duration_s=1.0)
    assert summary.completed == 1 and summary.incomplete == 2 and summary.started == 2
    assert summary.ttft_ms["max"] == pytest.approx(100.0)
    assert summary.ttft_started_ms["min"] == pytest.approx(100.0)
    assert summary.ttft_started_ms["max"] == pytest.approx(900.0)


def test_parse_prometheus():
    text = (
        "# HELP x\nprocess_resident_memory_bytes 1.2e+09\n"
        'pagedserve:kv_cache_usage_perc{model_name="a b"} 0.5\nother 3\n'
    )
    values = parse_prometheus(text, ("process_resident_memory_bytes", "pagedserve:kv_cache_usage_perc"))
    assert values == {"process_resident_memory_bytes": 1.2e9, "pagedserve:kv_cache_usage_perc": 0.5}


def test_prefix_cache_counters_sum_every_series_and_give_the_phase_hit_rate():
    ours = (
        "# HELP pagedserve:prefix_cache_queries_total Prefix cache queries\n"
        'pagedserve:prefix_cache_queries_total{model_name="m",replica="0"} 100.0\n'
        'pagedserve:prefix_cache_queries_total{model_name="m",replica="1"} 50.0\n'
        'pagedserve:prefix_cache_hits_total{model_name="m",replica="0"} 30.0\n'
        'pagedserve:prefix_cache_hits_total{model_name="m",replica="1"} 0.0\n'
    )
    assert prefix_cache_counters(ours) == (150.0, 30.0)
    vllm = (
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 8.0\nvllm:prefix_cache_hits_total{engine="0"} 2.0\n'
    )
    assert prefix_cache_counters(vllm) == (8.0, 2.0)
    assert prefix_cache_counters("pagedserve:kv_cache_usage_perc 0.5\n") is None
    monitor = ServerMonitor(None, None, None)  # type: ignore[arg-type]
    assert monitor.summary().prefix_cache_hit_rate is None  # no counters seen
    monitor.prefix_counters = [(150.0, 30.0), (250.0, 30.0), (350.0, 110.0)]
    assert monitor.summary().prefix_cache_hit_rate == pytest.approx(80 / 200)  # first to last sample
    monitor.prefix_counters = [(150.0, 30.0), (150.0, 30.0)]
    assert monitor.summary().prefix_cache_hit_rate is None  # nothing queried in the phase


def test_parse_cache_config():
    vllm = (
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        'vllm:cache_config_info{block_size="128",cache_dtype="auto",enable_prefix_caching="True",'
        'note="a \\"quoted\\" {x}",num_gpu_blocks="1456",num_cpu_blocks="None"} 1.0\n'
    )
    assert parse_cache_config(vllm) == {"block_size": 128, "num_gpu_blocks": 1456}
    ours = 'pagedserve:cache_config_info{block_size="16",num_gpu_blocks="90"} 1.0\n'
    assert parse_cache_config("x 1\n" + ours) == {"block_size": 16, "num_gpu_blocks": 90}
    assert parse_cache_config('vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0\n') is None
    assert parse_cache_config("pagedserve:kv_cache_usage_perc 0.5\n") is None


def test_kv_demand_is_the_context_of_the_requests_in_flight():
    """Each request holds its prompt plus the tokens streamed so far, from its first token to its end."""
    done = RequestFuncOutput(
        success=True, prompt_len=10, output_tokens=5, start_time=0.0, ttft=1.0, itl=[1.0] * 4, latency=5.5
    )  # chunks at 1, 2, 3, 4, 5; ends at 5.5
    cut = RequestFuncOutput(
        success=False, error_reason="incomplete", prompt_len=20, output_tokens=1, start_time=2.0, ttft=1.0
    )  # first token at 3, still running when the window ends
    failed = RequestFuncOutput(success=False, error_reason="HTTP 500", prompt_len=99, start_time=0.0)
    pairs = RequestFuncOutput(
        success=True, prompt_len=3, output_tokens=4, start_time=0.0, ttft=0.5, itl=[0.5], latency=1.2
    )  # two tokens per chunk, chunks at 0.5 and 1.0
    done.expected_output_len, cut.expected_output_len = 8, 30  # max_tokens; pairs: unknown (0), 4 streamed
    outputs = [done, cut, failed, pairs]
    times = [0.2, 0.5, 1.0, 2.5, 5.2, 5.5, 9.0]
    expected = [0, 3 + 2, 11 + 3 + 4, 12, 15 + 21, 21, 21]
    assert demand_tokens(outputs, times, window_end=10.0) == expected
    assert demand_tokens(outputs, times[::-1], window_end=10.0) == expected[::-1]  # in the order given
    assert demand_tokens(outputs, [9.0], window_end=8.0) == [0]  # the cut request ended with the window
    # reserving prompt + max_tokens: flat over the same lives
    reserved = [0, 7, 18 + 7, 18, 18 + 50, 50, 50]
    assert reserved_tokens(outputs, times, window_end=10.0) == reserved
    usage = [0.1] * len(times)  # 16 tokens allocated at each instant (1 of 10 blocks of 16)
    summary = kv_demand_summary(outputs, times, usage, 10.0, {"block_size": 16, "num_gpu_blocks": 10})
    assert summary.peak_kv_demand_tokens == 36
    assert summary.avg_kv_demand_tokens == pytest.approx(sum(expected) / len(times))
    assert summary.kv_demand_efficiency == pytest.approx(sum(expected) / len(times) / 36)
    assert summary.kv_allocated_per_needed == pytest.approx(16 * len(times) / sum(expected))
    assert (summary.kv_block_size, summary.kv_num_blocks) == (16, 10)
    assert summary.kv_reservation_efficiency == pytest.approx(sum(reserved) / len(times) / 68)
    assert summary.kv_reserved_per_needed == pytest.approx(sum(reserved) / sum(expected))
    bare = kv_demand_summary(outputs, times, [], 10.0, None)  # no KV gauge, no cache shape
    assert bare.kv_demand_efficiency == summary.kv_demand_efficiency
    assert bare.kv_allocated_per_needed is None and bare.kv_block_size is None
    idle = kv_demand_summary([failed], times, usage, 10.0, {"block_size": 16, "num_gpu_blocks": 10})
    assert idle.peak_kv_demand_tokens == 0 and idle.kv_demand_efficiency is None
    assert idle.kv_allocated_per_needed is None and idle.kv_block_size == 16
    assert idle.kv_reservation_efficiency is None and idle.kv_reserved_per_needed is None


# ---- arrivals ---------------------------------------------------------------------------------


@pytest.mark.parametrize("rate,burstiness", [(5.0, 1.0), (20.0, 0.5), (2.0, 4.0)])
def test_arrival_times_match_rate_and_burstiness(rate, burstiness):
    n = 4000
    times = arrival_times(n, rate, burstiness, seed=7)
    assert times[0] == 0.0 and all(b >= a for a, b in zip(times, times[1:]))
    gaps = np.diff(times)
    # gamma(k, 1/(rate k)): mean 1/rate, coefficient of variation 1/sqrt(k); 5 standard errors
    stderr = (1 / rate) / math.sqrt(burstiness * len(gaps))
    assert abs(gaps.mean() - 1 / rate) < 5 * stderr
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)


def test_infinite_rate_sends_everything_at_once():
    assert arrival_times(5, math.inf) == [0.0] * 5


# ---- workloads --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def factory(tokenizer):
    return PromptFactory(tokenizer)


def test_workload_prompts_have_exact_lengths(tokenizer, factory):
    for name in ("short", "medium", "long"):
        ((_, input_len, output_len),) = WORKLOADS[name]
        for sample in RequestSource(name, factory, seed=1).take(5):
            assert sample.prompt_len == input_len == len(encode(tokenizer, sample.prompt))
            assert sample.output_len == output_len and sample.workload == name


def test_mixed_workload_proportions(factory):
    samples = RequestSource("mixed", factory, seed=2).take(50)
    counts = {name: sum(s.workload == name for s in samples) for name in ("short", "medium", "long")}
    assert counts == {"short": 10, "medium": 25, "long": 15}


def test_prompts_are_real_text_and_differ_between_seeds(factory):
    first = RequestSource("short", factory, seed=3).take(20)
    again = RequestSource("short", factory, seed=3).take(20)
    other = RequestSource("short", factory, seed=4).take(20)
    assert [s.prompt for s in first] == [s.prompt for s in again]
    assert len({s.prompt[:40] for s in first + other}) == 40
    assert all(" the " in s.prompt or " a " in s.prompt or len(s.prompt.split()) > 10 for s in first)


def test_random_shared_prefix_and_chat_lengths(tokenizer, factory):
    randoms = RequestSource("random", factory, seed=5, input_len=64, output_len=32, range_ratio=0.5).take(20)
    assert all(32 <= s.prompt_len <= 96 and 16 <= s.output_len <= 48 for s in randoms)
    assert len({s.prompt_len for s in randoms}) > 1
    shared = RequestSource("shared-prefix", factory, seed=6, input_len=30, output_len=8, shared_prefix_len=200).take(4)
    prefix = shared[0].prompt[:300]
    assert all(s.prompt.startswith(prefix) for s in shared) and len({s.prompt for s in shared}) == 4
    assert all(s.prompt_len == len(encode(tokenizer, s.prompt)) for s in shared)
    chat = PromptFactory(tokenizer, "chat")
    text, prompt_len = chat.text(80, random.Random(0))
    templated = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    assert prompt_len == 80 == len(templated)


def test_grounded_workload_repeats_a_passage_of_its_prompt(tokenizer, factory):
    samples = RequestSource("grounded", factory, seed=7, input_len=96).take(6)
    assert len({s.prompt for s in samples}) == 6 and {s.workload for s in samples} == {"grounded"}
    for sample in samples:
        assert sample.prompt_len == len(encode(tokenizer, sample.prompt))
        # the prompt is one task template around a passage of ~input_len tokens; the answer may copy it all
        templates = [t.split("{passage}") for t in GROUNDED_TASKS]
        head, tail = next((h, t) for h, t in templates if sample.prompt.startswith(h) and sample.prompt.endswith(t))
        passage_len = len(encode(tokenizer, sample.prompt[len(head) : len(sample.prompt) - len(tail)]))
        assert abs(passage_len - 96) <= 4
        assert sample.output_len == passage_len + 16
    fixed = RequestSource("grounded", factory, seed=7, input_len=96, output_len_override=20).take(2)
    assert [s.output_len for s in fixed] == [20, 20]


def test_sharegpt_workload(tmp_path, factory):
    data = [
        {
            "conversations": [
                {"from": "human", "value": f"Question {i}: what is the capital of country number {i}?"},
                {"from": "gpt", "value": "It is a city with many old buildings and a river. " * (i + 1)},
            ]
        }
        for i in range(6)
    ] + [{"conversations": [{"from": "human", "value": "hi"}]}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    samples = RequestSource("sharegpt", factory, seed=1, dataset_path=str(path)).take(8)
    assert {s.workload for s in samples} == {"sharegpt"} and all(s.output_len >= 4 for s in samples)
    assert len({s.prompt for s in samples}) == 6


# ---- the whole tool against the fake server: summary, report, plots ----------------------------


def test_sweep_summary_report_and_plots(tmp_path, factory):
    targets = [
        Target.parse("a=http://fake-a"),
        Target.parse("b=http://fake-b/v1"),
        Target.parse("c=http://fake-c,api_key=wrong"),
    ]
    points = [LoadPoint(concurrency=1), LoadPoint(concurrency=4), LoadPoint(request_rate=50.0, burstiness=1.0)]
    options = BenchOptions(
        num_prompts=6,
        num_warmups=1,
        ignore_eos=True,
        slos=parse_slo("ttft:1s"),
        price_per_hour=2.0,
        memory_interval=0.05,
        progress=False,
    )
    results, info = asyncio.run(
        run_sweep(
            targets,
            ["short", "mixed"],
            points,
            options,
            factory,
            base_seed=11,
            source_kwargs={"output_len_override": 4},
            transport=_fake_server(delay=0.001, bad_key="wrong"),
        )
    )
    assert [(r.target.name, r.workload, r.point.label) for r in results][:3] == [
        ("a", "short", "c=1"),
        ("b", "short", "c=1"),
        ("c", "short", "c=1"),
    ]
    assert info["a"]["model"] == "fake-model" and info["a"]["server_version"] == "0.0-fake"
    summary = build_summary(results, info, {"price_per_hour": 2.0}, "pagedserve bench --test")
    for record in summary_json(summary)["results"]:  # summary.json's objects
        for field in SUMMARY_FIELDS:
            assert field in record, field
        if record["target"] != "c":
            assert record["completed"] == 6 and record["failed"] == 0
            assert record["total_output_tokens"] == 24 and record["peak_rss_bytes"] == 1.5e8
            assert record["kv_efficiency"] == 1.0 and record["cost_per_1k_output_tokens"] > 0
            assert (record["kv_block_size"], record["kv_num_blocks"]) == (16, 100)  # vLLM's cache_config_info
        else:
            assert record["completed"] == 0 and record["failures"] == {"HTTP 401": 6}
    assert {c["target"] for c in summary["comparisons"]} == {"b"}  # c has nothing to compare
    assert "Ratios to the first target" in terminal_report(summary)
    write_outputs(str(tmp_path), summary, results)
    report = (tmp_path / "report.md").read_text()
    assert "## Throughput (output tokens/s)" in report and "pagedserve bench --test" in report
    assert "## Memory" in report and "HTTP 401" in report
    pngs = sorted(os.listdir(tmp_path / "plots"))
    assert pngs == [
        "latency_cdf_mixed.png",
        "latency_cdf_short.png",
        "scaling_mixed.png",
        "scaling_short.png",
        "ttft_vs_input_len.png",
    ]
    assert all(f"plots/{name}" in report for name in pngs)
    assert len(os.listdir(tmp_path / "requests")) == len(results)
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["results"][0]["ttft_ms"].keys() >= {"mean", "p50", "p90", "p99"}
    keys = list(saved["results"][0])  # flat, in this order: identity, metrics, memory, cost, KV need
    assert keys[:11] == [
        "target",
        "url",
        "model",
        "workload",
        "point",
        "concurrency",
        "request_rate",
        "burstiness",
        "seed",
        "num_requests",
        "completed",
    ]
    assert keys[-19:-8] == [
        "peak_rss_bytes",
        "avg_rss_bytes",
        "memory_efficiency",
        "rss_source",
        "peak_kv_usage",
        "avg_kv_usage",
        "kv_efficiency",
        "num_memory_samples",
        "prefix_cache_hit_rate",
        "price_per_hour",
        "cost_per_1k_output_tokens",
    ]
    assert keys[-8] == "peak_kv_demand_tokens" and keys[-1] == "kv_allocated_per_needed"


def test_cli_parsing():
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(
        [
            "--target",
            "x=http://h:1",
            "--target",
            "http://h:2/v1,pid=12",
            "--concurrency",
            "1,4",
            "16",
            "--request-rate",
            "2,inf",
            "--burstiness",
            "0.5",
            "--workload",
            "short,mixed",
        ]
    )
    points = cli.build_points(args)
    assert [p.label for p in points] == ["c=1", "c=4", "c=16", "rate=2,b=0.5", "rate=inf,b=0.5"]
    targets = cli.build_targets(args.target)
    assert [(t.name, t.base_url, t.pid) for t in targets] == [("x", "http://h:1", None), ("h:2", "http://h:2", 12)]
    assert [t.name for t in cli.build_targets(["http://h:1", "http://h:1"])] == ["h:1", "h:1#2"]
    with pytest.raises(ValueError):
        Target.parse("http://h:1,colour=blue")
    bad = parser.parse_args(["--workload", "nope"])
    assert cli.main(bad) == 2
    assert cli.main(parser.parse_args(["--warmup-duration", "5"])) == 2  # a warm-up needs a --duration window
    assert cli.main(parser.parse_args(["--duration", "5", "--warmup-duration", "-1"])) == 2
    # clients must all be running before the window opens
    assert cli.main(parser.parse_args(["--duration", "5", "--warmup-duration", "2", "--ramp-up", "3"])) == 2
    assert cli.main(parser.parse_args(["--ramp-up", "-1"])) == 2


# ---- against a real pagedserve server ---------------------------------------------------------

API_KEY = "bench-secret"


@pytest.fixture(scope="module")
def bench_server():
    """A small server of this module's own (64 MiB KV cache, an API key of its own)."""
    with RemoteServer(
        ["--max-model-len", "512", "--kv-cache-memory", "64MiB", "--api-key", API_KEY], api_key=API_KEY
    ) as running:
        yield running


def _bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    # the command freezes its process's heap (gc_heap); not this test process's
    with mock.patch.object(cli, "freeze_heap", lambda owner: 0):
        return cli.main(parser.parse_args(argv + ["--no-progress"]))


def _requests(directory, target: str, workload: str, point: str) -> list[dict]:
    return json.loads((directory / "requests" / f"{target}__{workload}__{point}.json").read_text())["requests"]


@pytest.mark.slow
def test_bench_against_server_fields_tokens_failures_report(bench_server, tmp_path):
    code = _bench(
        [
            "--target",
            f"paged={bench_server.url},api_key={API_KEY},pid={bench_server.pid}",
            "--target",
            f"wrongkey={bench_server.url},api_key=not-the-key",
            "--workload",
            "short",
            "--output-len",
            "8",
            "--concurrency",
            "1,4",
            "--num-prompts",
            "6",
            "--ignore-eos",
            "--slo",
            "ttft:60s,tpot:10s",
            "--price-per-hour",
            "1.5",
            "--memory-interval",
            "0.2",
            "--output-dir",
            str(tmp_path),
        ]
    )
    assert code == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert "--workload short" in summary["command"] or "short" in summary["settings"]["workloads"]
    records = {(r["target"], r["point"]): r for r in summary["results"]}
    assert set(records) == {("paged", "c=1"), ("wrongkey", "c=1"), ("paged", "c=4"), ("wrongkey", "c=4")}
    for point in ("c=1", "c=4"):
        record = records[("paged", point)]
        for field in SUMMARY_FIELDS:
            assert field in record, field
        assert record["completed"] == 6 and record["failed"] == 0 and record["usage_reported"]
        assert record["total_output_tokens"] == 6 * 8 and record["total_input_tokens"] == 6 * 50
        for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            stats = record[name]
            assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"] <= stats["max"], (name, stats)
        assert record["ttft_ms"]["mean"] <= record["e2el_ms"]["mean"]
        assert record["output_throughput"] == pytest.approx(48 / record["duration_s"])
        assert record["peak_rss_bytes"] > 100 * 2**20 and record["rss_source"].startswith("psutil")
        assert 0 < record["memory_efficiency"] <= 1
        assert record["peak_kv_usage"] is not None and 0 <= record["avg_kv_usage"] <= record["peak_kv_usage"] <= 1
        assert 0 <= record["prefix_cache_hit_rate"] <= 1  # from the server's counters, not None
        assert record["goodput"] == pytest.approx(record["request_throughput"])
        assert record["cost_per_1k_output_tokens"] == pytest.approx(1.5 * record["duration_s"] / 3600 / 0.048)
        for request in _requests(tmp_path, "paged", "short", point):
            assert request["success"] and request["usage_reported"]
            assert request["prompt_len"] == request["expected_prompt_len"] == 50  # our count == server usage
            assert request["output_tokens"] == request["expected_output_len"] == 8
            assert 0 < request["num_chunks"] <= 8 and request["generated_text"]
            assert request["latency"] >= request["ttft"] > 0
            assert len(request["itl"]) == request["num_chunks"] - 1
        bad = records[("wrongkey", point)]
        assert bad["completed"] == 0 and bad["failed"] == 6 and bad["failures"] == {"HTTP 401": 6}
    assert [c["target"] for c in summary["comparisons"]] == []  # nothing to compare with a dead target
    shape = parse_cache_config(httpx.get(bench_server.url + "/metrics", timeout=30).text)
    assert shape is not None and shape["block_size"] > 0 and shape["num_gpu_blocks"] > 0
    for point in ("c=1", "c=4"):
        record = records[("paged", point)]
        assert (record["kv_block_size"], record["kv_num_blocks"]) == (shape["block_size"], shape["num_gpu_blocks"])
        assert record["peak_kv_demand_tokens"] is not None
    report = (tmp_path / "report.md").read_text()
    assert "## Throughput (output tokens/s)" in report and "HTTP 401" in report
    assert {"scaling_short.png", "latency_cdf_short.png", "ttft_vs_input_len.png"} <= set(
        os.listdir(tmp_path / "plots")
    )


@pytest.mark.slow
def test_bench_chat_endpoint_counts_the_template(bench_server, tmp_path):
    code = _bench(
        [
            "--target",
            f"{bench_server.url},api_key={API_KEY}",
            "--endpoint",
            "chat",
            "--workload",
            "random",
            "--input-len",
            "60",
            "--output-len",
            "4",
            "--num-prompts",
            "3",
            "--num-warmups",
            "0",
            "--ignore-eos",
            "--output-dir",
            str(tmp_path),
        ]
    )
    assert code == 0
    name = bench_server.url.split("://")[1].replace(":", "_")
    requests = _requests(tmp_path, name, "random", "c=1")
    assert all(r["success"] and r["prompt_len"] == r["expected_prompt_len"] == 60 for r in requests)


@pytest.mark.slow
def test_bench_counts_too_long_prompts_as_failures(bench_server, tmp_path):
    code = _bench(
        [
            "--target",
            f"paged={bench_server.url},api_key={API_KEY}",
            "--workload",
            "random",
            "--input-len",
            "600",
            "--output-len",
            "4",
            "--num-prompts",
            "4",
            "--num-warmups",
            "0",
            "--output-dir",
            str(tmp_path),
        ]
    )
    assert code == 1  # every request failed
    record = json.loads((tmp_path / "summary.json").read_text())["results"][0]
    assert record["completed"] == 0 and record["failed"] == 4 and record["failures"] == {"HTTP 400": 4}
    assert "maximum context length" in record["failure_examples"]["HTTP 400"]


@pytest.mark.slow
def test_open_loop_arrivals_follow_the_rate(bench_server, tmp_path):
    rate, num = 8.0, 32
    code = _bench(
        [
            "--target",
            f"paged={bench_server.url},api_key={API_KEY}",
            "--workload",
            "random",
            "--input-len",
            "16",
            "--output-len",
            "2",
            "--request-rate",
            str(rate),
            "--num-prompts",
            str(num),
            "--seed",
            "3",
            "--output-dir",
            str(tmp_path),
        ]
    )
    assert code == 0
    requests = sorted(_requests(tmp_path, "paged", "random", f"rate={rate:g}"), key=lambda r: r["scheduled_time"])
    assert len(requests) == num and all(r["success"] for r in requests)
    scheduled = np.array([r["scheduled_time"] for r in requests])
    gaps = np.diff(scheduled)
    # Poisson arrivals: gaps ~ Exp(rate); their mean is within 4 standard errors of 1/rate
    assert abs(gaps.mean() - 1 / rate) < 4 * (1 / rate) / math.sqrt(len(gaps))
    sent = np.array([r["start_time"] for r in requests])
    lag = sent - scheduled
    assert (lag >= -1e-3).all()  # no request leaves before the arrival process says
    assert abs(np.diff(sent).mean() - 1 / rate) < 4 * (1 / rate) / math.sqrt(len(gaps)) + 0.05


@pytest.mark.slow
def test_side_by_side_with_hf_engine(bench_server, tmp_path):
    with RemoteServer(["--engine", "hf", "--max-model-len", "512"]) as hf:
        code = _bench(
            [
                "--target",
                f"paged={bench_server.url},api_key={API_KEY}",
                "--target",
                f"hf={hf.url},pid={hf.pid}",
                "--workload",
                "short",
                "--output-len",
                "4",
                "--concurrency",
                "2",
                "--num-prompts",
                "2",
                "--ignore-eos",
                "--output-dir",
                str(tmp_path),
            ]
        )
    assert code == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [(r["target"], r["completed"]) for r in summary["results"]] == [("paged", 2), ("hf", 2)]
    assert summary["results"][1]["total_output_tokens"] == 8
    assert [c["target"] for c in summary["comparisons"]] == ["hf"]
    assert "(" in (tmp_path / "report.md").read_text().split("## Latency")[0]  # throughput ratio shown


def test_duration_window_cuts_off_running_requests(factory):
    """--duration with --drain-timeout 0: requests still streaming at the end are 'incomplete', not failures."""
    options = BenchOptions(
        num_prompts=None, duration=0.6, drain_timeout=0.0, num_warmups=1, progress=False, memory_interval=0.1
    )
    point = LoadPoint(concurrency=2)
    results, _ = asyncio.run(
        run_sweep(
            [Target.parse("http://fake")],
            ["short"],
            [point],
            options,
            factory,
            5,
            {"output_len_override": 40},
            transport=_fake_server(delay=0.02),
        )
    )
    metrics = results[0].record.metrics
    # each request takes ~0.8 s: nothing completes inside 0.6 s, both in-flight requests are cut off
    assert metrics.completed == 0 and metrics.failed == 0 and metrics.incomplete == 2
    assert 0.55 < metrics.duration_s < 5.0
    assert all(o.error_reason == "incomplete" for o in results[0].outputs)
    # the tokens streamed inside the window still count as delivered throughput
    assert metrics.incomplete_output_tokens > 0
    assert metrics.output_throughput == pytest.approx(metrics.incomplete_output_tokens / metrics.duration_s)
    # their first tokens arrived inside the window: in the started-requests TTFT, not the completed one
    assert metrics.started == 2 and metrics.ttft_started_ms["p50"] > 0 and metrics.ttft_ms["p50"] == 0
    assert len(results[0].warmup_outputs) == 1 and results[0].warmup_outputs[0].output_tokens == 16


def test_tokens_streamed_after_a_boundary():
    out = RequestFuncOutput(start_time=-1.0, ttft=0.5, itl=[0.2] * 5, output_tokens=6)  # chunks at -0.5 .. 0.5
    assert tokens_streamed_after(out, 0.0) == 3
    assert tokens_streamed_after(out, -10.0) == 6 and tokens_streamed_after(out, 10.0) == 0
    out.output_tokens = 12  # two tokens per chunk
    assert tokens_streamed_after(out, 0.0) == 6
    assert tokens_streamed_after(RequestFuncOutput(start_time=5.0, ttft=0.0, output_tokens=3), 0.0) == 0  # no token


def test_warmup_duration_measures_the_steady_state_only(factory):
    """--warmup-duration: the load runs first, only requests sent after it are measured, and the
    tokens that warm-up requests stream inside the window count in the throughput."""
    options = BenchOptions(
        num_prompts=None,
        duration=0.6,
        warmup_duration=0.5,
        drain_timeout=0.0,
        num_warmups=0,
        progress=False,
        memory_interval=0.1,
    )
    results, _ = asyncio.run(
        run_sweep(
            [Target.parse("http://fake")],
            ["short"],
            [LoadPoint(concurrency=2)],
            options,
            factory,
            7,
            {"output_len_override": 30},
            transport=_fake_server(delay=0.01),
        )
    )
    result = results[0]
    metrics = result.record.metrics
    assert 0.55 < metrics.duration_s < 5.0  # the window, not the warm-up before it
    assert result.outputs and all(o.start_time >= 0 for o in result.outputs)
    assert result.warmup_outputs and all(o.start_time < 0 for o in result.warmup_outputs)
    # warm-up requests are the real load: full length, not capped like --num-warmups requests
    assert any(o.output_tokens == 30 for o in result.warmup_outputs)
    carried = sum(tokens_streamed_after(o, 0.0) for o in result.warmup_outputs)
    assert metrics.warmup_carried_output_tokens == carried > 0
    delivered = metrics.total_output_tokens + metrics.incomplete_output_tokens + carried
    assert metrics.output_throughput == pytest.approx(delivered / metrics.duration_s)
    assert result.record.memory.num_memory_samples >= 1 and result.record.memory.kv_efficiency == pytest.approx(1.0)


def test_ramp_up_starts_closed_loop_clients_one_by_one(factory):
    """--ramp-up: client i sends its first request i * ramp / concurrency after the first client."""
    options = BenchOptions(
        num_prompts=None,
        duration=0.3,
        warmup_duration=0.6,
        ramp_up=0.6,
        drain_timeout=0.0,
        num_warmups=0,
        progress=False,
        memory_interval=0.1,
    )
    results, _ = asyncio.run(
        run_sweep(
            [Target.parse("http://fake")],
            ["short"],
            [LoadPoint(concurrency=4)],
            options,
            factory,
            9,
            {"output_len_override": 200},
            transport=_fake_server(delay=0.01),
        )
    )
    result = results[0]
    # each request streams for >= 2 s, so the four requests sent are each client's first one
    assert len(result.warmup_outputs) == 4 and not result.outputs
    starts = sorted(o.start_time for o in result.warmup_outputs)
    gaps = [later - earlier for earlier, later in zip(starts, starts[1:])]
    # 0.15 s apart nominally; each start is stamped inside the request function, after a scheduling
    # delay of its own, so a gap can come out a little short of 0.15, never near 0 (all at once)
    assert all(gap >= 0.1 for gap in gaps), gaps
    assert starts[-1] - starts[0] >= 0.3, starts  # 0.45 nominally
    assert result.record.metrics.incomplete == 0 and result.record.metrics.warmup_carried_output_tokens > 0


def test_num_prompts_counts_only_measured_requests_after_a_warmup(factory):
    options = BenchOptions(
        num_prompts=3, duration=30.0, warmup_duration=0.3, num_warmups=0, progress=False, memory_interval=0.1
    )
    results, _ = asyncio.run(
        run_sweep(
            [Target.parse("http://fake")],
            ["short"],
            [LoadPoint(concurrency=2)],
            options,
            factory,
            8,
            {"output_len_override": 5},
            transport=_fake_server(delay=0.01),
        )
    )
    result = results[0]
    assert len(result.outputs) == 3 and result.record.metrics.completed == 3
    assert len(result.warmup_outputs) >= 2  # two clients kept the load up through the warm-up


def test_duration_window_counts_what_finished(factory):
    options = BenchOptions(num_prompts=None, duration=0.5, num_warmups=0, progress=False, memory_interval=0.1)
    results, _ = asyncio.run(
        run_sweep(
            [Target.parse("http://fake")],
            ["short"],
            [LoadPoint(concurrency=3)],
            options,
            factory,
            6,
            {"output_len_override": 3},
            transport=_fake_server(delay=0.01),
        )
    )
    metrics = results[0].record.metrics
    assert metrics.completed >= 6 and metrics.failed == 0 and metrics.incomplete == 0
    assert metrics.total_output_tokens == 3 * metrics.completed
