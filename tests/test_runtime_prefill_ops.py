"""Every floating-point reduction of a fast-path prefill chunk runs in a kernel of ours (issue 31 item 6, issue 34).

Chunked == one-shot and resumed == fresh hold only if no row's bits depend on the chunk's length. Our kernels keep
one order per row (the EXL3 tiles, the router's and index scores' tiles, the row ops, the attention core); a torch
reduction on CUDA does not: its launch config follows the tensor's shape (torch's CUDA `mean` splits a row's sum over
more threads when there are fewer rows; cuBLAS picks split-K by the row count). Such an op passes every CPU test and
the 2K-vs-4K GPU test (two large shapes take the same config), and breaks a session's cut at S (a 1- or 3-row
chunk): the ratio-1 compressor's latent norm did.

So the prefill forward of the slimmed tiny model (every layer role), the step kernels in Triton's interpreter, runs
under a dispatch logger, and the float reductions torch runs are listed with the code that asked for them. Allowed:
order-free ones (max, min, sort; integer sums and counts) and DequantLinear's CPU branch (on CUDA its prefill rows
take the tile product, `test_gpu_prefill_native_linear_rows_alone`). The interpreter must be set before Triton
decorates the kernels, so the forward runs in a child process (this file as a script) that reports JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ORDERED = {"sum", "mean", "softmax", "_softmax", "_log_softmax", "log_softmax", "var", "var_mean", "std", "norm",
           "linalg_vector_norm", "mm", "bmm", "addmm", "matmul", "baddbmm", "addmv", "mv", "dot", "cumsum", "cumprod",
           "logsumexp", "prod", "index_add", "index_add_", "scatter_add", "scatter_add_", "scatter_reduce",
           "_scaled_mm", "einsum", "nansum", "sum_to_size"}
CPU_BRANCHES = {("linear.py", "__call__")}  # DequantLinear: `x @ W.T` on the CPU only


def _reductions(model_dir: str) -> dict:
    import traceback

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from dsv41.runtime.build import build_fast_model

    class Log(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            floats = any(isinstance(a, torch.Tensor) and a.is_floating_point() for a in args)
            if name in ORDERED and floats:
                ours = [f for f in traceback.extract_stack() if "/dsv41/" in f.filename]
                site = f"{Path(ours[-1].filename).name}:{ours[-1].name}" if ours else "?"
                chain = " < ".join(f"{Path(f.filename).name}:{f.lineno}" for f in ours[-4:][::-1])
                key = f"{name} at {site} ({chain})"
                self.seen[key] = self.seen.get(key, 0) + 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = build_fast_model(model_dir, "cpu", torch.float32)
    ids = torch.tensor([0] + [(i * 37) % 500 + 5 for i in range(20)])
    st = model.new_state()
    model.forward([(st, ids[:12])], "prefill", logits="all")  # entries and open groups before the chunk
    log = Log()
    with log:  # 21 positions: a rolled window (16) and more ratio-2 entries (10) than the index keeps (8)
        model.forward([(st, ids[12:])], "prefill", logits="all")
    return log.seen


def test_prefill_reductions_all_run_in_row_invariant_kernels(tmp_path):
    from dsv41.tiny.model import make_tiny
    from test_runtime_fast import LITE

    model_dir = make_tiny(tmp_path / "model", "exl3", seed=0, overrides=LITE)
    out = tmp_path / "ops.json"
    paths = [str(Path(__file__).resolve().parents[1] / "src"), str(Path(__file__).parent),
             os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(paths))
    proc = subprocess.run([sys.executable, __file__, str(model_dir), str(out)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(out.read_text())
    assert any(" at linear.py:__call__" in k for k in seen), f"the logger saw nothing it should: {seen}"
    stray = {k: v for k, v in seen.items()
             if not any(f" at {f}:{fn} " in k for f, fn in CPU_BRANCHES)}
    assert not stray, f"float reductions outside our kernels in a prefill chunk: {stray}"


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    Path(sys.argv[2]).write_text(json.dumps(_reductions(sys.argv[1])))
