"""Pure-ASGI middlewares (no BaseHTTPMiddleware: it breaks streaming and disconnect detection):
server state (ready / draining / in-flight count), timing headers, body size limit, API keys
(constant-time), a per-key-or-IP token-bucket rate limit and the Host header check.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import secrets
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedserve.entrypoints.http_protocol import ABORT_EXTENSION
from pagedserve.entrypoints.serving.errors import APIError, error_response

OPEN_PATHS = frozenset(
    {
        "/health",
        "/ping",
        "/metrics",
        "/version",
        "/info",
        "/docs",
        "/redoc",
        "/openapi.json",
        "/docs/oauth2-redirect",
        "/load",
    }
)
GUARDED_EXACT = frozenset({"/", "/tokenize", "/detokenize", "/generate", "/generate_stream", "/invocations"})


def is_guarded_path(path: str, method: str = "POST") -> bool:
    """Inference and tokenizer routes: what API keys and the rate limit apply to (``GET /`` is the
    playground page; TGI's ``POST /`` is guarded)."""
    if path == "/" and method in ("GET", "HEAD"):
        return False
    return path in GUARDED_EXACT or path.startswith("/v1/") or path == "/v1"


async def _send_error(scope: Scope, send: Send, error: APIError) -> None:
    response = error_response(error, scope.get("path", ""))
    await response(scope, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


@dataclass(slots=True)
class ServerState:
    """Shared between the lifecycle code and the middleware (one event loop, no locks)."""

    ready: bool = False
    draining: bool = False
    in_flight: int = 0


class ServerStateMiddleware:
    """503 for work while starting or draining; counts in-flight HTTP requests for the drain."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = self.state
        if is_guarded_path(scope["path"], scope["method"]) and (state.draining or not state.ready):
            reason = "shutting down" if state.draining else "starting up (loading and warming up the model)"
            await _send_error(
                scope,
                send,
                APIError(
                    f"The server is {reason}; retry later.",
                    503,
                    code="service_unavailable",
                    headers={"Retry-After": "1"},
                ),
            )
            return
        state.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            state.in_flight -= 1


class StreamStallMiddleware:
    """Aborts an event stream whose client stops reading: a write that cannot complete within
    ``stall_timeout_s`` (the socket's and the transport's buffers are full) ends the response, which
    aborts its requests, and is counted. What waits meanwhile is bounded: the transport's buffer, and
    the request's output, which merges into one pending delta while the write is blocked."""

    def __init__(self, app: ASGIApp, stall_timeout_s: float, on_abort: Callable[[], None] | None = None) -> None:
        self.app = app
        self.stall_timeout_s = stall_timeout_s
        self.on_abort = on_abort

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        streaming = False

        async def send_watched(message: Message) -> None:
            nonlocal streaming
            if message["type"] == "http.response.start":
                streaming = any(
                    name == b"content-type" and value.startswith(b"text/event-stream")
                    for name, value in message.get("headers", ())
                )
            if not streaming or message["type"] != "http.response.body":
                await send(message)
                return
            try:
                async with asyncio.timeout(self.stall_timeout_s):  # a timer handle, no task per event
                    await send(message)
            except TimeoutError:
                raise StreamStalled() from None

        try:
            await self.app(scope, receive, send_watched)
        except* StreamStalled:  # a group where the response streams from a task group
            if self.on_abort is not None:
                self.on_abort()
            abort_connection = scope.get("extensions", {}).get(ABORT_EXTENSION)
            if abort_connection is not None:  # else (h11) the server closes it once its buffer drains
                abort_connection()


class StreamStalled(Exception):
    """Raised through the response when its client has not read for the stall timeout."""


class TimingMiddleware:
    """Adds ``X-Request-Id`` (echoed or generated) and ``X-Process-Time`` (seconds to the response start)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        request_id = None
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                request_id = value[:128]
                break
        if request_id is None:
            request_id = uuid.uuid4().hex.encode()

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                headers.append((b"x-request-id", request_id))
                headers.append((b"x-process-time", f"{time.perf_counter() - start:.6f}".encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)


class BodyLimitMiddleware:
    """413 for bodies over ``max_bytes``: by Content-Length up front, else by counting streamed bytes."""

    def __init__(self, app: ASGIApp, max_bytes: int, max_headers: int = 100) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_headers = max_headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        if len(headers) > self.max_headers:
            await _send_error(scope, send, APIError(f"Too many request headers (more than {self.max_headers}).", 431))
            return
        length = None
        for name, value in headers:
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    await _send_error(scope, send, APIError("Invalid Content-Length header.", 400))
                    return
                break
        if length is not None and length > self.max_bytes:
            await _send_error(scope, send, self._too_large())
            return
        if length is None and scope["method"] in ("POST", "PUT", "PATCH"):
            receive = await self._buffer_body(scope, receive, send)
            if receive is None:
                return
        await self.app(scope, receive, send)

    def _too_large(self) -> APIError:
        return APIError(f"Request body too large: the limit is {self.max_bytes} bytes.", 413, code="request_too_large")

    async def _buffer_body(self, scope: Scope, receive: Receive, send: Send) -> Receive | None:
        """Read a body of unknown length, counting bytes; replay it to the app, then pass through."""
        chunks = []
        total = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body = message.get("body", b"")
            total += len(body)
            if total > self.max_bytes:
                await _send_error(scope, send, self._too_large())
                return None
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay_receive() -> Message:
            if replay:
                return replay.pop()
            return await receive()

        return replay_receive


class APIKeyMiddleware:
    """401 unless ``Authorization: Bearer <key>`` matches one of the keys (compared in constant time), on
    the guarded routes and ``also_guarded`` (e.g. /metrics)."""

    def __init__(self, app: ASGIApp, api_keys: list[str], also_guarded: frozenset[str] = frozenset()) -> None:
        self.app = app
        self._digests = [hashlib.sha256(key.encode()).digest() for key in api_keys]
        self._also_guarded = also_guarded

    def _authorized(self, header: bytes | None) -> bool:
        if header is None:
            return False
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        digest = hashlib.sha256(token.strip()).digest()
        matched = False
        for expected in self._digests:  # NOTE: no early exit, so timing does not reveal which key matched
            matched |= secrets.compare_digest(digest, expected)
        return matched

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] == "OPTIONS"
            or not (is_guarded_path(scope["path"], scope["method"]) or scope["path"] in self._also_guarded)
        ):
            await self.app(scope, receive, send)
            return
        header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        if not self._authorized(header):
            error = APIError(
                "Invalid or missing API key. Pass it as 'Authorization: Bearer <key>'.",
                401,
                code="invalid_api_key",
                type="invalid_request_error",
                headers={"WWW-Authenticate": "Bearer"},
            )
            await _send_error(scope, send, error)
            return
        await self.app(scope, receive, send)


class RateLimitMiddleware:
    """Token bucket per API key (when given) or client IP on the guarded routes; 429 + Retry-After."""

    MAX_CLIENTS = 100_000

    def __init__(
        self, app: ASGIApp, limit: int, period_s: float, on_reject: Callable[[str], None] | None = None
    ) -> None:
        self.app = app
        self.capacity = float(limit)
        self.rate = limit / period_s  # tokens per second
        self.on_reject = on_reject
        self._buckets: OrderedDict[bytes, tuple[float, float]] = OrderedDict()  # key -> (tokens, last time)

    def _client_key(self, scope: Scope) -> bytes:
        header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        if header:
            return b"key:" + hashlib.sha256(header).digest()
        client = scope.get("client")
        return b"ip:" + (client[0].encode() if client else b"unknown")

    def _take(self, key: bytes) -> float:
        """Take one token; 0.0 if allowed, else the seconds until one is available."""
        now = time.monotonic()
        tokens, last = self._buckets.pop(key, (self.capacity, now))
        tokens = min(self.capacity, tokens + (now - last) * self.rate)
        wait = 0.0
        if tokens >= 1.0:
            tokens -= 1.0
        else:
            wait = (1.0 - tokens) / self.rate
        self._buckets[key] = (tokens, now)
        if len(self._buckets) > self.MAX_CLIENTS:
            self._buckets.popitem(last=False)
        return wait

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] == "OPTIONS"
            or not is_guarded_path(scope["path"], scope["method"])
        ):
            await self.app(scope, receive, send)
            return
        wait = self._take(self._client_key(scope))
        if wait > 0.0:
            if self.on_reject is not None:
                self.on_reject("rate_limited")
            error = APIError(
                "Rate limit exceeded; retry later.",
                429,
                code="rate_limit_exceeded",
                type="rate_limit_error",
                headers={"Retry-After": str(max(1, math.ceil(wait)))},
            )
            await _send_error(scope, send, error)
            return
        await self.app(scope, receive, send)


class TrustedHostMiddleware:
    """400 unless the Host header names one of ``allowed_hosts``: exact names, ``*.example.com`` for
    any subdomain, or ``*`` for any host (the port is ignored); guards against DNS rebinding."""

    def __init__(self, app: ASGIApp, allowed_hosts: list[str]) -> None:
        self.app = app
        self._any = "*" in allowed_hosts
        self._exact = {host.lower() for host in allowed_hosts if not host.startswith("*")}
        self._suffixes = tuple(host[1:].lower() for host in allowed_hosts if host.startswith("*."))

    def _allowed(self, host: str) -> bool:
        if host.startswith("["):  # an IPv6 literal, [::1]:8000 -> ::1
            host = host[1:].partition("]")[0]
        else:
            host = host.rpartition(":")[0] if ":" in host else host
        host = host.lower()
        return host in self._exact or (bool(self._suffixes) and host.endswith(self._suffixes))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._any or scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = next((v for k, v in scope["headers"] if k == b"host"), b"")
        if not self._allowed(header.decode("latin-1")):
            await _send_error(scope, send, APIError("Invalid host header.", 400, code="invalid_host"))
            return
        await self.app(scope, receive, send)
