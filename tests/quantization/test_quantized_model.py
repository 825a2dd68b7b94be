"""Each weight-storage scheme on the real default model: it loads, holds quantized weights in
the expected formats, answers greedy prompts with sensible text that mostly agrees with the
unquantized model, keeps perplexity on a fixed English passage close to it, and is smaller in memory;
a server started with --quantization answers the openai client."""

from __future__ import annotations

import math
import os

import openai
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.models.layers import Embedding, Linear
from pagedserve.models.quantization import GroupQuantized, PackedQuantWeight
from pagedserve.models.registry import ModelLoadError
from tests.utils import RemoteServer, assert_no_leak

pytestmark = pytest.mark.slow

TEXT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "data", "perplexity_text.txt")
PROMPTS = [
    "What is the capital of Australia?",
    "Name three primary colours.",
    "Write a Python function that adds two numbers.",
    "What is the boiling point of water in Celsius?",
    "Give one tip for learning a new language.",
    "What do bees make?",
]
# perplexity over the first 600 tokens of the passage, relative to `none`: the full-text bounds
# (scripts/quant_quality.py, 0.5 / 1 / 5 %) with room for the shorter text
MAX_PERPLEXITY_RISE = {"gguf": 0.01, "int8": 0.02, "int4": 0.08}


def perplexity(llm: LLM, text: str, num_tokens: int) -> float:
    ids = llm.tokenizer.encode(text, add_special_tokens=False)[:num_tokens]
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    logprobs = [entry.logprob for entry in out.prompt_logprobs if entry is not None]
    assert len(logprobs) == len(ids) - 1
    return math.exp(-sum(logprobs) / len(logprobs))


@pytest.fixture(scope="module")
def passage() -> str:
    with open(TEXT, encoding="utf-8") as f:
        return f.read()


@pytest.fixture(scope="module")
def reference(passage):
    llm = LLM(quantization="none", kv_cache_memory="256MiB")
    greedy = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], SamplingParams(max_tokens=24, temperature=0))
    result = {
        "perplexity": perplexity(llm, passage, 600),
        "tokens": [list(o.outputs[0].token_ids) for o in greedy],
        "weight_bytes": llm.engine.runner.weight_bytes,
    }
    del llm
    return result


@pytest.mark.parametrize("scheme", ["gguf", "int8", "int4"])
def test_scheme_quality_memory_and_formats(scheme, reference, passage):
    llm = LLM(quantization=scheme, kv_cache_memory="256MiB")
    model = llm.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(m.quant is not None and m.weight.numel() == 0 for m in linears)  # no plain copy kept
    packed = [m.quant for m in linears if isinstance(m.quant, PackedQuantWeight)]
    if llm.engine.runner.kernels is not None and llm.engine.runner.kernels.has_quant_linear():
        assert len(packed) == len(linears)
        body = [q for m, q in zip(linears, packed) if m is not model.lm_head]
        assert {q.bits for q in body} == ({8} if scheme == "int8" else {4})
        assert model.lm_head.quant.bits == 8  # the file's Q8_0, or int8 per row
    else:
        assert all(isinstance(m.quant, GroupQuantized) for m in linears)
    embedding = next(m for m in model.modules() if isinstance(m, Embedding))
    assert embedding.quant is model.lm_head.quant  # tied: one quantized table for lookup and logits

    greedy = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], SamplingParams(max_tokens=24, temperature=0))
    texts = [o.outputs[0].text for o in greedy]
    assert "Canberra" in texts[0]
    assert all(len(t.split()) >= 3 and t.isascii() for t in texts), texts
    agree = sum(list(o.outputs[0].token_ids[:8]) == ref[:8] for o, ref in zip(greedy, reference["tokens"]))
    assert agree >= len(PROMPTS) // 2, f"{scheme}: {agree}/{len(PROMPTS)} prompts start like `none`: {texts}"

    rise = perplexity(llm, passage, 600) / reference["perplexity"] - 1
    assert rise < MAX_PERPLEXITY_RISE[scheme], f"{scheme}: perplexity {rise:+.2%} vs none"
    ratio = llm.engine.runner.weight_bytes / reference["weight_bytes"]
    assert ratio < (0.45 if scheme == "int8" else 0.33), f"{scheme}: weights {ratio:.2f}x of none"
    assert_no_leak(llm)


def test_gguf_scheme_needs_a_gguf_file(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "model_type": "llama"}')
    with pytest.raises(ModelLoadError, match="needs a .gguf model file"):
        LLM(str(tmp_path), quantization="gguf")
    with pytest.raises(ValueError, match="quantization must be"):
        LLM(quantization="fp4")


def test_server_with_quantization_answers_the_openai_client():
    with RemoteServer(["--quantization", "gguf", "--kv-cache-memory", "256MiB"]) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="none")
        model = client.models.list().data[0].id
        chat = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "What is the capital of Australia?"}],
            max_tokens=16,
            temperature=0,
        )
        assert "Canberra" in chat.choices[0].message.content
        completion = client.completions.create(
            model=model, prompt="The capital of France is", max_tokens=8, temperature=0
        )
        assert "Paris" in completion.choices[0].text
        assert completion.usage.completion_tokens == 8
        assert "model weights:" in server.log_text()
