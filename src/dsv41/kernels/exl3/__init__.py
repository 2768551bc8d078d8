"""EXL3 kernels: the layout type and its one validator, Triton and CUDA paths, dispatch by phase (kernels/README.md)."""
