"""Shared test fixtures: where the golden data lives and the built-in tiny model."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

# The tiny models are latency-bound: on a 2-core machine shared by test processes (servers, TP ranks), torch's
# intra-op thread pools oversubscribe the cores and small ops take milliseconds instead of microseconds.
# One thread per process, inherited by every subprocess the tests start.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
try:
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
except ImportError:  # pragma: no cover - torch is a hard dependency; keep collection errors readable
    pass

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
FIXTURES = SHARED / "fixtures"
ORACLE = FIXTURES / "oracle-tiny-a"


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The built-in tiny model (EXL3 format), made once per machine under $DSV41_HOME or ~/.cache/dsv41."""
    from dsv41.tiny.model import default_model_dir
    return default_model_dir()


# The longest files on the 2-core CI machine, longest first (measured under two workers, the suite's `make test`
# command with --durations=0: a file's setup + call seconds; 31 min 56 s in all at suite-trim5). Under pytest-xdist
# (--dist loadfile hands out whole files in collection order) they are collected first, so that no worker starts
# one of them while the other is finishing the rest of the suite; a serial run keeps file order.
LONGEST_FILES = (
    "test_exl3_cuda.py",  # nvcc: 5 sm_90 variants, the cubin cache's and GB10's three (~20-35 s of one core each)
    "test_server_sessions.py",  # ~117 s
    "test_tiny_builtin.py",  # the built-in tiny model answering, in process and through the server
    "test_parallel_serve.py",  # TP-2 processes and rank failures
    "test_runtime_fast_dspark.py",  # interpreted child: taps, drafts, three engine runs (~100 s)
    "test_runtime_pool_attention.py",  # interpreted child (~95 s)
    "test_server_tools.py",
    "test_runtime_fast.py",
    "test_tiny_train.py",
    "test_clients_litellm_langchain.py",
    "test_prepared_start.py",
    "test_exl3_prefill_wgmma.py",  # nvcc: two sm_90a images
    "test_model_chunking.py",
    "test_engine_batched.py",
    "test_server_disconnect.py",
    "test_runtime_fast_tp.py",  # interpreted TP-2 parity, 2 ranks
    "test_parallel_rendezvous.py",
    "test_engine_sessions.py",
    "test_parallel_model.py",
    "test_runtime_fast_engine.py",  # interpreted child: the engine over the fast forward (3 layers)
    "test_server_params.py",
    "test_prepared_warm_kernels.py",
    "test_server_deadlines.py",
    "test_server_tokenize_offload.py",
    "test_server_clients_text.py",
)


def _longest_first(items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    # sorted() is stable: the order inside a file, and of the other files, is kept
    items[:] = sorted(items, key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_collection_modifyitems(config, items):
    """GPU tests skip with a printed reason where CUDA is absent (CI, developer machines); under pytest-xdist the
    longest files come first (LONGEST_FILES)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        _longest_first(items)
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - torch missing means no GPU either
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine); none on this host")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def free_port() -> int:
    """A TCP port free on loopback right now (the tests' servers and rendezvous bind it next)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
