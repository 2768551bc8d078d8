"""The trained tiny model's configuration and storage layout.

The trained model keeps every layer role of the built-in tiny model (tiny/model.py: SWA-only layers, ratio-2 KV
sources and their reuse layers, the ratio-1 candidate source, the re-indexing layer and its reuse, Engram before
layers 1 and 4, 4 mHC streams, MoE with a shared expert, three DSpark blocks on taps of layers 6-8). A few widths
differ, each for a stated reason (`TRAINED_OVERRIDES`):

- the checkpoint must stay small enough for git (<= 20 MB). The built-in shapes in the release's FP8 layout take
  41 MB; `q_lora_rank` and `o_lora_rank` of d/4 (the real model's proportions: 1024 of 4096), a 256-wide expert
  (d/1 rather than 2d) and 32-dim Engram rows bring it to 19.7 MB;
- the tiny tokenizer is close to byte-level (about 1.5 characters a token on Python source), so the built-in
  16-token window would see about 24 characters: the trained model gets a 64-token window (the compressed branch
  with its indexer still carries everything before it).

The layout (tensor name -> storage kind and dense shape) is read from a skeleton checkpoint that `make_tiny`
writes with these overrides, so names, shapes and formats are the generator's and the loader's, never a copy.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from dsv41.errors import DSV41Error
from dsv41.weights import Checkpoint

EXPORT_FORMAT = "fp8"  # the release's layout; no EXL3 quantiser runs here (weights/writer.py)
TRAINED_OVERRIDES = {
    "q_lora_rank": 64,
    "o_lora_rank": 64,
    "moe_intermediate_size": 256,
    "engram_head_dim": 32,
    "sliding_window": 64,
}
SKELETON_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")

# storage kinds
FP8 = "fp8"  # F8_E4M3 + UE8M0 32x32 block scales (a linear)
MXFP4 = "mxfp4"  # packed e2m1 + UE8M0 1x32 scales (routed experts)
ROWS_FP8 = "rows_fp8"  # Engram table: e4m3 rows + one UE8M0 scale per 32 values of a row
BF16 = "bf16"
FP32 = "fp32"


@dataclass(frozen=True)
class TensorSpec:
    name: str  # the dense tensor's checkpoint name (`X.weight` for linears, as the trainer holds it)
    kind: str
    shape: tuple[int, ...]


def make_skeleton(folder: str | Path, overrides: dict | None = None) -> Path:
    """config.json + tokenizer + random weights of the trained config, in the export format (seed 0)."""
    from dsv41.tiny.model import make_tiny
    return make_tiny(folder, EXPORT_FORMAT, seed=0, overrides={**TRAINED_OVERRIDES, **(overrides or {})})


def read_layout(skeleton: str | Path) -> list[TensorSpec]:
    """Every tensor the loader expects, with how the export stores it, from the skeleton's safetensors headers."""
    ckpt = Checkpoint(Path(skeleton))
    names = set(ckpt.names())
    specs = []
    for name in sorted(names):
        if name.endswith(".scale") and name[:-len(".scale")] + ".weight" in names:
            continue  # the scales of a quantised tensor travel with it
        info = ckpt.info(name)
        dtype, shape = info.dtype, tuple(info.shape)
        if name.endswith(".engram.embed.weight") and dtype == "F8_E4M3":
            kind = ROWS_FP8
        elif dtype == "F8_E4M3":
            kind = FP8
        elif dtype == "I8":
            kind, shape = MXFP4, (shape[0], shape[1] * 2)
        elif dtype == "BF16":
            kind = BF16
        elif dtype == "F32":
            kind = FP32
        else:
            raise DSV41Error(f"train-tiny: skeleton tensor {name} has dtype {dtype}, which the trainer cannot hold")
        specs.append(TensorSpec(name, kind, shape))
    return specs


def copy_skeleton_files(skeleton: str | Path, out: str | Path) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name in SKELETON_FILES:
        shutil.copyfile(Path(skeleton) / name, out / name)


def skeleton_config(skeleton: str | Path) -> dict:
    return json.loads((Path(skeleton) / "config.json").read_text())
