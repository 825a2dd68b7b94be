"""The OpenAI API of a real `pagedserve serve` (default model) through the official `openai` client."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

PROMPT = "The history of the printing press begins"
CHAT = [{"role": "user", "content": "Write two sentences about the ocean."}]


def stream_completion_text(client, **kwargs):
    chunks = list(client.completions.create(stream=True, **kwargs))
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                finishes.setdefault(choice.index, []).append(choice.finish_reason)
    return texts, finishes, chunks


def stream_chat_text(client, **kwargs):
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    roles: dict[int, list[str]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.delta.role:
                roles.setdefault(choice.index, []).append(choice.delta.role)
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                finishes.setdefault(choice.index, []).append(choice.finish_reason)
    return texts, finishes, roles, chunks


def test_models_health_version_docs(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct"]
    assert models.data[0].owned_by == "pagedserve"
    health = httpx.get(server.url + "/health")  # open route: no key needed
    assert health.status_code == 200
    assert httpx.get(server.url + "/version").json() == {"version": "0.1.0"}
    assert httpx.get(server.url + "/docs").status_code == 200
    paths = httpx.get(server.url + "/openapi.json").json()["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/generate", "/tokenize"} <= set(paths)
    response = server.get("/v1/models")
    assert "x-process-time" in response.headers and "x-request-id" in response.headers


def test_models_retrieve(client):
    card = client.models.retrieve("SmolLM2-135M-Instruct")
    assert card.id == "SmolLM2-135M-Instruct" and card.object == "model" and card.owned_by == "pagedserve"
    assert card.model_dump() == client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError) as excinfo:
        client.models.retrieve("org/some-other-model")
    assert excinfo.value.body["code"] == "model_not_found"
    assert "org/some-other-model" in excinfo.value.body["message"]


def test_completion_stream_equals_non_stream(client, tokenizer):
    kwargs = dict(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=24, temperature=0)
    full = client.completions.create(**kwargs)
    choice = full.choices[0]
    assert choice.finish_reason == "length"
    assert full.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert full.usage.completion_tokens == 24
    assert full.usage.total_tokens == full.usage.prompt_tokens + 24
    texts, finishes, chunks = stream_completion_text(client, **kwargs)
    assert texts == {0: choice.text}
    assert finishes == {0: ["length"]}
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)


def test_chat_stream_equals_non_stream_with_usage(client, tokenizer, server):
    kwargs = dict(model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=32, temperature=0)
    full = client.chat.completions.create(**kwargs)
    message = full.choices[0].message
    assert message.role == "assistant" and message.content
    template_ids = server.post("/tokenize", json={"messages": CHAT}).json()["tokens"]
    assert full.usage.prompt_tokens == len(template_ids)
    texts, finishes, roles, chunks = stream_chat_text(client, stream_options={"include_usage": True}, **kwargs)
    assert texts == {0: message.content}
    assert finishes == {0: [full.choices[0].finish_reason]}
    assert roles == {0: ["assistant"]}
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert usage_chunk.usage.prompt_tokens == full.usage.prompt_tokens
    assert usage_chunk.usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_raw_sse_format(server):
    body = {"messages": CHAT, "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream(
        "POST", server.base_url + "/chat/completions", json=body, headers=server.headers(), timeout=60
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = "".join(response.iter_text())
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events[:-1])


def test_n3_completions_one_finish_reason_each(client):
    kwargs = dict(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=12, temperature=1.0, n=3, seed=7)
    full = client.completions.create(**kwargs)
    assert sorted(c.index for c in full.choices) == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in full.choices)
    assert full.usage.completion_tokens == 36
    texts, finishes, _ = stream_completion_text(client, **kwargs)
    assert sorted(texts) == [0, 1, 2]
    assert finishes == {0: ["length"], 1: ["length"], 2: ["length"]}


def test_n3_chat_one_finish_reason_each(client):
    kwargs = dict(model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=10, n=3, temperature=1.0)
    full = client.chat.completions.create(**kwargs)
    assert sorted(c.index for c in full.choices) == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in full.choices)
    texts, finishes, roles, _ = stream_chat_text(client, **kwargs)
    assert sorted(texts) == [0, 1, 2]
    assert all(len(finishes[i]) == 1 for i in range(3))
    assert roles == {0: ["assistant"], 1: ["assistant"], 2: ["assistant"]}
    # n: null is n: 1, as OpenAI's API takes it (clients that serialise unset fields send it)
    nulled = client.chat.completions.create(**{**kwargs, "n": None})
    assert [c.index for c in nulled.choices] == [0]


def test_stop_string_across_tokens_never_leaks(client, tokenizer):
    base = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=40, temperature=0)
    text = base.choices[0].text
    ids = tokenizer.encode(text)
    # a stop string that starts inside one token and ends inside a later one
    pieces = [tokenizer.decode(ids[:i]) for i in range(len(ids) + 1)]
    start_token = len(ids) // 2
    start = len(pieces[start_token]) - 1
    stop = text[start : start + 6]
    assert len(stop) == 6 and not any(stop in tokenizer.decode([t]) for t in ids)
    expected = text[: text.index(stop)]
    full = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop]
    )
    assert full.choices[0].text == expected
    assert full.choices[0].finish_reason == "stop"
    assert full.choices[0].model_extra["stop_reason"] == stop
    texts, finishes, chunks = stream_completion_text(
        client, model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop]
    )
    # streamed text only grows, so ending exactly at `expected` means no part of the stop string was sent
    assert texts == {0: expected} and finishes == {0: ["stop"]}
    included = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt=PROMPT,
        max_tokens=40,
        temperature=0,
        stop=[stop],
        extra_body={"include_stop_str_in_output": True},
    )
    assert included.choices[0].text == expected + stop


def test_chat_stop_string(client):
    base = (
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=30, temperature=0)
        .choices[0]
        .message.content
    )
    words = base.split()
    assert len(words) > 4
    stop = words[3]
    result = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=30, temperature=0, stop=stop
    )
    assert stop not in result.choices[0].message.content
    assert base.startswith(result.choices[0].message.content)
    assert result.choices[0].finish_reason == "stop"


def test_completion_logprobs_and_echo(client, tokenizer):
    result = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3
    )
    lp = result.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(x <= 0.0 for x in lp.token_logprobs)
    assert all(1 <= len(top) <= 4 for top in lp.top_logprobs)
    echoed = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=1, echo=True
    )
    choice = echoed.choices[0]
    num_prompt = len(tokenizer.encode(PROMPT))
    assert choice.text.startswith(PROMPT)
    assert len(choice.logprobs.tokens) == num_prompt + 3
    assert choice.logprobs.token_logprobs[0] is None
    assert all(x is not None for x in choice.logprobs.token_logprobs[1:])


def test_chat_logprobs(client):
    result = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    content = result.choices[0].logprobs.content
    assert len(content) == result.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0.0 and len(entry.top_logprobs) == 2
        assert entry.bytes == list(entry.token.encode("utf-8"))
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=CHAT,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=1,
        stream=True,
    )
    streamed = [e for chunk in stream for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]


def test_sampling_extras(client, tokenizer):
    seeded = [
        client.completions.create(
            model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=12, seed=1234, temperature=1.0
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]
    forced = tokenizer.encode(" banana")[0]
    biased = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=3, temperature=0, logit_bias={str(forced): 100}
    )
    assert tokenizer.decode([forced]) in biased.choices[0].text
    long = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt=PROMPT,
        max_tokens=20,
        temperature=0,
        extra_body={"min_tokens": 20, "ignore_eos": True, "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1},
    )
    assert long.usage.completion_tokens == 20
    chat = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=CHAT, max_completion_tokens=3, temperature=0
    )
    assert chat.usage.completion_tokens <= 3
    greedy = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=8, temperature=0)
    ids = tokenizer.encode(greedy.choices[0].text)
    stopped = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        extra_body={"stop_token_ids": [ids[2]]},
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].model_extra["stop_reason"] == ids[2]


def test_default_max_tokens(client):
    completion = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True}
    )
    assert completion.usage.completion_tokens == 16


def test_multiple_prompts_and_token_prompts(client, tokenizer):
    ids = tokenizer.encode("Once upon a time")
    result = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=[PROMPT, "Hello"], max_tokens=4, temperature=0, n=2
    )
    assert sorted(c.index for c in result.choices) == [0, 1, 2, 3]
    by_tokens = client.completions.create(model="SmolLM2-135M-Instruct", prompt=ids, max_tokens=4, temperature=0)
    by_text = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt="Once upon a time", max_tokens=4, temperature=0
    )
    assert by_tokens.choices[0].text == by_text.choices[0].text
    texts, finishes, _ = stream_completion_text(
        client, model="SmolLM2-135M-Instruct", prompt=[PROMPT, "Hi"], max_tokens=3, temperature=0
    )
    assert sorted(texts) == [0, 1] and finishes == {0: ["length"], 1: ["length"]}


def test_tokenize_detokenize(server, tokenizer):
    response = server.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True})
    body = response.json()
    assert body["tokens"] == tokenizer.encode("Hello world")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] > 0
    assert len(body["token_strs"]) == body["count"]
    assert server.post("/detokenize", json={"tokens": body["tokens"]}).json() == {"prompt": "Hello world"}
    chat = server.post("/tokenize", json={"messages": CHAT}).json()
    expected = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tokenizer.encode(expected, add_special_tokens=False)


def test_many_concurrent_streams_complete(server):
    async def one(client, i):
        stream = await client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": f"Count to {i}."}],
            max_tokens=16,
            temperature=0,
            stream=True,
        )
        finishes = [c.choices[0].finish_reason async for c in stream if c.choices and c.choices[0].finish_reason]
        return finishes

    async def run():
        client = server.async_openai_client()
        results = await asyncio.gather(*(one(client, i) for i in range(24)))
        await client.close()
        return results

    results = asyncio.run(run())
    assert all(len(f) == 1 for f in results)
