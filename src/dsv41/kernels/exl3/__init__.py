"""EXL3 kernels: the layout type (checked by the reference's group validator), the backend choice, the Triton and
CUDA paths, dispatch by phase (kernels/README.md)."""
