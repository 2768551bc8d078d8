"""Triton's CPU interpreter with a row-wise `tl.dot` (installed by `dsv41.kernels` when TRITON_INTERPRET is set).

Why: the interpreter computes `tl.dot` as one numpy matmul of the whole tile, i.e. a BLAS sgemm, and an sgemm's
summation order for a row may depend on where the row sits in the tile (OpenBLAS's edge kernels: seen on an AMD
EPYC host, where a row's bits moved with its offset in a 16-row tile, and not on another CPU). Our interpreted
tests claim that a row's bits are its own (rows alone == batched == chunked): that must hold on every machine, not
on one CPU's BLAS. Here each row of a float dot is its own matmul of one row ([1, K] @ [K, N]: the same call shape,
hence the same order, for every row wherever it sits), then the accumulator is added as the interpreter does.
Integer dots, bf16 operands (the interpreter keeps bf16 as uint16 words) and anything else keep the interpreter's
own code. Nothing changes on a GPU: the compiled kernels never see this.
"""

from __future__ import annotations

import numpy as np

_MARK = "_dsv41_rowwise"


def install() -> bool:
    """Patch `InterpreterBuilder.create_dot` once (idempotent); False where this Triton has no such builder."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter as it
    except ImportError:  # pragma: no cover - Triton absent: nothing to patch
        return False
    builder = getattr(it, "InterpreterBuilder", None)
    original = getattr(builder, "create_dot", None)
    if original is None:
        return False
    if getattr(original, _MARK, False):
        return True

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        acc = d.data
        floats = (tl.float16, tl.float32, tl.float64)
        fp8 = any(t.dtype.primitive_bitwidth == 8 and t.dtype.is_floating() for t in (a, b))
        if acc.dtype.kind != "f" or not (fp8 or (a.dtype in floats and b.dtype in floats)):
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        a_data, b_data = a.data, b.data
        if fp8:  # as the interpreter does: fp8 operands widened to fp16 first
            a_data = it._convert_float(a_data, a.dtype, tl.float16, None).view(np.float16)
            b_data = it._convert_float(b_data, b.dtype, tl.float16, None).view(np.float16)
        # every row a [1, K] matrix of a stack: numpy's matmul loops over the stack in C, one product of the same
        # shape and strides per row (so one code path and one order for all of them), no Python loop
        rows = np.ascontiguousarray(a_data, dtype=acc.dtype)[..., None, :]
        mats = np.ascontiguousarray(b_data, dtype=acc.dtype)[..., None, :, :]
        out = np.matmul(rows, mats)[..., 0, :]
        return it.TensorHandle(out + acc, d.dtype.scalar)

    setattr(create_dot, _MARK, True)
    builder.create_dot = create_dot
    return True
