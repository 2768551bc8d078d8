"""The prefill attention core's switches and shapes (`FastAttention._core_blocked` / `_core_indexed` read them):
which core prefill rows take (gathered, indexed split + combine, indexed one-pass) and the split cores' tilings."""

from __future__ import annotations

# Rows of one prefill sequence per core launch: bounds the block's gathered key slots [rows, S, hd] (S = window +
# index top-k = 128 + 512 at full shape, hd 512: 160 MiB in bf16 at 256 rows) and the kernel's split scratch
# (5 splits x local heads x hd fp32 per row: 80 MiB at 32 heads, 160 MiB at 64). Any value gives the same bits (one
# program per row, `_core_blocked`).
PREFILL_CORE_ROWS = 256
# The core's tiling for prefill rows (bench/results/attention_prefill_sweep.json, H100, 256 rows x 32 heads x 640
# slots: 814 -> 401 us against the decode-era 16 heads x 16 keys): all 32 local heads per program (the keys read
# once per row), 64-key blocks, 128-slot splits. Fixed for the phase, so a row's bits never follow the chunk.
PREFILL_TILING = dict(head_block=32, key_block=64, split_keys=128, num_warps=8)
# The indexed core (`FastAttention._core_indexed`, the default): rows of one prefill segment per launch. Only the
# split scratch grows with it (rows x 5 splits x local heads x hd fp32: 671 MB at 2,048 rows and 32 heads, 1.3 GB at
# 64), so a 2,048-row chunk is one launch a segment and a longer one stays bounded. Any value gives the same bits.
PREFILL_INDEXED_ROWS = 2048
# 0 / off: prefill rows take the gathered core (each block's slots copied out of cat(window, entries) first) instead
# of the indexed one (the slots read in place through an int32 index); the same bits (A/B runs, a fallback)
INDEXED_ENV = "DSV41_PREFILL_CORE_INDEXED"
# on (the default) / 0: the indexed core in one pass (`kernels.step.prefill_core`: one program per row and head block
# over all the slots, no key splits, no scratch, no combine; within fp32 rounding of the split core, not its bits).
# Only with the indexed core (it reads the slot index).
ONEPASS_ENV = "DSV41_PREFILL_CORE_ONEPASS"


def indexed_core_enabled() -> bool:
    """Whether prefill rows take the indexed core (`INDEXED_ENV`, on unless set to an off spelling); read at each
    call, so an A/B run needs no restart."""
    from dsv41.kernels.step.knobs import switched_on

    return switched_on(INDEXED_ENV)


def onepass_core_enabled() -> bool:
    """Whether the indexed core runs in one pass (`ONEPASS_ENV`; on unless set to an off spelling, since its H100 A/B
    at b4c0e7f: one layer's core at 2,048 rows 1.93 -> 1.18 ms, 8,192 rows 7.52 -> 4.22; 8K / 32K prompts 9,699 ->
    10,787 tok/s at 26 layers; its GPU tests and chunked == one-shot passed); read at each call."""
    from dsv41.kernels.step.knobs import switched_on

    return switched_on(ONEPASS_ENV)
