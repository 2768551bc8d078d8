"""The prefill index scores' launch shapes (`kernels/step/index_tiles.py` TILES, `DSV41_INDEX_TILE`) at a long
prompt's late chunk: `--rows` rows of one sequence against `--entries` index keys (32 heads x 128, FP4-fake-quantised
values, every row seeing every entry), ms, TFLOP/s and each shape's bits against the default.

    python3 bench/index_tiles_ab.py --rows 2048 --entries 32768 --out bench/results/index_tiles_ab.json
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


def main(argv=None) -> int:
    from prefill_kernels import cuda_ms

    from dsv41.kernels.step.index_tiles import DEFAULT_TILE, TILES, index_scores_tiles
    from dsv41.model.quant import fp4_block_ue8m0

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--entries", type=int, default=32768)
    p.add_argument("--out", type=Path, default=HERE / "results" / "index_tiles_ab.json")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    R, C, H, hd = args.rows, args.entries, 32, 128
    q = fp4_block_ue8m0(torch.randn(R, H, hd, generator=g, device=dev), 32, True).bfloat16()
    k = fp4_block_ue8m0(torch.randn(C, hd, generator=g, device=dev), 32, True).bfloat16()
    w = torch.randn(R, H, generator=g, device=dev).bfloat16()
    n_vis = torch.full((R,), C, device=dev, dtype=torch.int32)
    out = torch.empty(R, C, dtype=torch.float32, device=dev)
    flops = 2.0 * R * H * hd * C
    res = {"commit": os.environ.get("BENCH_COMMIT", "unknown"), "gpu": torch.cuda.get_device_name(), "rows": R,
           "entries": C, "tiles": {}}
    base = index_scores_tiles(q, w, k, n_vis, C, tile=DEFAULT_TILE).clone()
    for name in TILES:
        ms = cuda_ms(lambda: index_scores_tiles(q, w, k, n_vis, C, out=out, tile=name), reps=5)
        same = bool(torch.equal(out.view(torch.int32), base.view(torch.int32)))
        res["tiles"][name] = {"ms": ms, "tflops": flops / ms / 1e9, "same_bits_as_default": same}
        print(f"index scores {R} x {C}: {name} {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s), same bits {same}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
