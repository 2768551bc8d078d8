"""GPU kernels: EXL3 (exl3/: layout, backend choice, Triton and CUDA paths) and the CUDA build and launch machinery
(cuda_build, cuda_module). See kernels/README.md for the layout and which path runs where."""

import os as _os

if _os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    # a row's bits in the interpreter must not depend on the CPU's BLAS (kernels/interpreter_dot.py)
    from .interpreter_dot import install as _install_rowwise_dot

    _install_rowwise_dot()
    # and without the interpreter's work that no kernel sees (kernels/interpreter_overhead.py): the same bits
    from .interpreter_overhead import install as _install_lean_interpreter

    _install_lean_interpreter()
