"""A table of bad inputs against a real server: each gets its status and message, never a 422 or 500 on the
OpenAI routes; afterwards the server still serves correctly."""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass, field

import httpx
import pytest

from tests.conftest import API_KEY, MAX_REQUEST_BYTES

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
MSGS = [{"role": "user", "content": "Hi"}]


@dataclass
class Case:
    name: str
    path: str
    body: object = None  # JSON-encoded unless raw is given
    status: int = 400
    message: str = ""
    raw: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    auth: str | None = API_KEY
    method: str = "POST"


def completion(**fields):
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **fields}


def chat(**fields):
    return {"model": MODEL, "messages": MSGS, "max_tokens": 4, **fields}


CASES = [
    Case(
        "empty prompt",
        "/v1/completions",
        completion(prompt=""),
        message="Either prompt or prompt_embeds must be provided and non-empty.",
    ),
    Case("empty prompt list", "/v1/completions", completion(prompt=[]), message="must be provided and non-empty"),
    Case("missing prompt", "/v1/completions", {"model": MODEL}, message="must be provided and non-empty"),
    Case("max_tokens wrong type", "/v1/completions", completion(max_tokens="abc"), message="max_tokens"),
    Case("negative max_tokens", "/v1/completions", completion(max_tokens=-5), message="max_tokens must be at least 1"),
    Case(
        "huge max_tokens",
        "/v1/completions",
        completion(max_tokens=10**9),
        message="This model's maximum context length is",
    ),
    Case("n=100000", "/v1/completions", completion(n=100000), message="n must be at most 128"),
    Case("n=0", "/v1/chat/completions", chat(n=0), message="n must be at least 1"),
    Case("top_p=0", "/v1/completions", completion(top_p=0), message="top_p must be in (0, 1]"),
    Case(
        "negative temperature", "/v1/chat/completions", chat(temperature=-1), message="temperature must be at least 0"
    ),
    Case("temperature wrong type", "/v1/chat/completions", chat(temperature="hot"), message="temperature"),
    Case(
        "logprobs=50",
        "/v1/completions",
        completion(logprobs=50),
        message="Requested logprobs of 50, which is greater than max allowed: 20",
    ),
    Case("negative logprobs", "/v1/completions", completion(logprobs=-1), message="must be a non-negative value"),
    Case(
        "top_logprobs without logprobs",
        "/v1/chat/completions",
        chat(top_logprobs=5),
        message="`logprobs` must be set to true",
    ),
    Case(
        "top_logprobs=21",
        "/v1/chat/completions",
        chat(logprobs=True, top_logprobs=21),
        message="greater than max allowed: 20",
    ),
    Case(
        "unknown model",
        "/v1/completions",
        completion(model="gpt-4"),
        status=404,
        message="The model `gpt-4` does not exist.",
    ),
    Case(
        "invalid UTF-8",
        "/v1/completions",
        raw=b'{"model": "x", "prompt": "\xff\xfe bad"}',
        message="not valid JSON (or not valid UTF-8)",
    ),
    Case("invalid JSON", "/v1/chat/completions", raw=b'{"messages": [', message="Invalid JSON body"),
    Case("JSON array body", "/v1/completions", [1, 2, 3], message="valid dictionary"),
    Case(
        "10 MB body",
        "/v1/completions",
        raw=b'{"prompt": "' + b"a" * (10 << 20) + b'"}',
        status=413,
        message=f"the limit is {MAX_REQUEST_BYTES} bytes",
    ),
    Case(
        "non-JSON content type",
        "/v1/completions",
        raw=json.dumps(completion()).encode(),
        headers={"Content-Type": "text/plain"},
        message="Only 'application/json' is allowed",
    ),
    Case(
        "form content type",
        "/v1/chat/completions",
        raw=b"prompt=hello",
        headers={"Content-Type": "application/x-www-form-urlencoded"},
        message="Only 'application/json'",
    ),
    Case("missing API key", "/v1/completions", completion(), status=401, message="API key", auth=None),
    Case("wrong API key", "/v1/chat/completions", chat(), status=401, message="API key", auth="sk-wrong"),
    Case("wrong key on /tokenize", "/tokenize", {"prompt": "hi"}, status=401, message="API key", auth="nope"),
    Case("messages not a list", "/v1/chat/completions", chat(messages="hi"), message="messages"),
    Case("messages empty", "/v1/chat/completions", chat(messages=[]), message="at least one message"),
    Case(
        "unknown role",
        "/v1/chat/completions",
        chat(messages=[{"role": "wizard", "content": "x"}]),
        message="unknown role",
    ),
    Case(
        "image content part",
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        message="only text content parts are supported",
    ),
    Case(
        "request chat template",
        "/v1/chat/completions",
        chat(chat_template="{{ 7*7 }}"),
        message="Request-supplied chat templates are not allowed",
    ),
    Case(
        "template kwargs override",
        "/v1/chat/completions",
        chat(chat_template_kwargs={"messages": []}),
        message="chat_template_kwargs may not set",
    ),
    Case(
        "token id out of vocab",
        "/v1/completions",
        completion(prompt=[1, 999999]),
        message="Token id 999999 is out of vocabulary",
    ),
    Case("negative token id", "/v1/completions", completion(prompt=[-1]), message="Token id -1 is out of vocabulary"),
    Case(
        "bad logit_bias keys",
        "/v1/completions",
        completion(logit_bias={"abc": 5, "9999999": 1}),
        message="Invalid logit_bias keys ['abc', '9999999']",
    ),
    Case("seed beyond int64", "/v1/completions", completion(seed=2**64), message="seed must be at most"),
    Case(
        "stream_options without stream",
        "/v1/chat/completions",
        chat(stream_options={"include_usage": True}),
        message="Stream options can only be defined when `stream=True`.",
    ),
    Case(
        "presence_penalty too big",
        "/v1/completions",
        completion(presence_penalty=5),
        message="presence_penalty must be at most 2.0",
    ),
    Case(
        "min_tokens > max_tokens",
        "/v1/completions",
        completion(min_tokens=10, max_tokens=2),
        message="min_tokens must be less than or equal to max_tokens",
    ),
    Case(
        "json response_format",
        "/v1/chat/completions",
        chat(response_format={"type": "xml"}),
        message="is not supported",
    ),
    Case(
        "tool_choice names an unknown function",
        "/v1/chat/completions",
        chat(
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
        message="'g'",
    ),
    Case(
        "tool without a function name",
        "/v1/chat/completions",
        chat(tools=[{"type": "function", "function": {"parameters": {}}}]),
        message="name",
    ),
    Case(
        "lone surrogate",
        "/v1/completions",
        raw=b'{"prompt": "bad \\ud800 text", "max_tokens": 2}',
        message="is not valid Unicode",
    ),
    Case("best_of", "/v1/completions", completion(best_of=3), message="best_of is not supported"),
    Case("stream wrong type", "/v1/completions", completion(stream=[1]), message="stream"),
    Case(
        "prompt longer than context",
        "/v1/completions",
        completion(prompt=[17] * 9000, max_tokens=None),
        message="However, you requested 9000 tokens in the messages",
    ),
    Case(
        "stop_token_ids out of vocab",
        "/v1/completions",
        completion(stop_token_ids=[10**9]),
        message="out of vocabulary",
    ),
    Case("empty stop string", "/v1/completions", completion(stop=[""]), message="stop strings must be non-empty"),
    Case("detokenize bad id", "/detokenize", {"tokens": [-5]}, message="Token id -5 is out of vocabulary"),
    Case(
        "truncate_prompt_tokens=0",
        "/v1/completions",
        completion(truncate_prompt_tokens=0),
        message="truncate_prompt_tokens must be at least 1",
    ),
    Case("wrong method", "/v1/completions", status=405, message="Method Not Allowed", method="GET"),
    Case("unknown route", "/v1/nothing", {}, status=404, message="Not Found"),
    Case("TGI empty inputs", "/generate", {"inputs": ""}, status=422, message="`inputs` cannot be empty"),
    Case("TGI missing inputs", "/generate", {"parameters": {}}, status=422, message="inputs"),
    Case("TGI wrong key", "/generate", {"inputs": "x"}, status=401, message="API key", auth="bad"),
    Case("stop string too long", "/v1/completions", completion(stop=["x" * 1025]), message="at most 1024 characters"),
    Case(
        "TGI stop string too long",
        "/generate",
        {"inputs": "x", "parameters": {"stop": ["y" * 1025]}},
        status=422,
        message="at most 1024 characters",
    ),
    Case(
        "logit_bias too large",
        "/v1/completions",
        completion(logit_bias={str(i): 1 for i in range(1025)}),
        message="at most 1024 entries",
    ),
    Case("too many messages", "/v1/chat/completions", chat(messages=MSGS * 4097), message="at most 4096"),
    Case(
        "JSON nested too deeply",
        "/v1/chat/completions",
        raw=b'{"messages": [{"role": "user", "content": "hi"}], "tools": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        message="not valid JSON",
    ),
    Case("boolean as a token id", "/v1/completions", completion(prompt=[True, False]), message="prompt"),
    Case("number as a string", "/v1/completions", completion(max_tokens="4"), message="max_tokens"),
    Case("empty cache_salt", "/v1/completions", completion(cache_salt=""), message="cache_salt"),
    Case("n too large", "/v1/completions", completion(n=129), message="n must be at most 128"),
]


def send(server, case: Case) -> httpx.Response:
    headers = dict(case.headers)
    if case.auth is not None:
        headers.setdefault("Authorization", f"Bearer {case.auth}")
    if case.raw is not None:
        headers.setdefault("Content-Type", "application/json")
        content = case.raw
    elif case.body is not None:
        headers.setdefault("Content-Type", "application/json")
        content = json.dumps(case.body).encode()
    else:
        content = None
    return httpx.request(case.method, server.url + case.path, content=content, headers=headers, timeout=60)


def test_at_least_25_cases():
    assert len(CASES) >= 25


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input(server, case):
    response = send(server, case)
    assert response.status_code == case.status, response.text
    body = response.json()
    if case.path in ("/generate", "/generate_stream", "/"):
        assert set(body) == {"error", "error_type"}
        message = body["error"]
    else:
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
        message = body["error"]["message"]
    assert case.message in message
    if case.status == 401:
        assert response.headers.get("www-authenticate") == "Bearer"


def _raw_exchange(server, pieces: list[bytes]) -> bytes:
    """Send ``pieces`` one write at a time on a fresh connection; return what the server answered
    until it closed the connection or went quiet (a refused connection may reset instead)."""
    received = b""
    with socket.create_connection((server.host, server.port), timeout=30) as sock:
        try:
            for piece in pieces:
                sock.sendall(piece)
            sock.settimeout(10)
            while chunk := sock.recv(65536):
                received += chunk
        except (ConnectionResetError, BrokenPipeError, TimeoutError):
            pass
    return received


def _head(extra_header: str = "") -> bytes:
    return (
        f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n{extra_header}"
        "Connection: close\r\n\r\n"
    ).encode()


def test_oversized_and_too_many_headers(server):
    reply = _raw_exchange(server, [_head(f"X-Big: {'a' * (128 << 10)}\r\n")])
    # refused: an error status, or the connection dropped; never a 200
    assert reply == b"" or reply.split(b" ", 2)[1] in (b"400", b"431"), reply[:200]
    many = {f"X-H{i}": "v" for i in range(150)}
    many["Authorization"] = f"Bearer {API_KEY}"
    response = httpx.post(server.url + "/v1/completions", json=completion(), headers=many, timeout=60)
    assert response.status_code == 431


def test_request_head_limit_is_exact_and_holds_for_trickled_heads(server):
    """--max-header-bytes (64 KiB here) bounds the request line plus headers whether the head comes in
    one write or a trickle; a head under it is served, a never-ending header value is cut off."""
    under = _raw_exchange(server, [_head(f"X-Pad: {'a' * (60 << 10)}\r\n")])
    assert under.startswith(b"HTTP/1.1 200"), under[:100]
    over = _head(f"X-Pad: {'a' * (70 << 10)}\r\n")
    trickled = _raw_exchange(server, [over[i : i + 4096] for i in range(0, len(over), 4096)])
    assert trickled == b"" or trickled.startswith(b"HTTP/1.1 431"), trickled[:100]
    many = _head("".join(f"X-H{i}: {'b' * 1000}\r\n" for i in range(70)))  # each header small, 70 KB in all
    assert _raw_exchange(server, [many]).startswith(b"HTTP/1.1 431")
    # one header value that never ends: refused after the limit, not buffered for ever
    endless = [b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Endless: "] + [b"c" * 8192] * 64
    answer = _raw_exchange(server, endless)
    assert answer == b"" or answer.startswith(b"HTTP/1.1 431"), answer[:100]
    assert httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200


def test_pipelined_requests_on_one_connection_are_all_answered(server):
    keep = (f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n\r\n").encode()
    answer = _raw_exchange(server, [keep * 3 + _head()])
    assert answer.count(b"HTTP/1.1 200") == 4, answer[:300]


def test_chunked_body_over_limit_is_counted(server):
    def body():
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"a" * (128 << 10)  # 2.5 MiB in all, sent without a Content-Length
        yield b'"}'

    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    try:
        response = httpx.post(server.url + "/v1/completions", content=body(), headers=headers, timeout=60)
    except httpx.HTTPError:
        return  # the server answered 413 and closed while the client was still sending
    assert response.status_code == 413
    assert "Request body too large" in response.json()["error"]["message"]
    small = httpx.post(server.url + "/tokenize", content=iter([b'{"prompt": ', b'"chunked"}']), headers=headers)
    assert small.status_code == 200 and small.json()["count"] > 0


def test_server_still_serves_after_bad_inputs(server, client):
    for case in CASES[:10]:
        send(server, case)
    assert httpx.get(server.url + "/health").status_code == 200
    result = client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=5, temperature=0)
    assert result.choices[0].finish_reason in ("length", "stop") and result.usage.completion_tokens >= 1
    chat_result = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=5)
    assert chat_result.choices[0].message.content is not None
