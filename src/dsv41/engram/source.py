"""Where the Engram tables sit in the original checkpoint (EXL3-ENGRAM.md §5.1, §5.5).

The release keeps `layers.{L}.engram.embed.weight` (F8_E4M3 `[N_L, 256]`) and `.scale` (F8_E8M0 `[N_L, 8]`) of a
layer in one safetensors shard (47 and 48 of 48). `OriginalCheckpoint` reads `config.json` (the row layout),
`model.safetensors.index.json` (which shard holds which table: enough for `--list`, before anything large is
downloaded) and, for packing, each table shard's safetensors header (`weights.safetensors_io.read_header`,
which checks every offset against the file).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dsv41.config import ModelConfig
from dsv41.errors import CheckpointError
from dsv41.weights.safetensors_io import INDEX_FILE, read_header

from .hashing import EngramConstants
from .shards import ROW_SCALE_BLOCK

RELEASE_REPO = "deepseek-ai/DeepSeek-V4.1-Flash"
RELEASE_REVISION = "dba1be0a40aa45a94ad051997016db3960a90277"  # the revision the EXL3 pack was made from
SMALL_FILES = ("config.json", INDEX_FILE)


def download_command(repo: str, revision: str | None, local_dir: str | Path, files: list[str]) -> str:
    """A shell command that downloads only `files` of `repo` (huggingface_hub `allow_patterns`)."""
    rev = f", revision={revision!r}" if revision else ""
    return (f"python -c \"from huggingface_hub import snapshot_download; snapshot_download({repo!r}{rev}, "
            f"local_dir={str(local_dir)!r}, allow_patterns={files!r})\"")


@dataclass(frozen=True)
class TableSpan:
    """One layer's table in a source shard: absolute byte offsets of the weight and scale data."""

    layer_id: int
    file: Path
    rows: int
    head_dim: int
    scale_cols: int
    weight_offset: int
    scale_offset: int

    @property
    def row_bytes(self) -> int:
        return self.head_dim + self.scale_cols


class OriginalCheckpoint:
    """The original (FP8) checkpoint folder as far as the Engram tables go."""

    def __init__(self, folder: str | Path, repo: str = RELEASE_REPO, revision: str | None = RELEASE_REVISION):
        self.folder = Path(folder)
        self.repo, self.revision = repo, revision
        missing = [name for name in SMALL_FILES if not (self.folder / name).is_file()]
        if missing:
            raise CheckpointError(f"{self.folder}: {', '.join(missing)} missing; fetch the small files first: "
                                  + download_command(repo, revision, self.folder, list(SMALL_FILES)))
        self.config = ModelConfig.from_file(self.folder)
        if not self.config.engram_layer_ids:
            raise CheckpointError(f"{self.folder}/config.json lists no Engram layers (engram_layer_ids is empty)")
        self.constants = EngramConstants.from_config(self.config)
        index_path = self.folder / INDEX_FILE
        try:
            self.weight_map = json.loads(index_path.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index_path}: cannot read its weight_map ({exc})") from None

    @staticmethod
    def names(layer_id: int) -> tuple[str, str]:
        return f"layers.{layer_id}.engram.embed.weight", f"layers.{layer_id}.engram.embed.scale"

    def table_file(self, layer_id: int) -> str:
        """The shard file name holding layer `layer_id`'s table (weight and scale must share it)."""
        weight, scale = self.names(layer_id)
        files = [self.weight_map.get(n) for n in (weight, scale)]
        index = self.folder / INDEX_FILE
        for name, file in zip((weight, scale), files):
            if file is None:
                raise CheckpointError(f"{index}: tensor {name} is not in the weight_map (not the original checkpoint?)")
        if files[0] != files[1]:
            raise CheckpointError(f"{index}: {weight} is in {files[0]} but {scale} in {files[1]}; the packer reads "
                                  "both from one shard")
        return files[0]

    def table_files(self) -> dict[int, str]:
        return {layer_id: self.table_file(layer_id) for layer_id in self.config.engram_layer_ids}

    def download_hint(self) -> str:
        files = list(SMALL_FILES) + sorted(set(self.table_files().values()))
        return download_command(self.repo, self.revision, self.folder, files)

    def span(self, layer_id: int) -> TableSpan:
        """The validated location of one layer's table: dtypes, shapes (rows = the config's prime sum) and the
        shard's own header checked."""
        path = self.folder / self.table_file(layer_id)
        if not path.is_file():
            raise CheckpointError(f"{path}: shard missing (it holds the layer {layer_id} Engram table); download "
                                  f"it with: {self.download_hint()}")
        tensors, _ = read_header(path)
        weight_name, scale_name = self.names(layer_id)
        c = self.constants
        rows = c.num_rows[c.layer_index(layer_id)]
        scale_cols = -(-c.head_dim // ROW_SCALE_BLOCK)
        infos = []
        for name, dtypes, cols in ((weight_name, ("F8_E4M3",), c.head_dim), (scale_name, ("F8_E8M0", "U8"), scale_cols)):
            info = tensors.get(name)
            if info is None:
                raise CheckpointError(f"{path}: tensor {name} is missing (the index says it is here)")
            if info.dtype not in dtypes:
                raise CheckpointError(f"{path}: tensor {name} has dtype {info.dtype}, expected {dtypes[0]}")
            if list(info.shape) != [rows, cols]:
                raise CheckpointError(f"{path}: tensor {name} has shape {list(info.shape)}, expected {[rows, cols]}")
            infos.append(info)
        return TableSpan(layer_id, path, rows, c.head_dim, scale_cols, infos[0].offset, infos[1].offset)
