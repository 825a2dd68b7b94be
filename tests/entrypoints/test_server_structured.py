"""Structured outputs of a real `pagedserve serve` through its clients: OpenAI's response_format
(json_schema, json_object), vLLM's structured_outputs (regex, choice, grammar, json), TGI's grammar on
/generate and /generate_stream, and a 400 / 422 naming the problem for every bad spec."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from text_generation import Client
from text_generation.errors import ValidationError
from text_generation.types import Grammar, GrammarType

pytestmark = pytest.mark.slow

ORDER = {
    "type": "object",
    "properties": {
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,8}\\.com$"},
            },
            "required": ["name", "email"],
        },
        "status": {"type": "string", "enum": ["pending", "shipped", "delivered"]},
        "quantity": {"type": "integer", "minimum": 1, "maximum": 20},
        "items": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 4},
        "gift": {"type": "boolean"},
    },
    "required": ["customer", "status", "quantity", "items", "gift"],
}
ORDER_FORMAT = {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER, "strict": True}}
ASK = [{"role": "user", "content": "Create an order for a customer of a book shop, as JSON."}]


def model_of(client) -> str:
    return client.models.list().data[0].id


def test_json_schema_sampled_n3_every_sample_validates(client):
    reply = client.chat.completions.create(
        model=model_of(client), messages=ASK, response_format=ORDER_FORMAT, n=3, temperature=1.0, max_tokens=300
    )
    assert len(reply.choices) == 3
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), ORDER)


def test_json_schema_streamed_validates(client):
    chunks = client.chat.completions.create(
        model=model_of(client),
        messages=ASK,
        response_format=ORDER_FORMAT,
        temperature=1.0,
        seed=5,
        max_tokens=300,
        stream=True,
    )
    text, finishes = "", []
    for chunk in chunks:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    assert finishes == ["stop"]
    jsonschema.validate(json.loads(text), ORDER)


def test_json_object_on_chat_and_completions(client):
    chat = client.chat.completions.create(
        model=model_of(client),
        messages=[{"role": "user", "content": "Describe a car as a JSON object."}],
        response_format={"type": "json_object"},
        temperature=0.0,
        max_tokens=400,
    )
    assert isinstance(json.loads(chat.choices[0].message.content), dict)
    completion = client.completions.create(
        model=model_of(client),
        prompt="A JSON object with a city and its country:",
        extra_body={"response_format": {"type": "json_object"}},
        temperature=0.7,
        max_tokens=400,
    )
    assert isinstance(json.loads(completion.choices[0].text), dict)


def test_structured_outputs_regex_choice_grammar_json(client):
    model = model_of(client)
    regex = client.completions.create(
        model=model,
        prompt="A date in ISO format:",
        max_tokens=30,
        temperature=0.9,
        extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"}},
    )
    assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]", regex.choices[0].text)
    choice = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Is Paris in France? Answer yes or no."}],
        max_tokens=10,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert choice.choices[0].message.content in ("yes", "no")
    grammar = client.completions.create(
        model=model,
        prompt="Some arithmetic:",
        max_tokens=30,
        temperature=1.0,
        extra_body={"structured_outputs": {"grammar": 'root ::= num " + " num " = " num\nnum ::= [1-9] [0-9]?'}},
    )
    assert re.fullmatch(r"[1-9][0-9]? \+ [1-9][0-9]? = [1-9][0-9]?", grammar.choices[0].text)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    as_json = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Are you ready?"}],
        max_tokens=30,
        extra_body={"structured_outputs": {"json": schema}},
    )
    jsonschema.validate(json.loads(as_json.choices[0].message.content), schema)


def test_tgi_grammar_on_both_routes(server):
    tgi = Client(server.url, headers=server.headers(), timeout=120)
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer"}},
        "required": ["city", "population"],
    }
    response = tgi.generate(
        "A city and its population as JSON:", max_new_tokens=60, grammar=Grammar(type=GrammarType.Json, value=schema)
    )
    jsonschema.validate(json.loads(response.generated_text), schema)
    events = list(
        tgi.generate_stream(
            "The year the war ended:", max_new_tokens=10, grammar=Grammar(type=GrammarType.Regex, value="19[0-9]{2}")
        )
    )
    assert re.fullmatch("19[0-9]{2}", events[-1].generated_text)
    with pytest.raises(ValidationError, match="regular expression"):
        tgi.generate("x", max_new_tokens=4, grammar=Grammar(type=GrammarType.Regex, value="(unclosed"))


BAD_SPECS = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}}, "strin"),
    ({"structured_outputs": {"regex": "a(b"}}, "regular expression"),
    ({"structured_outputs": {"grammar": "root ::= missing_rule"}}, "missing_rule"),
    ({"structured_outputs": {"choice": []}}, "choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema is required"),
    ({"response_format": {"type": "xml"}}, "xml"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"uniqueItems": True}}}},
        "uniqueItems",
    ),
    (
        {
            "structured_outputs": {"json": {"type": "array", "items": {"type": "integer"}}},
            "response_format": {"type": "json_object"},
        },
        "Only one",
    ),
]


def deep_schema(levels: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize(
    ("body", "needle"), BAD_SPECS + [({"structured_outputs": {"json": deep_schema(40)}}, "levels")]
)
def test_bad_specs_get_400_and_the_server_goes_on(server, client, body, needle):
    response = server.post(
        "/v1/chat/completions",
        json={"model": model_of(client), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body},
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert needle in error["message"] and error["type"] == "invalid_request_error"
    reply = client.chat.completions.create(
        model=model_of(client),
        messages=[{"role": "user", "content": "Say yes or no."}],
        max_tokens=4,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert reply.choices[0].message.content in ("yes", "no")


def test_openai_client_bad_schema_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError, match="minimum greater than maximum"):
        client.chat.completions.create(
            model=model_of(client),
            messages=ASK,
            max_tokens=4,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "n", "schema": {"type": "integer", "minimum": 5, "maximum": 1}},
            },
        )
