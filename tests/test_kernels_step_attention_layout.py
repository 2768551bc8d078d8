"""The attention split's products take one operand layout in every variant that must give the same bits (no GPU:
Triton's ahead-of-time compile for sm_90 and GB10's sm_121).

On the tensor cores the order in which a dot sums its K products follows the operands' register layout (Triton's
`kWidth` of the dot operands). Triton picks it from the loads that make an operand, through elementwise ops only:
keys decoded from FP8 / FP4 bytes and the gathered core's keys (its live mask an 8-bit load) get kWidth 4; keys
that come out of a branch (`if` in the block loop) or from bf16 loads alone get 2 — and on the H200 those gave
other last bits than the gathered core (the first one-store blocks, 26c3a37; raw bf16 pool rows). So the pool's
paths at the release's quantisers, the one-store loops (DSV41_ATTN_ALIGNED) included, must compile to the
gathered core's layout; raw bf16 rows are the known exception (held within fp32 rounding on the GPU)."""

from __future__ import annotations

import re

import pytest

_PTRS = {"q_ptr": "*bf16", "k_ptr": "*bf16", "ok_ptr": "*u8", "sink_ptr": "*fp32", "m_ptr": "*fp32",
         "l_ptr": "*fp32", "acc_ptr": "*fp32", "w_ptr": "*u8", "slot_ptr": "*i32", "pos_ptr": "*i64", "e_ptr": "*u8",
         "pages_ptr": "*i32", "ids_ptr": "*i64", "out_ptr": "*fp32", "count_ptr": "*i32"}
# the decode tiling (DECODE_SPLIT_KEYS / KEY_BLOCK blocks a split), bf16 queries, keys holding bf16 values
_SHAPE = dict(HB=16, BS=16, BLOCKS=2, HDP=512, QP=1, KP=1, FOLD=False)
# every constexpr of the kernel is given (one left out would compile as a runtime argument: both sides of its `if`)
_DEFAULTS = dict(POOL=False, WCODEC=0, ECODEC=-1, ALIGNED=False, INDEXED=False)
# the prefill tiling (runtime/layers/attention.py PREFILL_TILING: 32 heads a program, 64-key blocks, 128-key splits)
_PREFILL = dict(HB=32, BS=64, BLOCKS=2, HDP=512, QP=1, KP=1, FOLD=False)
# the indexed variant's pointers: the int32 slot index where ok is, window rows and entries of one dtype
_INDEXED_PTRS = {**_PTRS, "ok_ptr": "*i32", "e_ptr": "*bf16"}


def _dot_layouts(arch: int, shape: dict = _SHAPE, ptrs: dict = _PTRS, num_warps: int | None = None,
                 **variant) -> set[str]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dsv41.kernels.step import attention as A

    fn = A._core_split_kernel
    const = {**shape, **_DEFAULTS, **variant, "PDL": arch >= 90}
    missing = {a for a, p in zip(fn.arg_names, fn.params) if p.is_constexpr} - set(const)
    assert not missing, f"constexprs not given: {missing}"
    sig = {a: "constexpr" if a in const else ptrs.get(a, "fp32" if a == "scale" else "i32") for a in fn.arg_names}
    try:
        compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const),
                                  target=GPUTarget("cuda", arch, 32),
                                  options=dict(num_warps=num_warps or A.DECODE_WARPS, enable_fp_fusion=False))
    except RuntimeError as exc:  # no ptxas for this target in this Triton
        pytest.skip(f"Triton cannot compile for sm_{arch} here: {exc}")
    layouts = set(re.findall(r"kWidth = ([0-9]+)|(nvidia_mma<[^>]*>)", compiled.asm["ttgir"]))
    assert layouts, "no dot operand layout in the TTGIR (the products did not compile to tensor-core dots)"
    return layouts


@pytest.mark.parametrize("arch", [90, 121])
def test_pool_paths_compile_to_the_gathered_cores_product_layout(arch):
    from triton.runtime.jit import JITFunction

    from dsv41.kernels.step import attention as A
    from dsv41.kernels.step.codecs import FP4_E4M3 as fp4, FP8_UE8M0 as fp8  # window rows, compressed entries

    if not isinstance(A._core_split_kernel, JITFunction):
        pytest.skip("kernels decorated for the interpreter in this process")
    core = _dot_layouts(arch, POOL=False)
    for name, variant in {"pool": dict(POOL=True, WCODEC=fp8, ECODEC=fp4),
                          "pool, one-store loops": dict(POOL=True, WCODEC=fp8, ECODEC=fp4, ALIGNED=True),
                          "window only": dict(POOL=True, WCODEC=fp8, ECODEC=-1)}.items():
        assert _dot_layouts(arch, **variant) == core, name


@pytest.mark.parametrize("arch", [90, 121])
def test_indexed_prefill_core_compiles_to_the_gathered_cores_product_layout(arch):
    """The indexed core of prefill rows (INDEXED: keys read through an int32 slot index, its live flag the index's
    sign byte as an 8-bit load) at the prefill tiling: the gathered core's kWidth and MMA layout (an int32 and bf16
    loads alone would give kWidth 2: other bits)."""
    from triton.runtime.jit import JITFunction

    from dsv41.kernels.step import attention as A

    if not isinstance(A._core_split_kernel, JITFunction):
        pytest.skip("kernels decorated for the interpreter in this process")
    core = _dot_layouts(arch, _PREFILL, num_warps=8)
    assert ("4", "") in core, core
    assert _dot_layouts(arch, _PREFILL, _INDEXED_PTRS, 8, INDEXED=True) == core


def test_decode_tiling_candidate_compiles_to_the_gathered_cores_product_layout():
    """bench/attention_decode_sweep.py's leading candidate (DSV41_DECODE_CORE_TILING=16,16,4 with the one-store
    blocks: one key block a split): the pool at the release's quantisers compiles to the gathered core's layout at
    the same tiling, the condition for pool == gathered on the GPU (test_kernels_step_attention_tiling.py's GPU
    test checks the bits). sm_90 only: the layout rule is the same for sm_121 (the test above)."""
    from triton.runtime.jit import JITFunction

    from dsv41.kernels.step import attention as A
    from dsv41.kernels.step.codecs import FP4_E4M3 as fp4, FP8_UE8M0 as fp8

    if not isinstance(A._core_split_kernel, JITFunction):
        pytest.skip("kernels decorated for the interpreter in this process")
    shape = dict(_SHAPE, BLOCKS=1)
    core = _dot_layouts(90, shape, num_warps=4)
    assert ("4", "") in core, core
    assert _dot_layouts(90, shape, num_warps=4, POOL=True, WCODEC=fp8, ECODEC=fp4, ALIGNED=True) == core
