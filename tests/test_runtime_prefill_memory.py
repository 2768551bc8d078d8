"""The memory kept free for the longest prefill chunk (runtime/prefill_memory.py): the line through two measured
chunks, the late index scores from their shape, and on the GPU a measured chunk of the full length within the
reserve."""

from __future__ import annotations

import pytest
import torch

from dsv41.runtime.prefill_memory import extend, index_scores_bytes


def test_the_line_through_two_chunks_extends_to_the_longest_and_never_falls_below_a_sample():
    assert extend([(256, 1_000), (1024, 4_000)], 8192) == 4_000 + 7168 * 3_000 // 768
    assert extend([(1024, 4_000), (256, 1_000)], 8192) == extend([(256, 1_000), (1024, 4_000)], 8192)
    assert extend([(256, 5_000), (1024, 4_000)], 8192) == 5_000  # a falling line keeps the larger sample
    assert extend([(256, 1_000), (1024, 4_000)], 512) == 4_000  # a chunk inside the samples: the larger one
    with pytest.raises(ValueError, match="two different row counts"):
        extend([(256, 1), (256, 2)], 8192)


def test_the_late_index_scores_are_a_launch_of_rows_by_the_smallest_ratio_s_entries():
    class Cfg:
        compress_ratios = (0, 0, 4, 128, 4, 2)

    assert index_scores_bytes(Cfg, 131072) == 1024 * 65536 * 4  # 256 MiB, docs/perf/prefill.md's figure
    Cfg.compress_ratios = (0, 0)
    assert index_scores_bytes(Cfg, 131072) == 0


@pytest.mark.gpu
def test_gpu_a_full_length_chunk_fits_in_the_reserve():
    """The full-shape rank's first 4 layers: the reserve found from 256 and 1,024 rows covers a measured chunk of
    8,192 rows at position 0 (the late index scores ride on top)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (the full-shape synthetic rank)")
    from dsv41.runtime.prefill_memory import index_scores_bytes as scores, measure, prefill_reserve
    from dsv41.runtime.synthetic import synthetic_rank
    from test_runtime_prefill_chunks import _HalfOfTwo

    model = synthetic_rank(None, rank=0, world=2, device="cuda", dtype=torch.bfloat16, comm=_HalfOfTwo(), layers=4)
    reserve, note = prefill_reserve(model, 8192, 131072)
    print(note)
    used = measure(model, 8192)
    print(f"8,192 rows: {used / 2 ** 30:.2f} GiB measured, {reserve / 2 ** 30:.2f} GiB reserved")
    assert used <= reserve - scores(model.cfg, 131072)
