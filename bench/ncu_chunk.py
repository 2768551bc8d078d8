"""One prefill chunk of the full-shape synthetic rank, for Nsight Compute (issue 31: where the time goes inside the
kernels, not only between them).

The rank's first `--layers` layers are built, a chunk of `--rows` rows is prefilled `--warm` times (every kernel
compiled and autotuned), then once more between `cudaProfilerStart` and `cudaProfilerStop`: run it under
`ncu --profile-from-start off` and only that chunk's kernels are profiled.

    ncu --profile-from-start off --clock-control none --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats --csv --page details python3 bench/ncu_chunk.py --layers 2 --rows 2048 > ncu.csv
    python3 bench/ncu_summary.py ncu.csv            # one line a kernel: time, SM / memory throughput, stalls
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

from decode_step import StubComm  # noqa: E402

from dsv41.runtime.synthetic import synthetic_rank  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--warm", type=int, default=2)
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    model = synthetic_rank(None, rank=0, world=2, device=dev, dtype=torch.bfloat16, comm=StubComm(),
                           layers=args.layers)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.cfg.vocab_size, (args.rows,), generator=g)
    for _ in range(args.warm):
        model.forward([(model.new_state(), ids)], "prefill")
    torch.cuda.synchronize()
    state = model.new_state()
    torch.cuda.profiler.start()
    model.forward([(state, ids)], "prefill")
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"ncu_chunk: {args.rows} rows through {len(model.blocks)} layers profiled", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
