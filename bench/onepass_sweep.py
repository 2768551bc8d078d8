"""The prefill attention core's one-pass launch (`kernels/step/prefill_core.py`) over the tilings of
`prefill_kernels.ONEPASS_SWEEP` (head block, key block, warps, stages, raw keys, the softmax weights' bf16 parts
`pv_parts`) at the full shape (32 local heads of 512, window 128 + top-512 slots over 8,192 FP4 entries): ms a
launch and each tiling's rel L2 to the first (the exact 3-part one; other key blocks and parts round otherwise), plus
the first tiling's and the 2-part tiling's rel L2 to an fp64 reference on 64 rows.

    python3 bench/onepass_sweep.py --rows 2048,8192 --out bench/results/onepass_sweep.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))


def reference_rows(q, win, ents, slots, sink, scale, rows: int = 64) -> torch.Tensor:
    """o of the first `rows` rows in fp64: softmax over the live slots and the sink, the slots' keys as values."""
    keys = torch.cat((win, ents)).double()
    out = torch.zeros(rows, q.shape[1], q.shape[2], dtype=torch.float64, device=q.device)
    for t in range(rows):
        idx = slots[t][slots[t] >= 0].long()
        k = keys[idx]
        s = torch.einsum("hd,sd->hs", q[t].double(), k) * scale
        s = torch.cat((s, sink.double()[:, None]), dim=1)
        p = torch.softmax(s, dim=1)[:, :-1]
        out[t] = p @ k
    return out


def main(argv=None) -> int:
    from decode_step import StubComm
    from prefill_kernels import onepass_tilings

    from dsv41.runtime.synthetic import synthetic_rank

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="2048,8192")
    p.add_argument("--out", type=Path, default=HERE / "results" / "onepass_sweep.json")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    model = synthetic_rank(None, rank=0, world=2, device=dev, dtype=torch.bfloat16, comm=StubComm(), layers=1)
    attn = model.blocks[0].attn
    rows = [int(v) for v in args.rows.split(",") if v]
    seen = {}
    res = {"commit": os.environ.get("BENCH_COMMIT", "unknown"), "gpu": torch.cuda.get_device_name(),
           "tilings": onepass_tilings(attn, rows, keep=seen)}
    if seen:  # the reference on the first rows of the first row count's inputs
        q, win, kv, slots, sink, scale, outs = seen[rows[0]]
        ref = reference_rows(q, win, kv, slots, sink, scale)
        res["to_reference"] = {name: float((o[:64].double() - ref).norm() / ref.norm()) for name, o in outs.items()}
        print("rel L2 to an fp64 reference, 64 rows:", res["to_reference"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
