"""The experts' prefill tiles under several compile-time tunings of the wgmma kernel (`DSV41_EXL3_TUNING`: e.g.
EXL3_WG_PREFETCH, EXL3_WG_RELAXED, EXL3_WG_MIN_BLOCKS), one child process per tuning (the tuning is read at
import), layer 0's routed experts of the synthetic rank at each row count with a skewed routing: ms, TFLOP/s, and
every tuning's output bits against the first tuning's (the same products in the same order: they must be equal).
The first tuning also times the portable 128-row tiles (`r128`) for reference.

    python3 bench/prefill_tiles_ab.py --rows 2048,8192 --tuning '{}' --tuning '{"EXL3_WG_PREFETCH": 1}' \
        --out bench/results/prefill_tiles_ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def child(rows_list: list[int], first: bool, out_dir: Path) -> dict:
    import torch

    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parent / "src"))
    from decode_step import StubComm
    from prefill_kernels import _routing, cuda_ms

    from dsv41.kernels.exl3.prefill import prefill_moe
    from dsv41.runtime.synthetic import synthetic_rank

    dev = torch.device("cuda")
    model = synthetic_rank(None, rank=0, world=2, device=dev, dtype=torch.bfloat16, comm=StubComm(), layers=1)
    s, topk = model.blocks[0].moe.experts, model.blocks[0].moe.topk
    res = {}
    for rows in rows_list:
        g = torch.Generator(device=dev).manual_seed(rows)
        x = torch.randn(rows, s.w1.k, generator=g, device=dev).bfloat16()
        ids = _routing(rows, s.w1.experts, topk, 0.8, g)
        w = torch.rand(rows, topk, generator=g, device=dev)
        flops = 2.0 * rows * topk * (2 * s.w1.k * s.w1.n + s.w2.k * s.w2.n)
        r = {}
        for name, kw in ([("r128", {"tile_rows": 128, "wgmma": False})] if first else []) + [("wg", {"wgmma": True})]:
            ms = cuda_ms(lambda: prefill_moe(x, ids, w, s.w1, s.w3, s.w2, columns_first=True, **kw), reps=5)
            r[name] = {"ms": ms, "tflops": flops / ms / 1e9}
            y = prefill_moe(x, ids, w, s.w1, s.w3, s.w2, columns_first=True, **kw)
            torch.save(y.cpu(), out_dir / f"{name}_{rows}.pt")
        res[str(rows)] = r
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="2048,8192")
    p.add_argument("--tuning", action="append", default=[], help="JSON overrides (repeatable; the first: the base)")
    p.add_argument("--out", type=Path, default=HERE / "results" / "prefill_tiles_ab.json")
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--first", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    rows = [int(v) for v in args.rows.split(",") if v]
    if args.child:
        print("CHILD " + json.dumps(child(rows, args.first, args.child)))
        return 0
    import torch

    tunings = args.tuning or ["{}"]
    res = {"commit": os.environ.get("BENCH_COMMIT", "unknown"), "rows": rows, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i, t in enumerate(tunings):
            folder = Path(tmp) / str(i)
            folder.mkdir()
            env = {**os.environ, "DSV41_EXL3_TUNING": t} if t != "{}" else dict(os.environ)
            proc = subprocess.run([sys.executable, __file__, "--rows", args.rows, "--child", str(folder)]
                                  + (["--first"] if i == 0 else []), env=env, capture_output=True, text=True)
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("CHILD ")]
            if proc.returncode != 0 or not line:
                res["runs"].append({"tuning": t, "error": proc.stderr[-2000:]})
                print(f"tuning {t}: FAILED\n{proc.stderr[-2000:]}")
                continue
            run = {"tuning": t, **json.loads(line[0][6:])}
            for n in rows:
                y = torch.load(folder / f"wg_{n}.pt")
                base = torch.load(Path(tmp) / "0" / f"wg_{n}.pt")
                run[str(n)]["wg"]["same_bits_as_first"] = bool(torch.equal(y.view(torch.int32), base.view(torch.int32)))
                if i == 0:
                    r128 = torch.load(folder / f"r128_{n}.pt")
                    run[str(n)]["wg"]["same_bits_as_r128"] = bool(torch.equal(y.view(torch.int32),
                                                                              r128.view(torch.int32)))
            res["runs"].append(run)
            print(f"tuning {t}: " + "; ".join(
                f"{n} rows " + ", ".join(f"{k} {v['ms']:.2f} ms ({v['tflops']:.0f} TFLOP/s)" for k, v in run[str(n)].items())
                + f", bits {run[str(n)]['wg']}" for n in rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
