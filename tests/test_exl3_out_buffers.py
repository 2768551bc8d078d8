"""The EXL3 launches' `out=` buffers (what lets the decode step write results in place instead of copying them):
the MoE's routed sum into the bucket's rows, a linear into the columns of a wider buffer. Host-side checks: the
launch itself is stubbed, the kernels' results are the tests of test_exl3_kernels.py and the runtime's."""

from __future__ import annotations

import pytest
import torch

from test_exl3_kernels import _zero_layout  # noqa: E402


def test_moe_out_takes_a_matching_contiguous_buffer():
    """The MoE launches' `out=` (the bucket's rows of the routed sum): that tensor itself, or a clear refusal."""
    from dsv41.kernels.exl3.layout import moe_out

    buf = torch.empty(4, 8)
    assert moe_out(buf, 4, 8, torch.float32, "cpu") is buf
    assert moe_out(None, 3, 8, torch.float32, "cpu").shape == (3, 8)
    for bad in (torch.empty(4, 9), torch.empty(4, 8, dtype=torch.bfloat16), torch.empty(8, 4).t()):
        with pytest.raises(ValueError, match="out must be contiguous"):
            moe_out(bad, 4, 8, torch.float32, "cpu")


def test_exl3_linear_out_is_checked_before_any_launch(monkeypatch):
    """`Exl3Linear(..., out=)` on the fused path writes the given tensor's first n rows (a strided column slice
    of a wider buffer included), refuses a wrong shape, and is refused on the prefill path."""
    from dsv41.runtime.layers.linear import Exl3Launch, Exl3Linear, PrefillWorkspace

    runs = []
    monkeypatch.setattr(Exl3Launch, "run", lambda self, x, weight, out: runs.append((x.shape, out)))
    lin = Exl3Linear(_zero_layout(128, 256), PrefillWorkspace("cpu"), "wo_a.0")
    wide = torch.zeros(4, 512)
    got = lin(torch.zeros(4, 128), 2, "decode", out=wide[:, 256:])
    assert got.data_ptr() == wide[:, 256:].data_ptr() and runs[-1][0] == (2, 128)
    assert runs[-1][1].data_ptr() == wide[:, 256:].data_ptr() and runs[-1][1].shape == (2, 256)
    with pytest.raises(ValueError, match="wo_a.0: out must be"):
        lin(torch.zeros(4, 128), 2, "decode", out=torch.zeros(4, 128))
    with pytest.raises(ValueError, match="out= is for the fused path"):
        lin(torch.zeros(4, 128), 2, "prefill", out=torch.zeros(4, 256))
