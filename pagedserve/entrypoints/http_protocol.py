"""The HTTP/1.1 protocol the server speaks: uvicorn's httptools (C parser) with a bound on request heads.

uvicorn's h11 protocol bounds a request head with ``h11_max_incomplete_event_size``; its httptools
protocol, cheaper per streamed chunk, has no bound at all (llhttp buffers a header value of any
size). ``BoundedHttpToolsProtocol`` applies the same setting: a request whose line and headers
exceed it gets ``431 Request Header Fields Too Large`` and the connection is closed.
``http_protocol(choice)`` picks what ``--http`` asks for.
"""

from __future__ import annotations

from typing import Any

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol  # imports httptools
except ImportError:  # httptools is optional: without it the server speaks h11
    HttpToolsProtocol = None

HEAD_TOO_LARGE = b"Request header fields too large."
# scope["extensions"][ABORT_EXTENSION]() drops the connection at once (a reset), unsent bytes and all;
# an ASGI app can only close, which waits for a buffer a client that reads nothing never drains
ABORT_EXTENSION = "pagedserve.abort_connection"


class HeadTooLarge(Exception):
    """Raised inside a parser callback when the request head passes the limit."""


if HttpToolsProtocol is not None:

    class BoundedHttpToolsProtocol(HttpToolsProtocol):
        """httptools with the request head (request line + headers) limited to
        ``config.h11_max_incomplete_event_size`` bytes, as h11 limits it."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._head_limit: int | None = self.config.h11_max_incomplete_event_size
            self._in_head = True  # between a request's first byte and the end of its headers
            self._raw_head_bytes = 0  # bytes received while the current head stays incomplete (data_received)
            self._parsed_head_bytes = 0  # its request line and headers as parsed so far
            self._refused = False

        def data_received(self, data: bytes) -> None:
            super().data_received(data)  # uvicorn's: parse errors get 400, routed to send_400_response
            if self._refused or not self._in_head or self._head_limit is None:
                return
            # a head still incomplete after this chunk: llhttp keeps buffering a partial header value,
            # so bound the raw bytes too (a chunk that also ended the previous request counts whole)
            self._raw_head_bytes += len(data)
            if self._raw_head_bytes > self._head_limit:
                self._refuse_head()

        def send_400_response(self, msg: str) -> None:
            if self._refused:  # a parser callback refused the head (on_url / on_header)
                self._write_431()
            else:
                super().send_400_response(msg)

        def _refuse_head(self) -> None:
            self._refused = True
            self._write_431()

        def _write_431(self) -> None:
            self.logger.warning("Request head over %s bytes refused with 431", self._head_limit)
            self.transport.write(
                b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; charset=utf-8\r\n"
                b"content-length: "
                + str(len(HEAD_TOO_LARGE)).encode()
                + b"\r\nconnection: close\r\n\r\n"
                + HEAD_TOO_LARGE
            )
            self.transport.close()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_head = True
            self._raw_head_bytes = self._parsed_head_bytes = 0

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value) + 4)  # ": " and CRLF
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._in_head = False
            self.scope["extensions"] = {**self.scope.get("extensions", {}), ABORT_EXTENSION: self.transport.abort}
            super().on_headers_complete()

        def _count(self, size: int) -> None:
            self._parsed_head_bytes += size
            if self._head_limit is not None and self._parsed_head_bytes > self._head_limit:
                self._refused = True
                raise HeadTooLarge()  # the parser fails; uvicorn's 400 path answers 431 (send_400_response)

else:
    BoundedHttpToolsProtocol = None


def http_protocol(choice: str) -> Any:
    """``--http``: the uvicorn ``http`` setting for ``auto`` (httptools when installed), ``httptools`` or ``h11``."""
    if choice == "h11":
        return "h11"
    if BoundedHttpToolsProtocol is None:
        if choice == "httptools":
            raise ImportError("--http httptools needs the httptools package")
        return "h11"
    return BoundedHttpToolsProtocol
