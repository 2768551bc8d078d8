"""Checkpoint storage: safetensors reading/writing and the four weight formats (native, FP8, MXFP4, EXL3)."""
