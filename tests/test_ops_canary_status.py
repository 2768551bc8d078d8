"""Ops checks against real processes: the canary (against real HTTP servers), status, and the driver tmpfiles
rules (applied by the real systemd-tmpfiles)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dsv41.ops.canary import run_canary
from dsv41.ops.driver import tmpfiles_text
from dsv41.ops.host_commands import Result
from dsv41.ops.status import collect_status, format_status
from conftest import free_port

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable


# ------------------------------------------------------------------------------------------ canary

CANNED_SERVER = textwrap.dedent('''
    """Canned OpenAI-shaped replies; argv: port mode (good | broken-tool | ignorant | bad-tokenize | bad-json)."""
    import http.server, json, sys
    port, mode = int(sys.argv[1]), sys.argv[2]
    PROMPT_TOKENS = 12

    def chat(body):
        message = {"role": "assistant", "content": "Paris", "tool_calls": None}
        finish = "stop"
        if body.get("tools"):
            if mode == "broken-tool":
                message["content"] = "<｜DSML｜invoke name=\\"get_weather\\">"  # the call text leaked as content
            else:
                args = '{"city": "Paris"}'
                message.update(content=None, tool_calls=[{"id": "call_1", "type": "function",
                                                          "function": {"name": "get_weather", "arguments": args}}])
                finish = "tool_calls"
        elif body.get("response_format"):
            message["content"] = '{"ok": maybe}' if mode == "bad-json" else '{"ok": true}'
        elif body.get("reasoning_effort") == "low":
            message.update(content="42", reasoning_content="17 + 25 = 42", reasoning="17 + 25 = 42")
        elif mode == "ignorant":
            message["content"] = "Lyon"
        return {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": body.get("model"),
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 1, "total_tokens": PROMPT_TOKENS + 1}}

    class Handler(http.server.BaseHTTPRequestHandler):
        def reply(self, status, obj):
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                self.reply(200, {"ok": True})
            elif self.path == "/v1/models":
                self.reply(200, {"object": "list", "data": [{"id": "canned", "object": "model"}]})
            else:
                self.reply(404, {"error": {"message": "not found", "type": "NotFoundError", "code": 404}})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/v1/chat/completions":
                self.reply(200, chat(body))
            elif self.path == "/tokenize":
                count = PROMPT_TOKENS + (1 if mode == "bad-tokenize" else 0)
                self.reply(200, {"count": count, "tokens": list(range(count)), "max_model_len": 8192,
                                 "token_strs": None})
            else:
                self.reply(404, {"error": {"message": "not found", "type": "NotFoundError", "code": 404}})

        def log_message(self, *args):
            pass

    http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
''')


@pytest.fixture
def canned():
    procs = []

    def start(mode: str) -> str:
        port = free_port()
        procs.append(subprocess.Popen([PY, "-c", CANNED_SERVER, str(port), mode]))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                return url
            except OSError:
                time.sleep(0.05)
        raise AssertionError("canned server did not start")

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def canary(url: str, level: str = "full", wait_s: float = 0.0) -> tuple[int, list[str]]:
    lines: list[str] = []
    rc = run_canary({}, url=url, level=level, wait_s=wait_s, out=lines.append)
    return rc, lines


def test_canary_passes_against_good_server(canned):
    rc, lines = canary(canned("good"))
    assert rc == 0, lines
    assert [line.split(":")[0] for line in lines[:5]] == [
        "PASS greedy-chat", "PASS thinking-reply", "PASS forced-tool-call", "PASS json-schema", "PASS tokenize"]
    assert lines[-1].startswith("canary: ok, 5 probes passed")


def test_canary_fails_on_broken_tool_call(canned):
    url = canned("broken-tool")
    rc, lines = canary(url)
    assert rc == 1
    assert "FAIL forced-tool-call: finish_reason 'stop', expected 'tool_calls'" in lines
    assert lines[-1] == f"canary: FAILED: 1 of 5 probes failed (forced-tool-call) against {url}"
    # the CLI exits non-zero too
    assert subprocess.run([PY, "-m", "dsv41.ops.cli", "canary", "--url", url],
                          env={**os.environ, "PYTHONPATH": str(REPO / "src")}, capture_output=True).returncode == 1


def test_canary_fails_on_bad_json_and_tokenize(canned):
    rc, lines = canary(canned("bad-json"))
    assert rc == 1 and any(line.startswith("FAIL json-schema: content is not JSON") for line in lines)
    rc, lines = canary(canned("bad-tokenize"))
    assert rc == 1 and any(line.startswith("FAIL tokenize: /tokenize counts 13 tokens but the chat request used 12")
                           for line in lines)


def test_canary_knowledge_checks_only_at_full_level(canned):
    url = canned("ignorant")
    rc, lines = canary(url, level="full")
    assert rc == 1 and "FAIL greedy-chat: answer 'Lyon' does not contain 'paris'" in lines
    rc, lines = canary(url, level="structural")
    assert rc == 0, lines


def test_canary_server_down():
    rc, lines = canary(f"http://127.0.0.1:{free_port()}", wait_s=1)
    assert rc == 1 and lines[-1].startswith("canary: FAILED:") and "/health not ok after 1 s" in lines[-1]


def test_canary_names_the_unreachable_address():
    port = free_port()
    result = subprocess.run([PY, "-m", "dsv41.cli", "canary", "--url", f"http://127.0.0.1:{port}"], capture_output=True,
                            text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert result.returncode == 2 and result.stdout == "", result.stdout
    assert result.stderr.startswith(f"dsv41: error: cannot reach the server: http://127.0.0.1:{port}/health: ")
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def tiny_server_available() -> str | None:
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return "torch is not installed here (the ops-only Nix check): the tiny-model server cannot run"
    try:
        import dsv41.server.cli  # noqa: F401
    except ImportError as exc:
        return f"the dsv41 server is not importable yet ({exc})"
    return None


@pytest.mark.slow
def test_canary_passes_against_tiny_model_server():
    """The real `dsv41 serve` on the built-in tiny model (random weights: structural level)."""
    reason = tiny_server_available()
    if reason:
        print(reason)
        pytest.skip(reason)
    port = free_port()
    proc = subprocess.Popen([PY, "-m", "dsv41.server", "serve", "--port", str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    try:
        rc, lines = canary(f"http://127.0.0.1:{port}", level="structural", wait_s=300)
        assert rc == 0, lines
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ------------------------------------------------------------------------------------------ status

def test_status_reports_ranks_and_health(canned, tmp_path):
    url = canned("good")
    port = url.rsplit(":", 1)[1]

    def systemctl(argv, host=None, timeout=None, input=None):
        if host == "root@worker":
            return Result(0, "ActiveState=failed\nResult=exit-code\nExecMainCode=1\nExecMainStatus=70\n")
        return Result(0, "ActiveState=active\nResult=success\n")

    env = {"DSV41_PORT": port, "DSV41_WORKER_SSH": "root@worker", "STATE_DIRECTORY": str(tmp_path)}
    status = collect_status(env, systemctl)
    assert status["health"]["status"] == 200 and not status["healthy"]
    text = format_status(status)
    assert "rank0 (local): active" in text and "rank1 (root@worker): failed, exit-code status 70" in text
    assert text.endswith("NOT healthy")


# ------------------------------------------------------------------------------------------ driver tmpfiles

def test_driver_tmpfiles_link_only_driver_libraries(tmp_path):
    libdir = tmp_path / "usr/lib/aarch64-linux-gnu"
    libdir.mkdir(parents=True)
    for name in ("libcuda.so.580.95.05", "libnvidia-ml.so.580.95.05", "libnvidia-ptxjitcompiler.so.580.95.05",
                 "libstdc++.so.6", "libc.so.6"):
        (libdir / name).write_bytes(b"\x7fELF")
    (libdir / "libcuda.so.1").symlink_to("libcuda.so.580.95.05")
    text = tmpfiles_text(libdir)
    assert "libstdc++" not in text and "libc.so" not in text
    assert f"L+ /run/opengl-driver/lib/libcuda.so.1 - - - - {libdir}/libcuda.so.1" in text.splitlines()
    tool = shutil.which("systemd-tmpfiles")
    if tool is None:
        print("systemd-tmpfiles not installed: applying the rules is not checked")
        return
    root = tmp_path / "root"
    conf = tmp_path / "dsv41-driver.conf"
    conf.write_text(text)
    result = subprocess.run([tool, "--create", f"--root={root}", str(conf)], capture_output=True, text=True)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    linked = sorted(p.name for p in (root / "run/opengl-driver/lib").iterdir())
    assert linked == ["libcuda.so.1", "libcuda.so.580.95.05", "libnvidia-ml.so.580.95.05",
                      "libnvidia-ptxjitcompiler.so.580.95.05"]
    assert os.readlink(root / "run/opengl-driver/lib/libcuda.so.1") == f"{libdir}/libcuda.so.1"


def test_driver_tmpfiles_without_driver(tmp_path):
    from dsv41.errors import ConfigError

    with pytest.raises(ConfigError, match="no libcuda.so"):
        tmpfiles_text(tmp_path)
