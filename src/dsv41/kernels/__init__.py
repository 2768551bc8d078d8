"""Triton kernels (EXL3 decode/matmul/MoE). See kernels/README.md for the layout and which path runs where."""
