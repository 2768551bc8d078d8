"""Host cost of the experts' prefill launches (`prefill_moe`) on layer 0 of the synthetic rank: per call, the host
seconds (no sync), the wall with a sync, and the top host functions under cProfile, for the default tiles and the
wgmma tiles (`DSV41_PREFILL_WGMMA`). `python3 bench/prefill_host_probe.py --rows 2048`."""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--model-layers", type=int, default=0,
                   help="also a whole chunk of `rows` rows through a synthetic rank of this many layers, each way")
    p.add_argument("--sync-report", type=int, default=0, metavar="LAYERS",
                   help="only: the host syncs torch reports in one chunk through this many layers, by call site")
    args = p.parse_args(argv)
    if args.sync_report:
        sync_report(args.rows, args.sync_report)
        return 0
    from dsv41.kernels.exl3.prefill import prefill_moe
    from dsv41.runtime.synthetic import synthetic_rank
    from decode_step import StubComm  # noqa: E402

    dev = torch.device("cuda")
    model = synthetic_rank(None, rank=0, world=2, device=dev, dtype=torch.bfloat16, comm=StubComm(), layers=1)
    s, topk = model.blocks[0].moe.experts, model.blocks[0].moe.topk
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(args.rows, s.w1.k, generator=g, device=dev).bfloat16()
    ids = torch.rand(args.rows, s.w1.experts, generator=g, device=dev).topk(topk, dim=1).indices.int()
    w = torch.rand(args.rows, topk, generator=g, device=dev)
    for wg in (False, True):
        def call():
            return prefill_moe(x, ids, w, s.w1, s.w3, s.w2, wgmma=wg)
        call()
        torch.cuda.synchronize()
        host, wall = [], []
        for _ in range(args.calls):
            t0 = time.perf_counter()
            call()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            host.append(t1 - t0)
            wall.append(time.perf_counter() - t0)
        prof = cProfile.Profile()
        prof.enable()
        call()
        torch.cuda.synchronize()
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(18)
        print(f"wgmma={wg}: host {sorted(host)[len(host) // 2] * 1e3:.2f} ms, wall {sorted(wall)[len(wall) // 2] * 1e3:.2f} ms")
        print(buf.getvalue()[-3500:])
    if args.model_layers:
        del model
        torch.cuda.empty_cache()
        model_chunks(args.rows, args.model_layers)
    return 0


def sync_report(rows: int, layers: int) -> None:
    """One prefill chunk under `torch.cuda.set_sync_debug_mode("warn")`: each synchronizing torch call's innermost
    dsv41 frame (and the one above it), with counts."""
    import collections
    import traceback
    import warnings

    from dsv41.runtime.synthetic import synthetic_rank
    from decode_step import StubComm  # noqa: E402

    dev = torch.device("cuda")
    model = synthetic_rank(None, rank=0, world=2, device=dev, dtype=torch.bfloat16, comm=StubComm(), layers=layers)
    ids = torch.randint(0, model.cfg.vocab_size, (rows,), generator=torch.Generator().manual_seed(0))
    model.forward([(model.new_state(), ids)], "prefill")
    torch.cuda.synchronize()
    sites = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack() if "/dsv41/" in f.filename]
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}({f.name})" for f in frames[-2:][::-1])
        sites[f"{str(message)[:60]} @ {where or f'{filename}:{lineno}'}"] += 1

    old = warnings.showwarning
    warnings.showwarning = record
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            model.forward([(model.new_state(), ids)], "prefill")
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = old
    torch.cuda.synchronize()
    print(f"host syncs in one {rows}-row chunk through {layers} layers: {sum(sites.values())}")
    for site, n in sites.most_common():
        print(f"{n:5d}  {site}")


def model_chunks(rows: int, layers: int) -> None:
    """A chunk of `rows` rows through `layers` layers, the wgmma switch off and on (read at each launch): the wall
    of a few chunks each way and cProfile's top host functions of one."""
    import os

    from dsv41.runtime.synthetic import synthetic_rank
    from decode_step import StubComm  # noqa: E402

    dev = torch.device("cuda")
    model = synthetic_rank(None, rank=0, world=2, device=dev, dtype=torch.bfloat16, comm=StubComm(), layers=layers)
    ids = torch.randint(0, model.cfg.vocab_size, (rows,), generator=torch.Generator().manual_seed(0))
    for flag in ("0", "1", "0", "1"):
        os.environ["DSV41_PREFILL_WGMMA"] = flag
        model.forward([(model.new_state(), ids)], "prefill")
        torch.cuda.synchronize()
        walls = []
        for _ in range(3):
            t0 = time.perf_counter()
            model.forward([(model.new_state(), ids)], "prefill")
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t0)
        prof = cProfile.Profile()
        prof.enable()
        model.forward([(model.new_state(), ids)], "prefill")
        torch.cuda.synchronize()
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(14)
        print(f"model {layers} layers, {rows} rows, DSV41_PREFILL_WGMMA={flag}: walls "
              f"{', '.join(f'{w * 1e3:.0f}' for w in walls)} ms")
        print(buf.getvalue()[-3000:])


if __name__ == "__main__":
    sys.exit(main())
