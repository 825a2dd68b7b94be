"""TGI routes of a real `pagedserve serve`, through the `text-generation` client and raw HTTP."""

from __future__ import annotations

import httpx
import pytest
from text_generation import Client
from text_generation.errors import ValidationError

pytestmark = pytest.mark.slow

PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def tgi(server):
    return Client(server.url, headers=server.headers(), timeout=120)


def test_generate_with_details(tgi, tokenizer):
    response = tgi.generate(PROMPT, max_new_tokens=12)
    details = response.details
    assert details.generated_tokens == len(details.tokens) <= 12
    assert details.finish_reason.value in ("length", "eos_token")
    assert details.seed is None  # greedy
    assert all(t.logprob is not None and t.logprob <= 0 for t in details.tokens)
    plain = "".join(t.text for t in details.tokens if not t.special)
    assert plain == response.generated_text


def test_generate_stream_matches_generate(tgi):
    full = tgi.generate(PROMPT, max_new_tokens=16)
    events = list(tgi.generate_stream(PROMPT, max_new_tokens=16))
    assert [e.token.id for e in events] == [t.id for t in full.details.tokens]
    assert "".join(e.token.text for e in events if not e.token.special) == full.generated_text
    assert all(e.generated_text is None and e.details is None for e in events[:-1])
    last = events[-1]
    assert last.generated_text == full.generated_text
    assert last.details.finish_reason == full.details.finish_reason
    assert last.details.generated_tokens == len(events)


def test_generate_stop_sequence_and_full_text(tgi):
    base = tgi.generate(PROMPT, max_new_tokens=20).generated_text
    stop = base.split()[2]
    stopped = tgi.generate(PROMPT, max_new_tokens=20, stop_sequences=[stop])
    assert stop not in stopped.generated_text
    assert stopped.details.finish_reason.value == "stop_sequence"
    full = tgi.generate(PROMPT, max_new_tokens=5, return_full_text=True)
    assert full.generated_text.startswith(PROMPT)


def test_decoder_input_details_top_tokens_and_sampling(tgi, tokenizer):
    response = tgi.generate(PROMPT, max_new_tokens=4, decoder_input_details=True, top_n_tokens=3)
    prefill = response.details.prefill
    assert [t.id for t in prefill] == tokenizer.encode(PROMPT)
    assert prefill[0].logprob is None and all(t.logprob is not None for t in prefill[1:])
    assert len(response.details.top_tokens) == 4 and all(len(top) == 3 for top in response.details.top_tokens)
    sampled = tgi.generate(PROMPT, max_new_tokens=6, do_sample=True, temperature=0.8, top_k=20, top_p=0.9, seed=42)
    again = tgi.generate(PROMPT, max_new_tokens=6, do_sample=True, temperature=0.8, top_k=20, top_p=0.9, seed=42)
    assert sampled.generated_text == again.generated_text and sampled.details.seed == 42
    # typical_p (LangChain's HuggingFaceEndpoint sends 0.95): sampling, reproducible with its seed
    typical = tgi.generate(PROMPT, max_new_tokens=6, typical_p=0.95, seed=7)
    assert typical.generated_text == tgi.generate(PROMPT, max_new_tokens=6, typical_p=0.95, seed=7).generated_text
    assert typical.details.seed == 7 and typical.details.generated_tokens == 6
    best = tgi.generate(PROMPT, max_new_tokens=6, do_sample=True, best_of=2)
    assert len(best.details.best_of_sequences) == 1


def test_generate_route_and_info(server):
    response = server.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 3}})
    assert response.status_code == 200
    body = response.json()
    assert isinstance(body, dict) and "details" not in body and body["generated_text"]
    info = httpx.get(server.url + "/info").json()  # open route
    assert info["model_id"] == "SmolLM2-135M-Instruct"
    assert info["max_total_tokens"] == info["max_input_tokens"] + 1
    assert info["max_best_of"] == 2 and info["max_stop_sequences"] == 4


def test_raw_stream_has_no_done_marker(server):
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 3}}
    with httpx.stream(
        "POST", server.url + "/generate_stream", json=body, headers=server.headers(), timeout=60
    ) as response:
        raw = "".join(response.iter_text())
    events = [e for e in raw.split("\n\n") if e]
    assert len(events) == 3 and all(e.startswith("data:{") for e in events)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": 0.0}, "`temperature` must be strictly positive"),
        ({"top_p": 1.0}, "`top_p` must be > 0.0 and < 1.0"),
        ({"typical_p": 1.0}, "`typical_p` must be > 0.0 and < 1.0"),
        ({"top_k": 0}, "`top_k` must be strictly positive"),
        ({"max_new_tokens": 100_000}, "`inputs` tokens + `max_new_tokens` must be <="),
        ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "`stop` supports up to 4 stop sequences"),
        ({"best_of": 3, "do_sample": True}, "`best_of` must be > 0 and <= 2"),
    ],
)
def test_tgi_validation_errors(server, kwargs, message):
    parameters = {"max_new_tokens": 4, **kwargs}
    if "stop_sequences" in parameters:
        parameters["stop"] = parameters.pop("stop_sequences")
    response = server.post("/generate", json={"inputs": PROMPT, "parameters": parameters})
    assert response.status_code == 422
    body = response.json()
    assert body["error_type"] == "validation" and message in body["error"]


def test_tgi_client_raises_validation_error(tgi):
    with pytest.raises(ValidationError, match="inputs"):
        tgi.generate("hi", max_new_tokens=100_000)
