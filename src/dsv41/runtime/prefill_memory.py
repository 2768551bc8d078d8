"""The device memory a prefill chunk takes beyond the weights and the KV pool, measured at start (issue 31).

A chunk's transients (the experts' rotated inputs and slot outputs, the residual streams, q, the attention core's
split scratch, the index scores) grow with its rows: ~1.5 GB at 2,048 rows, ~4-5 GB at 8,192 on a full-shape rank.
The pool is sized from the memory left after them, so the longest chunk the scheduler may run (`--prefill-chunk`
or, with no stream decoding, `--prefill-chunk-alone`) must never find the memory taken by pages.

Measured rather than derived from shapes: two short prefills on a throwaway state (256 and 1,024 rows), each
peak above the memory allocated before it, a line through the two extended to the chunk. Every piece is linear in
the rows or bounded (the core's scratch by its 2,048-row launches), so the line does not fall short; the index
scores of a late chunk (1,024 rows a launch x the entries at the longest context) are added from their shape, as
a fresh state has few entries. CUDA only: the CPU's memory is the host's and its chunks run the interpreter.

Not a chunk's transient: the rank's one dense workspace (`layers.linear.PrefillWorkspace`, fp16, sized for the
largest matrix, wq_b's 1280 x 16384 = 42 MB on a full-shape rank), which the dense projections' decode-once GEMM
(`DSV41_PREFILL_DENSE_GEMM=1`) and the reconstruct path decode into. It is allocated with the weights when either is
on at build (`prefill_workspace_needed`), so it is in the memory before the probes, whatever the chunk's rows.
"""

from __future__ import annotations

import torch

PROBE_ROWS = (256, 1024)
MARGIN = 1.1  # the allocator's rounding and the fragmentation between two measured runs


def extend(samples: list[tuple[int, int]], rows: int) -> int:
    """The bytes of a `rows`-row chunk on the line through two (rows, peak bytes) samples; never below either."""
    (r0, b0), (r1, b1) = sorted(samples)
    if r1 == r0:
        raise ValueError("two different row counts are needed")
    slope = max(0.0, (b1 - b0) / (r1 - r0))
    return int(max(b0, b1, b1 + slope * (rows - r1)))


def index_scores_bytes(cfg, max_len: int) -> int:
    """The index scores of one launch at the longest context: INDEX_ROWS rows x the entries of the smallest ratio."""
    from .layers.attention_index import INDEX_ROWS

    ratios = [r for r in cfg.compress_ratios if r > 0]
    return 0 if not ratios else INDEX_ROWS * -(-max_len // min(ratios)) * 4


def measure(model, rows: int) -> int:
    """The peak bytes one `rows`-row prefill on a fresh state allocates above what was allocated before it."""
    dev = model.device
    ids = torch.randint(0, model.cfg.vocab_size, (rows,), generator=torch.Generator().manual_seed(rows))
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    model.forward([(model.new_state(), ids)], "prefill")
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base
    torch.cuda.empty_cache()
    return int(peak)


def prefill_reserve(model, chunk: int, max_len: int) -> tuple[int, str]:
    """(bytes to keep free for a `chunk`-row prefill on CUDA, a log line saying how they were found)."""
    samples = [(r, measure(model, r)) for r in PROBE_ROWS]
    scores = index_scores_bytes(model.cfg, max_len)
    need = int(extend(samples, chunk) * MARGIN) + scores
    gib = 2 ** 30
    seen = ", ".join(f"{r} rows {b / gib:.2f} GiB" for r, b in samples)
    return need, (f"dsv41 engine: {need / gib:.2f} GiB kept free for a {chunk}-row prefill chunk (measured {seen}; "
                  f"+ late index scores {scores / gib:.2f} GiB)")
