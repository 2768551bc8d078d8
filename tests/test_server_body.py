"""A request body that arrives in several pieces (slow client, proxy, real network) is read whole: the disconnect
watcher must not steal pieces of it."""

from __future__ import annotations

import json
import socket
import time

import pytest

from server_harness import API_KEY, server  # noqa: F401 (pytest fixture)


def post_in_pieces(url: str, path: str, body: bytes, pieces: int) -> tuple[int, dict]:
    host, port = url.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        sock.sendall((f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n"
                      "Connection: close\r\n\r\n").encode())
        step = -(-len(body) // pieces)
        for i in range(0, len(body), step):
            time.sleep(0.15)
            sock.sendall(body[i:i + step])
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    if b"transfer-encoding: chunked" in head.lower():  # de-chunk
        out, rest = b"", payload
        while rest:
            size, _, rest = rest.partition(b"\r\n")
            n = int(size, 16)
            if n == 0:
                break
            out, rest = out + rest[:n], rest[n + 2:]
        payload = out
    return status, json.loads(payload)


@pytest.mark.parametrize("pieces", [1, 2, 3, 4])
def test_body_in_pieces_is_read_whole(server, pieces):  # noqa: F811
    prompt = "The lighthouse keeper climbs the stairs every evening. " * 40
    body = json.dumps({"prompt": prompt}).encode()
    status, whole = post_in_pieces(server.url, "/tokenize", body, 1)
    assert status == 200
    status, got = post_in_pieces(server.url, "/tokenize", body, pieces)
    assert status == 200 and got == whole
