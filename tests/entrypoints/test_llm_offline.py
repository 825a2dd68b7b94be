"""The offline API on the real default model: sampling options, n > 1, stop strings, logprobs, chat, bad input."""

from __future__ import annotations

import math

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.outputs import FinishReason
from tests.utils import assert_no_leak

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", kv_cache_memory="256MiB", device="cpu")


def test_generate_returns_text_tokens_and_timing(llm):
    (out,) = llm.generate("The capital of France is", SamplingParams(temperature=0.0, max_tokens=8))
    sample = out.outputs[0]
    assert out.finished and sample.finish_reason == FinishReason.LENGTH
    assert len(sample.token_ids) == 8
    assert sample.text == llm.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
    assert "Paris" in sample.text
    assert out.metrics is not None and out.metrics.e2e_latency >= out.metrics.ttft > 0
    assert_no_leak(llm)


def test_seed_makes_sampling_reproducible_and_n_gives_distinct_samples(llm):
    params = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, max_tokens=16, seed=1234, n=3)
    prompt = "Once upon a time, in a land far away,"  # an open continuation: EOS is unlikely first
    first = llm.generate(prompt, params)[0]
    second = llm.generate(prompt, params)[0]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in second.outputs]
    assert [o.index for o in first.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1
    assert_no_leak(llm)


def test_stop_string_is_honoured_and_not_included(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=40)
    full = llm.generate("Count from one to ten: one, two,", greedy)[0].outputs[0].text
    assert "five" in full
    stopped = llm.generate("Count from one to ten: one, two,", greedy.clone(stop=["five"]))[0].outputs[0]
    assert stopped.finish_reason == FinishReason.STOP and stopped.stop_reason == "five"
    assert "five" not in stopped.text and full.startswith(stopped.text)
    kept = llm.generate(
        "Count from one to ten: one, two,", greedy.clone(stop=["five"], include_stop_str_in_output=True)
    )[0]
    assert kept.outputs[0].text.endswith("five")
    assert_no_leak(llm)


def test_logprobs_top_n_and_min_tokens_ignore_eos(llm):
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, min_tokens=6, ignore_eos=True)
    sample = llm.generate("Hello", params)[0].outputs[0]
    assert len(sample.logprobs) == 6
    for entry, token in zip(sample.logprobs, sample.token_ids):
        assert entry.token_id == token and entry.rank == 1  # greedy picks the top token
        assert len(entry.top) == 3 and entry.top[0][0] == token
        assert entry.logprob <= 0 and math.isclose(entry.top[0][1], entry.logprob, abs_tol=1e-6)


def test_prompt_logprobs(llm):
    out = llm.generate("The sky is blue", SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2))[0]
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert [e.token_id for e in out.prompt_logprobs[1:]] == out.prompt_token_ids[1:]


def test_penalties_and_logit_bias_change_the_output(llm):
    base = SamplingParams(temperature=0.0, max_tokens=12)
    prompt = "Repeat after me: banana banana banana banana"
    plain = llm.generate(prompt, base)[0].outputs[0].token_ids
    penalised = llm.generate(prompt, base.clone(repetition_penalty=2.0, frequency_penalty=1.5))[0].outputs[0].token_ids
    assert plain != penalised
    forced_token = llm.tokenizer.encode(" zebra", add_special_tokens=False)[0]
    biased = llm.generate(prompt, base.clone(logit_bias={forced_token: 100.0}, max_tokens=3))[0].outputs[0].token_ids
    assert biased == [forced_token] * 3


def test_chat_uses_the_chat_template(llm):
    out = llm.chat([{"role": "user", "content": "What is 2 + 2?"}], SamplingParams(temperature=0.0, max_tokens=20))[0]
    assert "<|im_start|>assistant" in out.prompt
    assert out.outputs[0].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    assert "4" in out.outputs[0].text


def test_priority_scheduling_runs(llm):
    outs = llm.generate(["a b c", "d e f"], SamplingParams(temperature=0.0, max_tokens=3), priority=[1, 0])
    assert all(o.finished for o in outs)


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ("", SamplingParams(), "empty"),
        ({"prompt_token_ids": []}, SamplingParams(), "empty"),
        ("word " * 9000, SamplingParams(max_tokens=1), "maximum context length"),
        ({"prompt_token_ids": [1, 2, 10**7]}, SamplingParams(), "out of vocabulary"),
        ({"prompt_token_ids": [1, -5]}, SamplingParams(), "out of vocabulary"),
        ("hi", SamplingParams(logprobs=1000), "max allowed"),
    ],
)
def test_bad_input_raises_value_error_and_engine_stays_usable(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(["fine prompt", prompt], params)
    assert_no_leak(llm)
    assert llm.generate("ok", SamplingParams(temperature=0.0, max_tokens=2))[0].finished


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"temperature": -0.5}, "temperature"),
        ({"n": 0}, "n must"),
        ({"top_k": -2}, "top_k"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
    ],
)
def test_bad_sampling_params_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_seeded_generators_do_not_depend_on_batch(llm):
    params = SamplingParams(temperature=0.8, max_tokens=10, seed=7)
    alone = llm.generate("Write a poem about rain.", params)[0].outputs[0].token_ids
    batched = llm.generate(["Write a poem about rain.", "Another prompt here", "And a third one"], params)[0]
    assert batched.outputs[0].token_ids == alone
    torch.manual_seed(0)


def test_block_size_defaults_per_device(llm):
    from pagedserve.config import CacheConfig

    assert llm.engine.block_size == 128  # a CPU engine, block size left to the default
    assert CacheConfig().resolved_block_size("cuda") == 16
    assert CacheConfig(block_size=32).resolved_block_size("cpu") == 32
    with pytest.raises(ValueError, match="power of two"):
        CacheConfig(block_size=48)
    # a prompt that fills one 128-token block is served from the prefix cache the second time
    prompt = {"prompt_token_ids": [(7 * i) % 1000 + 10 for i in range(200)]}
    params = SamplingParams(temperature=0.0, max_tokens=2)
    first, again = llm.generate(prompt, params), llm.generate(prompt, params)
    assert first[0].num_cached_tokens == 0 and again[0].num_cached_tokens == 128
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    assert_no_leak(llm)


def test_busy_and_forward_seconds_count_steps_not_idle_waits(llm):
    """engine_busy_seconds / model_forward_seconds: the forward is part of the busy time, and a wait
    with nothing in flight (here after an abort) is not busy time."""
    import time

    from pagedserve.messages import EngineCoreRequest

    engine = llm.engine
    before = engine.get_stats()
    stepped = 0.0

    def step() -> None:
        nonlocal stepped
        start = time.perf_counter()
        engine.step()
        stepped += time.perf_counter() - start

    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    engine.add_request(EngineCoreRequest("busy-1", list(range(5, 21)), params, time.monotonic()))
    for _ in range(3):
        step()
    engine.abort_requests(["busy-1"])
    time.sleep(1.0)
    engine.add_request(EngineCoreRequest("busy-2", list(range(5, 21)), SamplingParams(max_tokens=3), time.monotonic()))
    while engine.has_unfinished_requests():
        step()
    after = engine.get_stats()
    busy = after.busy_seconds - before.busy_seconds
    forward = after.model_forward_seconds - before.model_forward_seconds
    assert 0 < forward <= busy
    assert busy < stepped + 0.5  # the steps (back to back) and not the one-second wait
    # the process's CPU time during the forwards is part of all the CPU time it used meanwhile
    forward_cpu = after.model_forward_cpu_seconds - before.model_forward_cpu_seconds
    assert 0 < forward_cpu <= after.engine_cpu_seconds - before.engine_cpu_seconds
    assert_no_leak(llm)
