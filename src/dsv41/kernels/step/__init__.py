"""Step kernels: per-row Triton kernels for the fast decode step (mHC sites, router, attention), each row-invariant."""
