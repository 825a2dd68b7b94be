"""HFEngine (``--engine hf``) through the thread client: one request at a time, token by token; matches
transformers' generate."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pagedserve.config import EngineConfig, ModelConfig
from pagedserve.engine.core_client import EngineCoreClient
from pagedserve.engine.hf_core import HFEngine
from pagedserve.engine.threaded_client import ThreadedEngineCoreClient
from pagedserve.entrypoints.input_checks import ModelLimits
from pagedserve.messages import EngineCoreOutput, EngineCoreRequest
from pagedserve.outputs import FinishReason
from pagedserve.sampling_params import SamplingParams
from pagedserve.tokenizer import load_tokenizer, tokenizer_path
from tests.utils import TINY_CONFIG

EOS = 3


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    config = LlamaConfig(
        **dict(TINY_CONFIG, max_position_embeddings=64, rms_norm_eps=1e-6),
        bos_token_id=None,
        eos_token_id=EOS,
        pad_token_id=None,
    )
    return LlamaForCausalLM(config).eval()


def _request(request_id: str, prompt: list[int], **params) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, prompt, SamplingParams(**params), time.monotonic())


def _client(config: EngineConfig, model=None, eos_token_ids=None) -> ThreadedEngineCoreClient:
    return ThreadedEngineCoreClient(HFEngine(config, model=model, eos_token_ids=eos_token_ids))


async def _collect(
    client: EngineCoreClient, requests: list[EngineCoreRequest], on_output=None
) -> list[EngineCoreOutput]:
    """Submit all requests, gather outputs until every sample finished (or on_output says stop)."""
    for request in requests:
        await client.add_request(request)
    pending = {(r.request_id, i) for r in requests for i in range(r.sampling_params.n)}
    outputs: list[EngineCoreOutput] = []
    while pending:
        for output in await asyncio.wait_for(client.get_outputs(), timeout=120):
            outputs.append(output)
            if output.finish_reason is not None:
                pending.discard((output.request_id, output.index))
            if on_output is not None:
                pending -= await on_output(output)
    return outputs


def _run(model, coro_fn, **config):
    async def main():
        client = _client(EngineConfig(model=ModelConfig(**config)), model=model, eos_token_ids=(EOS,))
        await client.start()
        try:
            return client, await coro_fn(client)
        finally:
            await client.shutdown()

    return asyncio.run(main())


def _tokens(outputs: list[EngineCoreOutput], request_id: str, index: int = 0) -> list[int]:
    return [t for o in outputs if o.request_id == request_id and o.index == index for t in o.new_token_ids]


def _greedy_reference(model, prompt: list[int], num_tokens: int) -> list[int]:
    with torch.inference_mode():
        generated = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=num_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            min_new_tokens=num_tokens,
        )
    return generated[0, len(prompt) :].tolist()


def test_greedy_matches_transformers_generate_and_runs_one_at_a_time(tiny_model):
    prompts = {"a": [5, 9, 17, 33, 2, 8], "b": [40, 41, 42]}
    _, outputs = _run(
        tiny_model,
        lambda c: _collect(
            c,
            [_request(rid, prompt, temperature=0.0, max_tokens=12, ignore_eos=True) for rid, prompt in prompts.items()],
        ),
    )
    for rid, prompt in prompts.items():
        assert _tokens(outputs, rid) == _greedy_reference(tiny_model, prompt, 12)
    order = [o.request_id for o in outputs]
    assert order == ["a"] * 12 + ["b"] * 12  # strictly one request at a time, FIFO
    finals = [o for o in outputs if o.finish_reason is not None]
    assert [(o.request_id, o.finish_reason) for o in finals] == [("a", FinishReason.LENGTH), ("b", FinishReason.LENGTH)]
    firsts = [o for o in outputs if o.first_scheduled_time is not None]
    assert [o.request_id for o in firsts] == ["a", "b"]


def test_stop_token_ids_eos_and_max_model_len(tiny_model):
    prompt = [5, 9, 17, 33, 2, 8]
    reference = _greedy_reference(tiny_model, prompt, 10)
    stop_id = reference[3]
    first_stop = reference.index(stop_id)

    async def scenario(client):
        outputs = await _collect(
            client,
            [
                _request("stop", prompt, temperature=0.0, max_tokens=10, stop_token_ids=[stop_id]),
                _request("eos", prompt, temperature=0.0, max_tokens=10, ignore_eos=True, min_tokens=2),
                _request("long", prompt, temperature=0.0, max_tokens=100, ignore_eos=True),
            ],
        )
        return outputs

    _, outputs = _run(tiny_model, scenario)
    assert _tokens(outputs, "stop") == reference[: first_stop + 1]
    last = [o for o in outputs if o.request_id == "stop"][-1]
    assert last.finish_reason == FinishReason.STOP and last.stop_reason == stop_id
    assert len(_tokens(outputs, "long")) == 64 - len(prompt)  # capped by max_position_embeddings


def test_eos_stops_unless_ignored(tiny_model):
    prompt = [5, 9, 17]
    reference = _greedy_reference(tiny_model, prompt, 6)
    # make the third greedy token the model's EOS for this client
    eos = reference[2]

    async def main():
        client = _client(EngineConfig(), model=tiny_model, eos_token_ids=(eos,))
        await client.start()
        try:
            return await _collect(
                client,
                [
                    _request("x", prompt, temperature=0.0, max_tokens=6),
                    _request("y", prompt, temperature=0.0, max_tokens=6, ignore_eos=True),
                ],
            )
        finally:
            await client.shutdown()

    outputs = asyncio.run(main())
    assert _tokens(outputs, "x") == reference[: reference.index(eos) + 1]
    assert [o.finish_reason for o in outputs if o.request_id == "x"][-1] == FinishReason.STOP
    assert _tokens(outputs, "y") == reference


def test_abort_and_stop_samples(tiny_model):
    async def scenario(client):
        async def on_output(output):
            if output.request_id == "victim" and len(output.new_token_ids) and output.first_scheduled_time:
                await client.abort_requests(["victim", "queued"])
                return {("victim", 0), ("queued", 0)}
            if output.request_id == "sampled" and output.index == 0:
                await client.stop_samples([("sampled", 0)])
                return {("sampled", 0)}
            return set()

        outputs = await _collect(
            client,
            [
                _request("victim", [1, 2, 3], temperature=0.0, max_tokens=40, ignore_eos=True),
                _request("queued", [4, 5, 6], temperature=0.0, max_tokens=5, ignore_eos=True),
                _request("sampled", [7, 8], temperature=1.0, seed=5, n=2, max_tokens=6, ignore_eos=True),
                _request("after", [9, 10], temperature=0.0, max_tokens=4, ignore_eos=True),
            ],
            on_output,
        )
        await asyncio.sleep(0.2)
        try:  # whatever the core produced after the last awaited output
            outputs += await asyncio.wait_for(client.get_outputs(), timeout=0.5)
        except TimeoutError:
            pass
        return outputs, client.get_stats()

    _, (outputs, stats) = _run(tiny_model, scenario)
    assert len(_tokens(outputs, "victim")) < 40 and not _tokens(outputs, "queued")
    assert len(_tokens(outputs, "sampled", 0)) < 6 and len(_tokens(outputs, "sampled", 1)) == 6
    assert len(_tokens(outputs, "after")) == 4
    assert stats.num_running == 0 and stats.num_waiting == 0


def test_sampling_is_seeded_and_logprobs(tiny_model):
    prompt = [11, 12, 13, 14]

    async def scenario(client):
        return await _collect(
            client,
            [
                _request(
                    "s1", prompt, temperature=0.8, top_p=0.9, top_k=20, seed=7, n=2, max_tokens=8, ignore_eos=True
                ),
                _request(
                    "s2", prompt, temperature=0.8, top_p=0.9, top_k=20, seed=7, n=2, max_tokens=8, ignore_eos=True
                ),
                _request("lp", prompt, temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2, prompt_logprobs=1),
            ],
        )

    _, outputs = _run(tiny_model, scenario)
    assert _tokens(outputs, "s1", 0) == _tokens(outputs, "s2", 0)
    assert _tokens(outputs, "s1", 1) == _tokens(outputs, "s2", 1)
    lp = [o for o in outputs if o.request_id == "lp"]
    assert all(o.new_logprobs and o.new_logprobs[0].rank == 1 and len(o.new_logprobs[0].top) == 2 for o in lp)
    assert lp[0].prompt_logprobs is not None and lp[0].prompt_logprobs[0] is None and len(lp[0].prompt_logprobs) == 4
    assert all(o.prompt_logprobs is None for o in lp[1:])


def test_validation(tiny_model):
    async def scenario(client):
        # bad input is refused before the engine: by the front end's checks against the model's limits
        info = client.model_info
        limits = ModelLimits(info.max_model_len, info.vocab_size, client.engine.config.max_logprobs)
        errors = []
        for request in (
            _request("e", []),
            _request("l", list(range(1, 65))),
            _request("v", [500]),
            _request("p", [1], logprobs=50),
        ):
            with pytest.raises(ValueError) as info:
                limits.check_request(request.prompt_token_ids, request.sampling_params)
            errors.append(str(info.value))
        return errors

    client, errors = _run(tiny_model, scenario)
    assert "empty" in errors[0] and "maximum context length" in errors[1] and "vocabulary" in errors[2]
    assert client.model_info.engine_name == "hf" and client.model_info.max_model_len == 64


@pytest.mark.slow
def test_default_model_matches_transformers_generate():
    """The default GGUF model, float32: greedy tokens equal transformers' generate on the same weights."""

    async def main():
        config = EngineConfig()
        client = _client(config)
        tokenizer = load_tokenizer(tokenizer_path(config.model))
        prompt = tokenizer.encode("The capital of France is Paris. The capital of Italy is", add_special_tokens=False)
        await client.start()
        try:
            outputs = await _collect(client, [_request("r", prompt, temperature=0.0, max_tokens=16)])
        finally:
            await client.shutdown()
        return client, tokenizer, prompt, outputs

    client, tokenizer, prompt, outputs = asyncio.run(main())
    assert client.model_info.engine_name == "hf" and client.model_info.model_name == "SmolLM2-135M-Instruct"
    engine = client.engine
    assert engine.model.dtype == torch.float32 and engine.eos_token_ids == (tokenizer.eos_token_id,)
    with torch.inference_mode():
        generated = engine.model.generate(
            torch.tensor([prompt]),
            max_new_tokens=16,
            do_sample=False,
            eos_token_id=list(engine.eos_token_ids),
            pad_token_id=0,
        )
    expected = generated[0, len(prompt) :].tolist()
    tokens = _tokens(outputs, "r")
    assert tokens == expected
    assert "Rome" in tokenizer.decode(tokens)
