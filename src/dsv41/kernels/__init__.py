"""GPU kernels: EXL3 (exl3/: layout, backend choice, Triton and CUDA paths) and the CUDA build and launch machinery
(cuda_build, cuda_module). See kernels/README.md for the layout and which path runs where."""
