"""The request models' number rule: no booleans or strings for numbers, integral floats for integers."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedserve.entrypoints.tgi.protocol import GenerateRequest


def test_integral_floats_are_integers():
    request = CompletionRequest(prompt="x", max_tokens=100.0, n=2.0, seed=42.0, temperature=1)
    assert (request.max_tokens, request.n, request.seed) == (100, 2, 42)
    assert all(type(v) is int for v in (request.max_tokens, request.n, request.seed))
    assert request.temperature == 1.0
    tgi = GenerateRequest(inputs="x", parameters={"max_new_tokens": 5.0, "seed": 3.0})
    assert (tgi.parameters.max_new_tokens, tgi.parameters.seed) == (5, 3)


@pytest.mark.parametrize(
    "fields", [{"max_tokens": 1.5}, {"max_tokens": "4"}, {"prompt": [True, 2]}, {"n": True}, {"temperature": "0.5"}]
)
def test_no_coercion_from_booleans_strings_or_fractions(fields):
    with pytest.raises(ValidationError):
        CompletionRequest(**{"prompt": "x", **fields})


def test_chat_flags_stay_booleans():
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], stream=1)
