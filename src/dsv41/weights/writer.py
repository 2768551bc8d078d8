"""Writing checkpoints in the release's layout: `model-0000N-of-0000M.safetensors` + `model.safetensors.index.json`.

Used by `dsv41 make-tiny` and by tests. Shards are written as they fill (memory holds at most one shard's
tensors) under temporary names and renamed once the shard count is known.

`write_linear` stores one linear layer, given as a dense torch `[out, in]` matrix, in any of the formats the
loader reads. EXL3 has no quantiser that runs on a CPU (ExLlamaV3's Viterbi search is CUDA-only), so for EXL3
it writes a *random but valid* group instead: uniformly random trellis words, random-sign `suh`/`svh` whose
magnitudes give the effective weight the per-output-channel RMS of `W` and exactly its overall RMS (up to
fp16 rounding of the scales). The values of `W` itself are not kept; the tiny model is random anyway, and
what matters is that every byte goes through the real decode path with realistic magnitudes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from dsv41.weights import exl3, formats
from dsv41.weights.safetensors_io import INDEX_FILE

# torch dtype -> safetensors dtype string (uint8 scales are labelled F8_E8M0 by the caller).
_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
if hasattr(torch, "float8_e8m0fnu"):
    _ST_DTYPES[torch.float8_e8m0fnu] = "F8_E8M0"


class ShardedWriter:
    """Collects tensors into shards of at most `max_shard_bytes` (a larger single tensor gets its own shard)."""

    def __init__(self, folder: str | os.PathLike, max_shard_bytes: int = 2 * 1024**3):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self._pending: list[tuple[str, torch.Tensor, str]] = []
        self._pending_bytes = 0
        self._shards: list[tuple[Path, list[str]]] = []  # temporary path, tensor names
        self._names: set[str] = set()
        self.total_size = 0
        self._closed = False

    def add(self, name: str, tensor: torch.Tensor, dtype: str | None = None) -> None:
        """Queue a tensor; `dtype` overrides the stored dtype label (e.g. "F8_E8M0" for uint8 scale bytes)."""
        if self._closed:
            raise RuntimeError("ShardedWriter is closed")
        if name in self._names:
            raise ValueError(f"tensor {name!r} written twice")
        label = dtype or _ST_DTYPES.get(tensor.dtype)
        if label is None:
            raise ValueError(f"tensor {name!r}: dtype {tensor.dtype} has no safetensors equivalent")
        if label == "F8_E8M0" and tensor.element_size() != 1:
            raise ValueError(f"tensor {name!r}: F8_E8M0 needs 1-byte elements, got {tensor.dtype}")
        tensor = tensor.detach().to("cpu").contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._names.add(name)
        self._pending.append((name, tensor, label))
        self._pending_bytes += nbytes
        self.total_size += nbytes

    def _flush(self) -> None:
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, tensor, label in self._pending:
            nbytes = tensor.numel() * tensor.element_size()
            header[name] = {"dtype": label, "shape": list(tensor.shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned, as the reference writer does
        path = self.folder / f".shard-{len(self._shards):05d}.tmp"
        with open(path, "wb") as f:
            f.write(len(raw).to_bytes(8, "little"))
            f.write(raw)
            for _, tensor, _ in self._pending:
                f.write(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
        self._shards.append((path, [name for name, _, _ in self._pending]))
        self._pending, self._pending_bytes = [], 0

    def close(self) -> list[Path]:
        """Write the last shard, give every shard its final name and write the index; returns the shard paths."""
        if self._closed:
            return [self.folder / name for name in self._final_names()]
        if self._pending or not self._shards:
            self._flush()
        weight_map: dict[str, str] = {}
        for (tmp, names), final in zip(self._shards, self._final_names()):
            tmp.replace(self.folder / final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.total_size}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        self._closed = True
        return [self.folder / name for name in self._final_names()]

    def _final_names(self) -> list[str]:
        count = len(self._shards)
        return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]

    def __enter__(self) -> ShardedWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()


LINEAR_FORMATS = ("bf16", "fp16", "fp32", "fp8", "mxfp4", "exl3")
_NATIVE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def write_linear(writer: ShardedWriter, prefix: str, W: torch.Tensor, fmt: str, **opts) -> None:
    """Store the linear `prefix` (module name, e.g. `layers.0.attn.wq_a`) with dense torch weight W `[out, in]`.

    bf16/fp16/fp32 → `prefix.weight`; fp8 → `prefix.weight` F8_E4M3 + `prefix.scale` F8_E8M0 (32x32 blocks);
    mxfp4 → `prefix.weight` I8 + `prefix.scale` F8_E8M0 (1x32); exl3 → `prefix.{trellis,suh,svh,<marker>}`
    (random valid trellis, see module notes; options `K` (default 4), `codebook` (default "mul1"),
    `generator` (a torch.Generator; default seeded from the prefix)).
    """
    if W.dim() != 2:
        raise ValueError(f"{prefix}: weight must be 2-d [out, in], got shape {list(W.shape)}")
    if fmt in _NATIVE:
        writer.add(f"{prefix}.weight", W.to(_NATIVE[fmt]))
    elif fmt == "fp8":
        q, scale = formats.quantize_fp8_block(W)
        writer.add(f"{prefix}.weight", q)
        writer.add(f"{prefix}.scale", scale, dtype="F8_E8M0")
    elif fmt == "mxfp4":
        packed, scale = formats.quantize_mxfp4(W)
        writer.add(f"{prefix}.weight", packed)
        writer.add(f"{prefix}.scale", scale, dtype="F8_E8M0")
    elif fmt == "exl3":
        for part, tensor in random_exl3_group(W, prefix=prefix, **opts).items():
            writer.add(f"{prefix}.{part}", tensor)
    else:
        raise ValueError(f"{prefix}: unknown linear format {fmt!r}; expected one of {LINEAR_FORMATS}")


def random_exl3_group(
    W: torch.Tensor,
    K: float = 4,
    codebook: str = "mul1",
    generator: torch.Generator | None = None,
    prefix: str = "",
) -> dict[str, torch.Tensor]:
    """A valid EXL3 group `{trellis, suh, svh[, marker]}` standing in for torch weight W `[out, in]`."""
    out_features, in_features = W.shape
    if in_features % 128 or out_features % 128:
        raise ValueError(
            f"{prefix}: EXL3 needs in and out features divisible by 128, got [{out_features}, {in_features}]"
        )
    if codebook not in exl3.CODEBOOKS:
        raise ValueError(f"{prefix}: unknown EXL3 codebook {codebook!r}")
    if generator is None:
        generator = torch.Generator().manual_seed(sum(prefix.encode()) * 1000003 % 2**31)
    words = int(16 * exl3._check_k(K))
    if K % 1 and codebook != "mul1":
        raise ValueError(f"{prefix}: half-integer K={K} exists only for the mul1 codebook")
    trellis = torch.randint(
        -32768, 32768, (in_features // 16, out_features // 16, words), generator=generator, dtype=torch.int32
    ).to(torch.int16)

    def random_signs(n: int) -> torch.Tensor:
        return torch.randint(0, 2, (n,), generator=generator).double() * 2 - 1

    w = W.double()
    row_rms = w.pow(2).mean(dim=1).sqrt()  # per output channel
    target_rms = w.pow(2).mean().sqrt()
    svh = random_signs(out_features) * row_rms
    suh = random_signs(in_features)
    w_eff = exl3.effective_weight(trellis, suh, svh, codebook, torch.float64)
    got_rms = w_eff.pow(2).mean().sqrt()
    if got_rms > 0:
        suh = suh * (target_rms / got_rms)
    group = {"trellis": trellis, "suh": suh.to(torch.float16), "svh": svh.to(torch.float16)}
    if codebook != "3inst":
        group[codebook] = torch.tensor(exl3.MARKER_VALUES[codebook], dtype=torch.int32)
    return group
