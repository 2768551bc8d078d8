"""Where chunked prefill first departs from a longer chunk, and what longer chunks cost (issue 31 follow-up).

Part 1: a 16K prompt into the first `--layers` layers of the full-shape synthetic rank in 2K chunks (or `--cuts`)
and in 4K chunks, the traces of layers 0..`--upto` kept (router ids, index ids, each layer's output streams) and
compared row by row: prints the first (layer, what, row) whose bits differ. Part 2: a 32K prompt's seconds at chunk lengths 2K, 4K, 8K.

    python bench/prefill_chunks_probe.py --layers 21 --upto 3
    python bench/prefill_chunks_probe.py --layers 21 --upto 20 --cuts 2047,1,3,2045,2048 --no-timing
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE.parent / "tests"))

from test_runtime_prefill_chunks import _HalfOfTwo, _bits  # noqa: E402

from dsv41.runtime.synthetic import synthetic_rank  # noqa: E402

KEEP = ("router_ids", "index_ids", "streams_out")


def run(model, ids, chunk, upto):
    """`chunk`: one length, or a list of lengths in order with the last repeated (a resumed session's odd cuts)."""
    cuts = chunk if isinstance(chunk, list) else [chunk]
    st, rows, a, i = model.new_state(), {}, 0, 0
    while a < ids.numel():
        n = min(cuts[min(i, len(cuts) - 1)], ids.numel() - a)
        tr = {}
        model.forward([(st, ids[a:a + n])], "prefill", logits="last", trace=tr)
        a, i = a + n, i + 1
        for L in range(upto + 1):
            for d in tr.get(L, []):
                for key in KEEP:
                    v = d.get(key)
                    if isinstance(v, list):
                        v = torch.cat([x for x in v if x is not None]) if any(x is not None for x in v) else None
                    if torch.is_tensor(v):
                        rows.setdefault((L, key), []).append(v.detach().clone())
        del tr
    return {k: torch.cat(v) for k, v in rows.items()}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=21)
    p.add_argument("--upto", type=int, default=3)
    p.add_argument("--prompt", type=int, default=16384)
    p.add_argument("--cuts", default="2048", help="chunk lengths against 4K chunks, the last repeated: e.g. "
                   "2047,1,3,2045,2048 (a resumed session's cut inside a ratio-2 group)")
    p.add_argument("--no-timing", action="store_true", help="skip part 2 (the chunk lengths' seconds)")
    a = p.parse_args()
    model = synthetic_rank(None, rank=0, world=2, device="cuda", dtype=torch.bfloat16, comm=_HalfOfTwo(),
                           layers=a.layers)
    ids = torch.randint(0, model.cfg.vocab_size, (a.prompt,), generator=torch.Generator().manual_seed(16))
    r2, r4 = run(model, ids, [int(c) for c in a.cuts.split(",")], a.upto), run(model, ids, 4096, a.upto)
    for key in sorted(r2, key=lambda k: (k[0], KEEP.index(k[1]))):
        x, y = r2[key], r4.get(key)
        if y is None or x.shape != y.shape:
            print(key, "shapes", tuple(x.shape), None if y is None else tuple(y.shape))
            continue
        d = (_bits(x) != _bits(y)).reshape(x.shape[0], -1).any(dim=1).nonzero().flatten()
        print(key, tuple(x.shape), "rows differ", d.numel(), "first", int(d[0]) if d.numel() else "-", flush=True)
    del r2, r4
    if a.no_timing:
        return 0
    ids = torch.randint(0, model.cfg.vocab_size, (32768,), generator=torch.Generator().manual_seed(3))
    for chunk in (2048, 4096, 8192):
        st = model.new_state()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()  # each chunk length's own peak (part 1's tensors are freed above)
        t0 = time.perf_counter()
        for s in range(0, ids.numel(), chunk):
            model.forward([(st, ids[s:s + chunk])], "prefill")
        torch.cuda.synchronize()
        sec = time.perf_counter() - t0
        print(f"32K prompt in {chunk}-row chunks, {a.layers} layers: {sec:.2f} s, {ids.numel() / sec:.0f} tok/s, "
              f"peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
