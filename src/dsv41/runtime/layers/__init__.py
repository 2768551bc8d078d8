"""The fast path's layers: packed linears (EXL3, FP8, MXFP4, native), the fused MoE, attention over batched rows."""
