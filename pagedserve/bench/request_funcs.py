"""One benchmark request against an OpenAI-compatible server: SSE parsing and per-request timing.

``RequestFuncInput`` says what to send, ``RequestFuncOutput`` records what happened: TTFT, every
inter-token gap, end-to-end latency, token counts and the error, if any.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(slots=True)
class RequestFuncInput:
    """What to send. ``prompt_len`` is the client's own count (the server's usage wins when given)."""

    prompt: str
    prompt_len: int
    output_len: int
    model: str
    api_url: str  # full URL of the completions or chat endpoint
    endpoint: str = "completions"  # completions | chat
    api_key: str | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    include_usage: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    workload: str = ""


@dataclass(slots=True)
class RequestFuncOutput:
    """What happened to one request. Times are seconds; ``start_time`` is perf_counter at send."""

    success: bool = False
    generated_text: str = ""
    prompt_len: int = 0  # server usage if reported, else the client's count
    output_tokens: int = 0  # server usage if reported, else 0 until metrics fill it from the tokenizer
    usage_reported: bool = False
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    scheduled_time: float | None = None  # open loop: when the arrival process asked for it
    num_chunks: int = 0
    status_code: int | None = None
    error: str = ""
    error_reason: str = ""  # short, groupable: "HTTP 401", "timeout", "stream error", ...
    finish_reason: str | None = None
    workload: str = ""
    expected_prompt_len: int = 0  # the client's own count of the prompt
    expected_output_len: int = 0  # max_tokens asked for

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class SSEDecoder:
    """Incremental Server-Sent Events parser: feed raw bytes as they arrive, get complete ``data`` payloads.

    Events may be split anywhere, including inside a multi-byte UTF-8 character or between
    the CR and LF of a line ending; lines end with LF, CRLF or CR and a blank line ends an
    event. Multi-line ``data`` fields are joined with newlines; comments and other fields
    are skipped.
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""
        self._data_lines: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        text = self._pending + self._decoder.decode(chunk)
        self._pending = ""
        events: list[str] = []
        start = 0
        length = len(text)
        while start < length:
            cr = text.find("\r", start)
            lf = text.find("\n", start)
            if cr == -1 and lf == -1:
                break
            if cr == -1 or (lf != -1 and lf < cr):
                end, next_start = lf, lf + 1
            elif cr + 1 < length:
                end, next_start = cr, cr + 2 if text[cr + 1] == "\n" else cr + 1
            else:
                break  # a CR at the very end may be half of a CRLF: wait for more bytes
            self._line(text[start:end], events)
            start = next_start
        self._pending = text[start:]
        return events

    def flush(self) -> list[str]:
        """End of stream: dispatch what is left (a last event without its blank line)."""
        events: list[str] = []
        tail = self._pending + self._decoder.decode(b"", final=True)
        self._pending = ""
        for line in tail.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
            if line:
                self._line(line, events)
        self._line("", events)
        return events

    def _line(self, line: str, events: list[str]) -> None:
        if not line:
            if self._data_lines:
                events.append("\n".join(self._data_lines))
                self._data_lines = []
            return
        if line.startswith(":"):
            return
        name, _, value = line.partition(":")
        if name == "data":
            self._data_lines.append(value[1:] if value.startswith(" ") else value)


def error_message_from_body(body: bytes | str) -> str:
    """The human-readable message of an error body in OpenAI, TGI, FastAPI or plain-text shape."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        data = json.loads(text)
    except ValueError:
        return text.strip()[:500]
    if isinstance(data, dict):
        error = data.get("error", data.get("detail", data.get("message")))
        if isinstance(error, dict):
            error = error.get("message", error)
        if error is not None:
            return str(error)[:500]
    return text.strip()[:500]


def build_payload(inp: RequestFuncInput) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": inp.model,
        "max_tokens": inp.output_len,
        "temperature": inp.temperature,
        "stream": True,
    }
    if inp.endpoint == "chat":
        payload["messages"] = [{"role": "user", "content": inp.prompt}]
    else:
        payload["prompt"] = inp.prompt
    if inp.include_usage:
        payload["stream_options"] = {"include_usage": True}
    if inp.ignore_eos:
        payload["ignore_eos"] = True
    payload.update(inp.extra_body)
    return payload


def _chunk_text(data: dict[str, Any]) -> tuple[str, str | None]:
    text = ""
    finish_reason = None
    for choice in data.get("choices") or ():
        if "delta" in choice:
            delta = choice.get("delta") or {}
            text += (delta.get("content") or "") + (delta.get("reasoning_content") or "")
        else:
            text += choice.get("text") or ""
        finish_reason = choice.get("finish_reason") or finish_reason
    return text, finish_reason


class _StreamState:
    """Per-request bookkeeping while chunks arrive."""

    def __init__(self, output: RequestFuncOutput, start: float) -> None:
        self.output = output
        self.start = start
        self.last_token_time = start
        self.texts: list[str] = []
        self.done = False

    def on_payload(self, payload: str, now: float) -> None:
        out = self.output
        if payload.strip() == "[DONE]":
            self.done = True
            return
        try:
            data = json.loads(payload)
        except ValueError:
            raise _StreamError(f"invalid JSON in stream: {payload[:200]!r}") from None
        if not isinstance(data, dict):
            return
        if "error" in data:
            raise _StreamError(error_message_from_body(payload))
        usage = data.get("usage")
        if usage:
            out.usage_reported = True
            out.output_tokens = int(usage.get("completion_tokens") or 0)
            if usage.get("prompt_tokens") is not None:
                out.prompt_len = int(usage["prompt_tokens"])
        text, finish_reason = _chunk_text(data)
        if finish_reason:
            out.finish_reason = finish_reason
        if not text:
            return
        out.num_chunks += 1
        if not self.texts:
            out.ttft = now - self.start
        else:
            out.itl.append(now - self.last_token_time)
        self.last_token_time = now
        self.texts.append(text)


class _StreamError(Exception):
    pass


INCOMPLETE = "incomplete"


async def async_request_openai(
    client: httpx.AsyncClient,
    inp: RequestFuncInput,
    scheduled_time: float | None = None,
    out: RequestFuncOutput | None = None,
) -> RequestFuncOutput:
    """Stream one completion or chat request into ``out`` (a new one if None).

    Errors land in the output, never raise. Cancellation (the end of a measured window)
    marks the output ``incomplete`` and propagates.
    """
    out = out if out is not None else RequestFuncOutput()
    out.prompt_len = out.expected_prompt_len = inp.prompt_len
    out.workload = inp.workload
    out.expected_output_len = inp.output_len
    out.scheduled_time = scheduled_time
    headers = {"Accept": "text/event-stream"}
    if inp.api_key:
        headers["Authorization"] = f"Bearer {inp.api_key}"
    payload = build_payload(inp)
    decoder = SSEDecoder()
    start = time.perf_counter()
    out.start_time = start
    state = _StreamState(out, start)
    try:
        async with client.stream("POST", inp.api_url, json=payload, headers=headers) as response:
            out.status_code = response.status_code
            if response.status_code != 200:
                body = await response.aread()
                out.error = error_message_from_body(body) or response.reason_phrase
                out.error_reason = f"HTTP {response.status_code}"
                return out
            async for chunk in response.aiter_bytes():
                now = time.perf_counter()
                for payload_text in decoder.feed(chunk):
                    state.on_payload(payload_text, now)
            for payload_text in decoder.flush():
                state.on_payload(payload_text, time.perf_counter())
        out.latency = time.perf_counter() - start
        out.generated_text = "".join(state.texts)
        if not state.texts and out.output_tokens == 0:
            out.error, out.error_reason = "the stream ended without any generated text", "empty output"
            return out
        out.success = True
    except _StreamError as exc:
        out.error, out.error_reason = str(exc), "stream error"
    except httpx.TimeoutException as exc:
        out.error, out.error_reason = f"{type(exc).__name__}: {exc}", "timeout"
    except httpx.HTTPError as exc:
        out.error, out.error_reason = f"{type(exc).__name__}: {exc}", f"connection error ({type(exc).__name__})"
    except asyncio.CancelledError:
        out.error, out.error_reason = "cancelled: still running at the end of the measured window", INCOMPLETE
        raise
    finally:
        if not out.success:
            out.latency = time.perf_counter() - start
            out.generated_text = "".join(state.texts)
    return out
