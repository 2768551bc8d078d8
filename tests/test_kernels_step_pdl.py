"""When the step kernels are programmatic dependent launches (kernels/step/pdl.py): CUDA of compute capability 9.0
and later, outside Triton's interpreter, unless DSV41_PDL=0. The compile tests of the mHC, indexer and compressor
kernels check the instructions themselves (present for sm_90 / sm_121, absent for sm_80)."""

from __future__ import annotations

import pytest
import torch

from dsv41.kernels.step import pdl


@pytest.mark.parametrize("value", ["0", "off", "false", "no", "OFF"])
def test_switch_off(monkeypatch, value):
    monkeypatch.setenv(pdl.ENV, value)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert not pdl.enabled(torch.device("cuda"))
    assert pdl.launch(torch.device("cuda")) == {"PDL": False}


def test_on_by_capability_and_never_in_the_interpreter_or_on_the_cpu(monkeypatch):
    monkeypatch.delenv(pdl.ENV, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    caps = {"cap": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: caps["cap"])
    assert pdl.launch(torch.device("cuda")) == {"PDL": True, "launch_pdl": True}
    caps["cap"] = (12, 1)  # GB10
    assert pdl.enabled(torch.device("cuda"))
    caps["cap"] = (8, 9)  # no griddepcontrol before sm_90
    assert not pdl.enabled(torch.device("cuda"))
    caps["cap"] = (9, 0)
    assert not pdl.enabled(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pdl.launch(torch.device("cuda")) == {"PDL": False}
