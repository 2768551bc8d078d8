"""`dsv41 warm-kernels` (prepared/warm_kernels.py): the service's Triton cache filled before its first start.

CPU: the cache folder is the unit's own (read from the rendered dsv41@.service); the command runs the service's
start (prepared folder, runner, first request) in a child with the given TRITON_CACHE_DIR; a failing warm step
leaves `dsv41 prepare` successful with a warning. GPU: after the warm step a fresh start compiles nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv41.ops.units import render_units
from dsv41.prepared.warm_kernels import count_files, triton_cache_dir, unit_environment, unit_user

REPO = Path(__file__).resolve().parents[1]


def _dsv41(*args: str, cpu: bool = True) -> subprocess.CompletedProcess:
    """The CLI in a child. On the CPU the fast forward (which a start from a folder runs) needs Triton's interpreter
    (the FP8 model's kernels are plain torch there): the folder is prepared and started under it."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    if cpu:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, "-c", "import sys; from dsv41.cli import main; sys.exit(main())", *args],
                          capture_output=True, text=True, timeout=600, env=env)


@pytest.fixture(scope="module")
def lite(tmp_path_factory) -> Path:
    from dsv41.tiny.model import make_tiny
    from test_runtime_fast import LITE

    return make_tiny(tmp_path_factory.mktemp("warm-fp8") / "model", "fp8", seed=0, overrides=LITE)


def test_the_cache_dir_is_the_units():
    """The unit's own Environment= line, expanded as systemd expands it for a system unit (%C = /var/cache)."""
    unit = render_units()["dsv41@.service"]
    line = next(x for x in unit.splitlines() if x.startswith("Environment=TRITON_CACHE_DIR="))
    assert line == "Environment=TRITON_CACHE_DIR=%C/dsv41/%i/triton"
    assert triton_cache_dir("rank1") == Path("/var/cache/dsv41/rank1/triton")
    assert unit_user() == "dsv41"
    env = unit_environment("rank0")
    assert env["CC"].endswith("/libexec/dsv41/cc") and env["HOME"] == "/var/lib/dsv41"
    # the warm unit compiles into the same folder
    warm = render_units()["dsv41-warm@.service"]
    assert triton_cache_dir("rank0", warm) == triton_cache_dir("rank0")


def test_warm_kernels_runs_the_start_in_a_child_with_the_cache(lite, tmp_path):
    """On the CPU nothing compiles, but the child runs the service's start: the folder read, the runner built,
    the first request's token; a missing prepared folder is skipped; prepare's warm step only warns when it fails."""
    out, cache = tmp_path / "prepared", tmp_path / "triton"
    prep = _dsv41("prepare", "--model", str(lite), "--out", str(out), "--device", "cpu")
    assert prep.returncode == 0 and "warm-kernels" not in prep.stderr, prep.stderr  # on by default on CUDA only
    warm = _dsv41("warm-kernels", "--prepared", str(out), "--model", str(lite), "--device", "cpu",
                  "--triton-cache-dir", str(cache))
    assert warm.returncode == 0, warm.stderr
    lines = warm.stderr.splitlines()
    assert f"warm-kernels: rank 0: compiling the start's Triton kernels into {cache} (0 files)" in lines
    for phase in ("manifest", "read", "skeleton", "runner", "first_token"):
        assert any(line.startswith(f"  start: {phase} ") for line in lines), (phase, warm.stderr)
    done = [line for line in lines if line.startswith("warm-kernels: rank 0: ") and " files added to " in line]
    assert len(done) == 1 and done[0].endswith(f"files added to {cache} ({count_files(cache)} in all)")
    assert cache.is_dir()
    missing = _dsv41("warm-kernels", "--prepared", str(tmp_path / "nowhere"), "--model", str(lite), "--device", "cpu",
                     "--triton-cache-dir", str(cache))
    assert missing.returncode == 0 and f"warm-kernels: skip rank 0: {tmp_path / 'nowhere' / 'rank0-of-1'} is not " \
                                       "prepared (run `dsv41 prepare`)" in missing.stderr

    # prepare's warm step (forced here) fails (its cache folder cannot be made: a file is in the way): prepare
    # still succeeds
    blocker = tmp_path / "file"
    blocker.write_text("")
    failed = _dsv41("prepare", "--model", str(lite), "--out", str(out), "--device", "cpu", "--warm-kernels",
                    "--triton-cache-dir", str(blocker / "triton"))
    assert failed.returncode == 0, failed.stderr
    assert f"warning: warm-kernels: rank 0: cannot make {blocker / 'triton'} (" in failed.stderr
    assert "warning: the folder is prepared; the service compiles the Triton kernels at its first start" in \
        failed.stderr


def test_warm_kernels_runs_rank_1_of_tp_2_alone(lite, tmp_path):
    """At TP 2 each node warms its own rank with the peer not there (the collectives stood in for)."""
    out, cache = tmp_path / "prepared", tmp_path / "triton"
    assert _dsv41("prepare", "--model", str(lite), "--out", str(out), "--device", "cpu", "--tp", "2",
                  "--rank", "1").returncode == 0
    warm = _dsv41("warm-kernels", "--prepared", str(out), "--model", str(lite), "--device", "cpu", "--tp", "2",
                  "--triton-cache-dir", str(cache))
    assert warm.returncode == 0, warm.stderr
    assert f"warm-kernels: skip rank 0: {out / 'rank0-of-2'} is not prepared (run `dsv41 prepare`)" in warm.stderr
    manifest = [line for line in warm.stderr.splitlines() if line.startswith("  start: manifest ")]
    assert len(manifest) == 1 and manifest[0].endswith(f"({out / 'rank1-of-2'})")
    assert "  start: first_token" in warm.stderr


@pytest.mark.gpu
def test_gpu_after_warm_kernels_a_start_compiles_nothing(tiny_model_dir, tmp_path):
    """The EXL3 tiny model on the GPU: prepare (which warms), then warm-kernels again into the same cache adds no
    file: every kernel of the start was compiled by the first (a fresh process's start compiles nothing)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    out, cache = tmp_path / "prepared", tmp_path / "triton"
    prep = _dsv41("prepare", "--model", str(tiny_model_dir), "--out", str(out), "--device", "cuda",
                  "--triton-cache-dir", str(cache), cpu=False)
    assert prep.returncode == 0 and "warning" not in prep.stderr, prep.stderr
    compiled = count_files(cache)
    assert compiled > 0  # the step / prefill kernels are Triton's: the first start compiles them
    again = _dsv41("warm-kernels", "--prepared", str(out), "--model", str(tiny_model_dir), "--device", "cuda",
                   "--triton-cache-dir", str(cache), cpu=False)
    assert again.returncode == 0, again.stderr
    assert f"0 files added to {cache} ({compiled} in all)" in again.stderr
