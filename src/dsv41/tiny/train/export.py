"""Write the trained weights as a checkpoint folder the loader reads, in the release's FP8 layout.

The folder is the skeleton's config.json and tokenizer plus every tensor of the layout, stored as the skeleton
stores it (FP8 32x32 blocks, MXFP4 routed experts, FP8 Engram rows, bf16 natives, fp32 mHC / sinks / router
biases) with weights/writer.py and the Engram row quantiser. Training already computed with these roundings
(quant.py), so the export reads back exactly the trainer's effective weights. `training.json` records how the
weights were made. Written beside the target and renamed into place, as make-tiny does.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dsv41.engram.shards import quantize_rows_fp8
from dsv41.tiny.model import write_folder_atomically
from dsv41.weights.writer import ShardedWriter, write_linear

from .layout import BF16, FP8, FP32, MXFP4, ROWS_FP8, copy_skeleton_files
from .net import TinyNet

MAX_SHARD_BYTES = 8 * 1024**2


def export_checkpoint(net: TinyNet, skeleton: str | Path, out_dir: str | Path, info: dict | None = None) -> Path:
    def fill(tmp: Path) -> None:
        copy_skeleton_files(skeleton, tmp)
        with ShardedWriter(tmp, max_shard_bytes=MAX_SHARD_BYTES) as w:
            for name in net.names():
                _write(w, name, net.raw(name).detach().float().cpu(), net.kinds[name])
        (tmp / "training.json").write_text(json.dumps(info or {}, indent=2, sort_keys=True) + "\n")

    return write_folder_atomically(out_dir, fill)


def _write(w: ShardedWriter, name: str, value: torch.Tensor, kind: str) -> None:
    if kind in (FP8, MXFP4):
        write_linear(w, name[:-len(".weight")], value, kind)
    elif kind == ROWS_FP8:
        q, scale = quantize_rows_fp8(value)
        w.add(name, q.view(torch.float8_e4m3fn))
        w.add(name[:-len(".weight")] + ".scale", scale, dtype="F8_E8M0")
    elif kind == BF16:
        w.add(name, value.to(torch.bfloat16))
    elif kind == FP32:
        w.add(name, value)
    else:
        raise ValueError(f"{name}: unknown storage kind {kind!r}")


def checkpoint_bytes(folder: str | Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).iterdir() if p.is_file())
