"""What the step kernels' test files share: their interpreted run in a child process, and the GPU guard.

TRITON_INTERPRET must be set before Triton decorates a kernel, and setting it in the pytest process would interpret
every other Triton kernel of the session, so each file's CPU measurements run once, in a child process (the file
itself with `--interp-worker OUT`), and come back as a torch.save'd object.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def interpreted(tmp_path_factory, test_file: str, name: str, timeout: int = 300, extra_args=(), env=None,
                drop_env=()):
    """Run `test_file --interp-worker OUT [extra_args...]` under the interpreter and load what it saved. env: more
    variables for the child; drop_env: variables it must not inherit (switches the test sets itself)."""
    out = tmp_path_factory.mktemp(name) / "out.pt"
    env = dict(os.environ, **(env or {}), TRITON_INTERPRET="1",
               PYTHONPATH=f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    for var in drop_env:
        env.pop(var, None)
    proc = subprocess.run([sys.executable, test_file, "--interp-worker", str(out), *extra_args], env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out)


def need_compiled_cuda() -> None:
    """Skip, with the reason, unless a CUDA GPU runs compiled kernels here."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set: GPU tests need compiled kernels")


def caught(fn, *args, **kw):
    """fn(...) or {"error": ...}: an interpreted worker reports a case's error instead of dying, so the test that
    reads the case shows it."""
    try:
        return fn(*args, **kw)
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}"}


def cuda_median_ms(fn, reps: int = 5) -> float:
    """Median ms of fn() over reps runs after one warm-up (CUDA events): the GPU tests' timing prints."""
    fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]
