"""What a new user meets first on the command line, each through the real `dsv41` process: `--version`, a taken
port refused before the model loads, `--device cuda` on a host without CUDA, the load progress bar on a terminal,
and `DSV41_ENGRAM_DIR` reaching the model loader."""

from __future__ import annotations

import fcntl
import importlib.metadata
import os
import pty
import socket
import struct
import subprocess
import sys
import termios
import time

import pytest
import torch

from server_harness import REPO, model_dir


def dsv41(*args: str, env: dict | None = None, **streams) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, PYTHONPATH=str(REPO / "src"), **(env or {}))
    return subprocess.run([sys.executable, "-m", "dsv41.cli", *args], text=True, timeout=120, cwd=REPO,
                          env=full_env, **(streams or {"capture_output": True}))


def one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dsv41: error: "), result.stderr
    return lines[0]


def test_version_flag_prints_the_package_version():
    result = dsv41("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"dsv41 {importlib.metadata.version('dsv41')}"


def test_serve_refuses_a_taken_port_before_loading_anything(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # an empty folder: had the model been loaded first, the error would be about its missing config.json
        started = time.monotonic()
        line = one_line_error(dsv41("serve", "--model", str(tmp_path), "--port", str(port)))
    assert line.startswith(f"dsv41: error: cannot bind 127.0.0.1:{port}: "), line
    assert time.monotonic() - started < 60


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA: --device cuda is valid here")
@pytest.mark.parametrize("command", [
    ["generate", "--prompt", "hi"],
    ["score", "--model", "unused", "--input", "unused.json", "--out", "unused.safetensors"],
    ["bench"],
    ["serve", "--port", "0"],
])
def test_device_cuda_without_cuda_is_one_line(command):
    line = one_line_error(dsv41(*command, "--device", "cuda"))
    assert "--device cuda: CUDA is not available on this host" in line


def test_load_progress_bar_on_a_terminal():
    """A bar on a terminal's stderr; piped stderr (tests, journald) gets none (test_notify checks serve's)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a pty starts 0 columns wide
    try:
        result = dsv41("generate", "--prompt", "hi", "--max-tokens", "1", "--model", str(model_dir()),
                       stdout=subprocess.PIPE, stderr=slave)
        os.close(slave)
        slave = None
        assert result.returncode == 0
        shown = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child's end of the terminal is closed
                break
            if not chunk:
                break
            shown += chunk
    finally:
        os.close(master)
        if slave is not None:
            os.close(slave)
    text = shown.decode(errors="replace")
    assert "loading: 100%" in text and " layers/s]" in text, text
    assert "prompt tokens in" in text  # the tokens/s line still follows


def test_serve_reads_the_engram_dir_from_the_environment(tmp_path):
    serve = ("serve", "--model", str(model_dir()), "--port", "0")
    missing = one_line_error(dsv41(*serve, env={"DSV41_ENGRAM_DIR": str(tmp_path / "nowhere")}))
    assert missing == f"dsv41: error: DSV41_ENGRAM_DIR {tmp_path / 'nowhere'}: no such folder"
    # an existing but empty folder reaches the loader, which looks there for this rank's shard files
    empty = tmp_path / "engram"
    empty.mkdir()
    line = one_line_error(dsv41(*serve, env={"DSV41_ENGRAM_DIR": str(empty)}))
    assert str(empty) in line and "engram-l" in line and "r0of1.bin" in line, line
