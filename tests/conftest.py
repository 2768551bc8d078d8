"""Shared test fixtures: where the golden data lives and the built-in tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
FIXTURES = SHARED / "fixtures"
ORACLE = FIXTURES / "oracle-tiny-a"


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The built-in tiny model (EXL3 format), made once per machine under $DSV41_HOME or ~/.cache/dsv41."""
    from dsv41.tiny import default_model_dir
    return default_model_dir()


def pytest_collection_modifyitems(config, items):
    """GPU tests skip with a printed reason where CUDA is absent (CI, developer machines)."""
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
