"""The HTTP server over a TP=2 group: real hypercorn on rank 0, real rank processes, the tiny model.

Launched as `python -m dsv41.server serve --tp 2 ...` (local ranks) or as one process per `--rank`. Checked: the
same completion request gives the same greedy text from a TP=1 server and a TP=2 server; SIGTERM to rank 0 drains
and all ranks exit 0; an exception injected on rank 1 mid-request gives the client an error and both ranks exit 70
within 2 s.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

PROMPT_IDS = [0] + [(i * 53) % 500 + 7 for i in range(20)]


# ---- helpers ---------------------------------------------------------------------------------------------------

class Server:
    def __init__(self, cmd: list[str], env_extra: dict | None = None):
        env = dict(os.environ, TORCH_CPP_LOG_LEVEL="ERROR", PYTHONUNBUFFERED="1", **(env_extra or {}))
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines.put), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, self.stderr.append), daemon=True).start()
        self.url = None

    @staticmethod
    def _pump(stream, sink):
        for line in stream:
            sink(line)

    def wait_ready(self, timeout: float = 240) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None:
                    raise AssertionError(f"server exited {self.proc.returncode}:\n{''.join(self.stderr)[-3000:]}")
                continue
            if "serving" in line and "http://" in line:
                self.url = line.strip().rsplit(" ", 1)[1]
                return self.url
        raise AssertionError(f"server not ready in {timeout} s:\n{''.join(self.stderr)[-3000:]}")

    def complete(self, max_tokens: int, timeout: float = 120) -> httpx.Response:
        return httpx.post(f"{self.url}/v1/completions", timeout=timeout,
                          json={"model": "tiny", "prompt": PROMPT_IDS, "max_tokens": max_tokens,
                                "temperature": 0, "ignore_eos": True})

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()


def server_cmd(*extra: str) -> list[str]:
    # Without fake quantisation the model is a continuous function, so TP's different (rank-ordered) summation
    # cannot flip an FP4/FP8 code and greedy text is comparable across TP degrees (docs/MODEL_NOTES.md).
    return [sys.executable, "-m", "dsv41.server", "serve", "--port", "0", "--served-name", "tiny", "--cpu-threads",
            "1", "--no-fake-quant", *extra]


@pytest.fixture(scope="module")
def tp1_text():
    server = Server(server_cmd())
    try:
        server.wait_ready()
        reply = server.complete(max_tokens=16)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["text"]
    finally:
        server.stop()


# ---- tests -----------------------------------------------------------------------------------------------------

def test_tp2_server_answers_like_tp1_and_drains_on_sigterm(tp1_text):
    server = Server(server_cmd("--tp", "2"))
    try:
        server.wait_ready()
        reply = server.complete(max_tokens=16)
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["usage"]["completion_tokens"] == 16
        assert body["choices"][0]["text"] == tp1_text
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0, "".join(server.stderr)[-3000:]
    finally:
        server.stop()


def test_exception_on_rank1_mid_request_gives_the_client_an_error_and_both_exit_70(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        master = f"127.0.0.1:{s.getsockname()[1]}"
    # round 0 is the server's warm-up token, round 1 the prompt, rounds 2.. the decode steps
    env = {"DSV41_TEST_FAIL_AT_ROUND": "1:6"}
    rank1 = Server(server_cmd("--tp", "2", "--rank", "1", "--master", master), env)
    rank0 = Server(server_cmd("--tp", "2", "--rank", "0", "--master", master), env)
    try:
        rank0.wait_ready()
        reply = rank0.complete(max_tokens=30)
        t_reply = time.time()
        assert reply.status_code == 500, reply.text
        assert "rank 1" in reply.json()["error"]["message"]
        codes = [rank0.proc.wait(timeout=30), rank1.proc.wait(timeout=30)]
        t_exit = time.time()
        assert codes == [70, 70], "".join(rank0.stderr)[-2000:] + "".join(rank1.stderr)[-2000:]
        injected = next(float(line.rsplit("at unix time", 1)[1]) for line in rank1.stderr
                        if "at unix time" in line)
        print(f"\nHTTP error {t_reply - injected:.2f} s, both exited {t_exit - injected:.2f} s after the failure")
        assert t_reply - injected < 2.0 and t_exit - injected < 2.5, (t_reply - injected, t_exit - injected)
    finally:
        rank0.stop()
        rank1.stop()
