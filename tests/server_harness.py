"""A real `dsv41 serve` process on loopback for the server tests (hypercorn, the real tiny model).

`ServerProcess` starts `python -m dsv41.server serve --port 0 ...`, waits for the "serving ... on http://..."
line, and stops it with SIGTERM. The session-wide `server` fixture is shared by the test modules that import it.
The model folder is the built-in tiny model (`dsv41.tiny.model.default_model_dir()`); DSV41_TEST_MODEL overrides it.
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

REPO = Path(__file__).resolve().parents[1]
API_KEY = "test-key-0123456789"
SERVED_NAME = "dsv41-tiny"
ALIAS = "deepseek-v4.1-flash"


def model_dir() -> Path:
    override = os.environ.get("DSV41_TEST_MODEL")
    if override:
        return Path(override)
    from dsv41.tiny.model import default_model_dir

    return default_model_dir()


class ServerProcess:
    def __init__(self, tmp: Path, *extra: str, api_key: str | None = API_KEY, start_timeout_s: float = 180,
                 model: Path | None = None):
        self.tmp = Path(tmp)
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.request_log = self.tmp / "requests.jsonl"
        args = [sys.executable, "-m", "dsv41.server", "serve", "--model", str(model or model_dir()), "--port", "0",
                "--served-name", SERVED_NAME, "--alias", ALIAS, "--cpu-threads", "1", "--max-body-bytes", "1000000",
                "--request-log", str(self.request_log), *extra]
        self.api_key = api_key
        if api_key is not None:
            key_file = self.tmp / "api-key"
            key_file.write_text(api_key + "\n")
            args += ["--api-key-file", str(key_file)]
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     cwd=REPO)
        self.lines: list[str] = []
        self._url_seen = threading.Event()
        self.url: str | None = None
        threading.Thread(target=self._pump, daemon=True).start()
        if not self._url_seen.wait(start_timeout_s) or self.url is None:
            self.kill()
            raise RuntimeError("server did not start:\n" + "".join(self.lines[-40:]))

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            match = re.search(r"dsv41: serving .* on (http://\S+)", line)
            if match:
                self.url = match.group(1)
                self._url_seen.set()
        self._url_seen.set()

    def output(self) -> str:
        return "".join(self.lines)

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0,
                             timeout=kw.pop("timeout", 120), **kw)

    def http(self, **kw) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=kw.pop("timeout", 120), **kw)

    def health(self) -> httpx.Response:
        return httpx.get(f"{self.url}/health", timeout=30)

    def wait_idle(self, timeout_s: float = 30) -> dict:
        """Poll /health until nothing is in flight and the engine holds no sequence."""
        deadline = time.monotonic() + timeout_s
        body = {}
        while time.monotonic() < deadline:
            body = self.health().json()
            engine = body["engine"]
            if body["inflight"] == 0 and engine["running"] == 0 and engine["waiting"] == 0 \
                    and engine["live_sequences"] == 0 and body["generations"] == 0:
                return body
            time.sleep(0.05)
        raise AssertionError(f"server did not become idle: {body}")

    def terminate(self, timeout_s: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


_shared: ServerProcess | None = None


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """One server for every module that imports this fixture (each import would otherwise start its own)."""
    global _shared
    if _shared is None or _shared.proc.poll() is not None:
        _shared = ServerProcess(tmp_path_factory.mktemp("server"))
        atexit.register(_shared.terminate)
    return _shared


@pytest.fixture(scope="session")
def client(server):
    return server.client()


@pytest.fixture(scope="session")
def tokenizer():
    from dsv41.tokenizer import Tokenizer

    return Tokenizer.from_dir(model_dir())


# ---- raw HTTP probes (what httpx will not send: broken framing, half-sent bodies, odd Host headers) ----------
def raw_exchange(url: str, data: bytes, *, half_close: bool = False, timeout_s: float = 30.0,
                 pause_after: int | None = None, pause_s: float = 0.0) -> tuple[int | None, dict, bytes]:
    """Send `data` as is over a new connection (optionally pausing after `pause_after` bytes, then shutting
    down the write side), read until the server closes; (status or None, lower-case headers, body)."""
    import socket

    host, port = url.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        if pause_after is not None:
            sock.sendall(data[:pause_after])
            time.sleep(pause_s)
            data = data[pause_after:]
        sock.sendall(data)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except (ConnectionResetError, TimeoutError):
            pass
    return parse_response(received)


def parse_response(received: bytes) -> tuple[int | None, dict, bytes]:
    head, _, body = received.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    if not lines or not lines[0].startswith("HTTP/"):
        return None, {}, received
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding") == "chunked":
        out, rest = b"", body
        while rest:
            size, _, rest = rest.partition(b"\r\n")
            n = int(size or b"0", 16)
            if n == 0:
                break
            out, rest = out + rest[:n], rest[n + 2:]
        body = out
    return int(lines[0].split(" ")[1]), headers, body


def request_bytes(method: str, path: str, body: bytes = b"", *, host: str = "127.0.0.1",
                  content_type: str | None = "application/json", api_key: str | None = API_KEY,
                  extra: str = "", length: int | None = None) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n"
    if content_type is not None:
        head += f"Content-Type: {content_type}\r\n"
    if api_key is not None:
        head += f"Authorization: Bearer {api_key}\r\n"
    if body or length is not None:
        head += f"Content-Length: {len(body) if length is None else length}\r\n"
    return (head + extra + "\r\n").encode("latin-1") + body
