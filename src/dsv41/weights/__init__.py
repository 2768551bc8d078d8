"""Checkpoint storage: safetensors reading/writing and the four weight formats (native, FP8, MXFP4, EXL3)."""

from dsv41.weights.linear import Linear, split_sizes
from dsv41.weights.safetensors_io import Checkpoint
from dsv41.weights.writer import ShardedWriter, write_linear

__all__ = ["Checkpoint", "Linear", "ShardedWriter", "split_sizes", "write_linear"]
