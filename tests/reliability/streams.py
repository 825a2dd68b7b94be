"""Raw-socket HTTP clients for the fault tests: a streaming request whose client can read only part of
the stream and then vanish with a TCP reset, or read its stream slowly through a tiny receive window."""

from __future__ import annotations

import asyncio
import json
import socket
import struct


def request_bytes(host: str, port: int, path: str, body: dict, api_key: str | None = None) -> bytes:
    payload = json.dumps(body).encode()
    head = [
        f"POST {path} HTTP/1.1",
        f"Host: {host}:{port}",
        "Content-Type: application/json",
        f"Content-Length: {len(payload)}",
        "Accept: text/event-stream",
    ]
    if api_key:
        head.append(f"Authorization: Bearer {api_key}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + payload


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST (SO_LINGER 0), not a FIN: the client vanished."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def stream_then_reset(host: str, port: int, path: str, body: dict, read_bytes: int) -> int:
    """Send the request, read ``read_bytes`` of the response (0: none), then reset; returns bytes read."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(request_bytes(host, port, path, body))
    await writer.drain()
    got = 0
    try:
        while got < read_bytes:
            chunk = await asyncio.wait_for(reader.read(min(4096, read_bytes - got)), 60)
            if not chunk:
                break
            got += len(chunk)
    finally:
        reset(writer)
    return got


def slow_reader_socket(host: str, port: int, receive_buffer: int = 4096) -> socket.socket:
    """A connected socket with a tiny receive window (set before connecting, so the window stays small)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.connect((host, port))
    return sock
