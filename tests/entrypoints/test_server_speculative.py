"""A real `pagedserve serve --speculative-config` through the OpenAI client: greedy answers (plain,
streamed with logprobs, JSON-schema constrained) token-identical to the shared server without
speculation, `max_tokens` and stop strings honoured, and the spec_decode_* counters on /metrics."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.utils import RemoteServer, parse_metrics

pytestmark = pytest.mark.slow

PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, trimmed the wick, polished "
    "the great lens and wrote the state of the sea in a leather logbook that had belonged to his father."
)
COPY = [{"role": "user", "content": f"Copy this passage exactly, word for word:\n\n{PASSAGE}"}]
RECORD = {
    "type": "object",
    "properties": {
        "keeper": {"type": "string", "maxLength": 40},
        "duties": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["keeper", "duties"],
}


@pytest.fixture(scope="module")
def spec_server():
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    with RemoteServer(["--dtype", "float32", "--speculative-config", spec]) as remote:
        yield remote


def ask(client, **kwargs):
    model = client.models.list().data[0].id
    return client.chat.completions.create(model=model, temperature=0.0, **kwargs)


def test_greedy_answers_match_the_server_without_speculation(spec_server, client):
    drafting = spec_server.openai_client()
    before = parse_metrics(spec_server.get("/metrics").text)
    for messages, max_tokens in ((COPY, 80), ([{"role": "user", "content": "List four planets."}], 40)):
        plain = ask(client, messages=messages, max_tokens=max_tokens)
        fast = ask(drafting, messages=messages, max_tokens=max_tokens)
        assert fast.choices[0].message.content == plain.choices[0].message.content
        assert fast.usage.completion_tokens == plain.usage.completion_tokens <= max_tokens
    after = parse_metrics(spec_server.get("/metrics").text)
    drafts = "pagedserve:spec_decode_num_draft_tokens_total"
    accepted = "pagedserve:spec_decode_num_accepted_tokens_total"
    assert after[drafts] > before.get(drafts, 0) and after[accepted] > before.get(accepted, 0)
    assert after[accepted] <= after[drafts]
    assert any(key.startswith("pagedserve:spec_decode_num_accepted_tokens_per_pos_total{") for key in after)


def test_streamed_logprobs_max_tokens_and_stop_match(spec_server, client):
    drafting = spec_server.openai_client()
    common = {"messages": COPY, "max_tokens": 37, "logprobs": True, "top_logprobs": 2}
    plain = ask(client, **common)
    chunks = list(ask(drafting, stream=True, stream_options={"include_usage": True}, **common))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert text == plain.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == len(tokens) == plain.usage.completion_tokens == 37
    for mine, theirs in zip(tokens, plain.choices[0].logprobs.content):
        assert mine.token == theirs.token and mine.logprob == pytest.approx(theirs.logprob, abs=1e-3)
    # a stop string inside a run of accepted drafts ends the answer right before it
    stop = ask(drafting, messages=COPY, max_tokens=80, stop=["spiral"])
    assert stop.choices[0].finish_reason == "stop" and "spiral" not in stop.choices[0].message.content
    assert (
        stop.choices[0].message.content
        == ask(client, messages=COPY, max_tokens=80, stop=["spiral"]).choices[0].message.content
    )


def test_json_schema_answer_validates_and_matches(spec_server, client):
    messages = [{"role": "user", "content": f"As JSON with keys keeper and duties, summarise: {PASSAGE}"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": RECORD}}
    plain = ask(client, messages=messages, max_tokens=160, response_format=fmt)
    fast = ask(spec_server.openai_client(), messages=messages, max_tokens=160, response_format=fmt)
    assert fast.choices[0].message.content == plain.choices[0].message.content
    jsonschema.validate(json.loads(fast.choices[0].message.content), RECORD)
