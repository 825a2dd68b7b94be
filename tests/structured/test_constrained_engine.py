"""Constrained decoding in the engine with the real default model (float32, offline LLM): every
output matches its spec, also under preemption by recompute, n > 1 forks and chunked prefill; the
unconstrained rows of a mixed batch stay token-identical; a spec that does not compile ends only its
own request."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from pagedserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.entrypoints.llm import LLM
from pagedserve.models.loader import load_model
from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams
from tests.utils import assert_no_leak

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 110},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "role", "tags"],
}
PERSON_SPEC = StructuredOutputsParams(json=json.dumps(PERSON))
QUESTIONS = [
    "Describe a user of a web shop as JSON.",
    "Write a JSON record for an administrator named Ada.",
    "Give me a guest account as a JSON object.",
    "Create a JSON profile of a 30 year old user.",
]


@pytest.fixture(scope="module")
def loaded():
    return load_model(ModelConfig(dtype="float32"), torch.device("cpu"))


def make_llm(loaded, num_blocks=None, budget=2048, speculative=None) -> LLM:
    cache = CacheConfig(block_size=16, kv_cache_memory=128 << 20, num_blocks_override=num_blocks)
    scheduler = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=64)
    config = EngineConfig(
        model=ModelConfig(dtype="float32"), cache=cache, scheduler=scheduler, device="cpu", speculative=speculative
    )
    return LLM.from_engine(LLMEngine(config, loaded=loaded))


@pytest.fixture(scope="module")
def llm(loaded):
    return make_llm(loaded)


def chats(questions):
    return [[{"role": "user", "content": q}] for q in questions]


def check_person(text: str) -> None:
    jsonschema.validate(json.loads(text), PERSON)


def test_json_schema_sampled_n3_every_sample_valid(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=160, structured_outputs=PERSON_SPEC)
    outputs = llm.chat(chats(QUESTIONS), params)
    for output in outputs:
        assert len(output.outputs) == 3
        for sample in output.outputs:
            assert sample.finish_reason == "stop", sample.text
            check_person(sample.text)
    assert_no_leak(llm)


def test_regex_choice_grammar_and_json_object(llm):
    specs = [
        StructuredOutputsParams(regex=r"[A-Z][a-z]{2,8} \d{2}"),
        StructuredOutputsParams(choice=("positive", "negative", "neutral")),
        StructuredOutputsParams(grammar='root ::= "yes" | "no" | "maybe " [0-9]'),
        StructuredOutputsParams(json_object=True),
    ]
    prompts = ["A name and an age:", "The sentiment of 'I love it' is", "Is the sky blue?", "A JSON object:"]
    params = [SamplingParams(temperature=0.8, seed=3, max_tokens=300, structured_outputs=s) for s in specs]
    outputs = llm.generate(prompts, params)
    texts = [o.outputs[0].text for o in outputs]
    assert re.fullmatch(r"[A-Z][a-z]{2,8} \d{2}", texts[0]), texts[0]
    assert texts[1] in ("positive", "negative", "neutral")
    assert re.fullmatch(r"yes|no|maybe [0-9]", texts[2]), texts[2]
    assert isinstance(json.loads(texts[3]), dict)
    assert all(o.outputs[0].finish_reason == "stop" for o in outputs)


def test_max_tokens_cut_ends_with_length(llm):
    params = SamplingParams(temperature=0.0, max_tokens=5, structured_outputs=PERSON_SPEC)
    (output,) = llm.chat(chats(QUESTIONS[:1]), params)
    assert output.outputs[0].finish_reason == "length" and len(output.outputs[0].token_ids) == 5


def test_ignore_eos_adds_nothing_after_the_complete_output(llm):
    params = SamplingParams(
        temperature=0.0,
        max_tokens=40,
        ignore_eos=True,
        structured_outputs=StructuredOutputsParams(choice=("yes", "no")),
    )
    (output,) = llm.chat(chats(["Is the sky blue? Answer yes or no."]), params)
    sample = output.outputs[0]
    assert sample.text in ("yes", "no") and len(sample.token_ids) == 40
    assert set(sample.token_ids[-30:]) <= set(llm.engine.eos_token_ids)


def test_unconstrained_row_identical_next_to_constrained_ones(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=48)
    alone = llm.generate(["The history of the printing press begins"], plain)[0].outputs[0].token_ids
    constrained = SamplingParams(temperature=1.0, seed=11, max_tokens=48, structured_outputs=PERSON_SPEC)
    prompts = ["The history of the printing press begins"] + [f"Person {i} as JSON:" for i in range(15)]
    outputs = llm.generate(prompts, [plain] + [constrained] * 15)
    assert outputs[0].outputs[0].token_ids == alone
    assert all(o.outputs[0].text.startswith("{") for o in outputs[1:])


def test_preemption_and_chunked_prefill_keep_the_matcher(loaded, llm):
    params = SamplingParams(n=2, temperature=0.0, max_tokens=120, structured_outputs=PERSON_SPEC)
    questions = [q + " " + "Use realistic values. " * 30 for q in QUESTIONS] * 2  # ~190-token prompts
    roomy = llm.chat(chats(questions), params)
    # 40 blocks of 16 tokens for 16 samples of ~250 tokens: decodes run out of blocks and are preempted;
    # a 64-token budget splits every prompt into chunks
    tight = make_llm(loaded, num_blocks=41, budget=64)
    squeezed = tight.chat(chats(questions), params)
    assert tight.engine.scheduler.num_preemptions > 0
    for a, b in zip(roomy, squeezed):
        for x, y in zip(a.outputs, b.outputs):
            check_person(y.text)
            assert x.token_ids == y.token_ids  # greedy: the same constrained path with or without preemption
    assert_no_leak(tight)


def test_speculative_drafts_under_a_grammar_change_nothing(loaded, llm):
    # prompts that hold a record to copy: prompt-lookup drafts are often inside the grammar, and
    # sometimes outside it (masked at their row, so never accepted)
    record = '{"name": "Ada Lovelace", "age": 36, "role": "admin", "tags": ["math", "code"]}'
    questions = [f"Copy this record exactly: {record}", *QUESTIONS[:3]]
    greedy = SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=PERSON_SPEC)
    stop_only = SamplingParams(
        temperature=0.0,
        max_tokens=30,
        ignore_eos=True,
        structured_outputs=StructuredOutputsParams(choice=("yes", "no")),
    )
    plain = llm.chat(chats(questions + ["Is the sky blue? Answer yes or no."]), [greedy] * 4 + [stop_only])
    drafting = make_llm(loaded, speculative=SpeculativeConfig(num_speculative_tokens=4))
    drafted = drafting.chat(chats(questions + ["Is the sky blue? Answer yes or no."]), [greedy] * 4 + [stop_only])
    assert drafting.engine.scheduler.spec_num_accepted_tokens > 0
    for a, b in zip(plain, drafted):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids  # greedy: token-identical
    for output in drafted[:4]:
        check_person(output.outputs[0].text)
    assert drafted[4].outputs[0].text in ("yes", "no")
    sampled = SamplingParams(n=1, temperature=1.0, seed=5, max_tokens=160, structured_outputs=PERSON_SPEC)
    for output in drafting.chat(chats(questions), sampled):
        assert output.outputs[0].finish_reason == "stop", output.outputs[0].text
        check_person(output.outputs[0].text)
    assert_no_leak(drafting)


def test_a_spec_that_does_not_compile_fails_alone(llm):
    bad = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="a(b"))
    good = SamplingParams(temperature=0.0, max_tokens=8)
    outputs = llm.generate(["Hello", "The sky is"], [bad, good])
    assert outputs[0].outputs[0].finish_reason == "abort" and outputs[0].outputs[0].token_ids == []
    assert outputs[1].outputs[0].finish_reason == "length"
    assert llm.engine.structured.num_failed >= 1
    assert_no_leak(llm)
