"""One linear layer's weight in any of the four storage formats, with tensor-parallel slicing.

`Linear` holds the stored tensors of its (slice of the) layer and computes `y = x @ W_eff^T` in torch
convention (`W_eff` is `[out, in]`). The dense weight is dequantised once on first use (`materialize`) and
cached; `release()` drops the cache.

Formats, detected from which tensors exist under the prefix `P`:

| fmt    | tensors                                      | split granularity (col = outputs, row = inputs) |
| ------ | -------------------------------------------- | ------------------------------------------------ |
| native | `P.weight` BF16/F16/F32 `[out, in]`          | any                                              |
| fp8    | `P.weight` F8_E4M3 + `P.scale` `[⌈out/32⌉, ⌈in/32⌉]` | whole 32-blocks both ways                |
| mxfp4  | `P.weight` I8 `[out, in/2]` + `P.scale` `[out, in/32]` | col: any; row: whole 32-blocks         |
| exl3   | `P.trellis/suh/svh(/mul1|mcg)`, stored `[in, out]` | whole 128-wide Hadamard blocks both ways   |

Splits may be uneven in whole blocks (`split_sizes`); only the slice's bytes are read from disk.
"""

from __future__ import annotations

import torch

from dsv41.errors import CheckpointError
from dsv41.weights import exl3, formats
from dsv41.weights.safetensors_io import Checkpoint

FORMATS = ("native", "fp8", "mxfp4", "exl3")
NATIVE_DTYPES = ("BF16", "F16", "F32")


def split_sizes(total: int, world: int, block: int = 1) -> list[int]:
    """Sizes of `world` consecutive parts of `total` made of whole `block`s (the last block may be partial).

    Blocks are dealt as evenly as possible, earlier ranks taking the extra ones: 7 blocks over 2 ranks = 4 + 3.
    """
    if world < 1 or block < 1:
        raise ValueError(f"world ({world}) and block ({block}) must be positive")
    blocks = -(-total // block)
    if blocks < world:
        raise ValueError(f"cannot split {total} into {world} parts of whole {block}-blocks")
    base, extra = divmod(blocks, world)
    sizes = [(base + (r < extra)) * block for r in range(world)]
    sizes[-1] -= blocks * block - total  # the partial last block
    return sizes


def split_range(total: int, world: int, rank: int, block: int = 1) -> tuple[int, int]:
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside world {world}")
    sizes = split_sizes(total, world, block)
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


def split_block(fmt: str, split: str) -> int:
    """Smallest unit a `fmt` weight can be split in along outputs (`col`) or inputs (`row`)."""
    if fmt == "exl3":
        return 128
    if fmt == "fp8":
        return formats.BLOCK
    if fmt == "mxfp4":
        return formats.BLOCK if split == "row" else 1
    return 1


class Linear:
    """A (possibly tensor-parallel sliced) linear layer: `y = x @ W_eff^T`, `W_eff` `[out_features, in_features]`."""

    def __init__(self, fmt: str, tensors: dict[str, torch.Tensor], in_features: int, out_features: int,
                 name: str = "", codebook: str | None = None):
        if fmt not in FORMATS:
            raise ValueError(f"{name}: unknown linear format {fmt!r}")
        self.fmt = fmt
        self.tensors = tensors  # stored form: weight/scale, or trellis/suh/svh
        self.in_features = in_features
        self.out_features = out_features
        self.name = name
        self.codebook = codebook  # exl3 only
        self._dense: torch.Tensor | None = None

    # ---- construction ------------------------------------------------------------------------------------

    @classmethod
    def from_tensor(cls, w: torch.Tensor, name: str = "") -> Linear:
        """A native linear from a dense torch weight `[out, in]`."""
        if w.dim() != 2:
            raise ValueError(f"{name}: weight must be 2-d [out, in], got {list(w.shape)}")
        return cls("native", {"weight": w}, w.shape[1], w.shape[0], name)

    @classmethod
    def from_checkpoint(
        cls,
        ckpt: Checkpoint,
        prefix: str,
        *,
        expected_shape: tuple[int, int] | None = None,
        split: str | None = None,
        rank: int = 0,
        world: int = 1,
        block: int | None = None,
        device: torch.device | str | None = None,
    ) -> Linear:
        """Load the linear stored under `prefix` (module name without `.weight`).

        `expected_shape=(out, in)` is the full (unsplit) shape; `split="col"` keeps this rank's outputs,
        `split="row"` its inputs; `block` forces a coarser split unit (a multiple of the format's own).
        """
        fmt = detect_format(ckpt, prefix)
        out_features, in_features = _full_shape(ckpt, prefix, fmt)
        if expected_shape is not None and (out_features, in_features) != tuple(expected_shape):
            raise CheckpointError(
                f"linear {prefix!r} ({fmt}): shape [out, in] = [{out_features}, {in_features}], "
                f"expected {list(expected_shape)}"
            )
        lo, hi = 0, out_features if split != "row" else in_features
        if split is not None and split not in ("col", "row"):
            raise ValueError(f"{prefix}: split must be 'col', 'row' or None, got {split!r}")
        if split is not None:
            unit = split_block(fmt, split)
            if block is not None:
                if block % unit:
                    raise ValueError(f"{prefix}: split block {block} is not a multiple of {fmt}'s {unit}")
                unit = block
            total = out_features if split == "col" else in_features
            try:
                lo, hi = split_range(total, world, rank, unit)
            except ValueError as e:
                raise CheckpointError(f"linear {prefix!r}: {e}") from None
        reader = _SliceReader(ckpt, prefix, split, lo, hi)
        tensors, codebook = _read_tensors(reader, fmt)
        if device is not None:
            tensors = {k: v.to(device) for k, v in tensors.items()}
        if split == "col":
            out_features = hi - lo
        elif split == "row":
            in_features = hi - lo
        return cls(fmt, tensors, in_features, out_features, prefix, codebook)

    # ---- math --------------------------------------------------------------------------------------------

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense `[out, in]` weight, computed afresh (fp32 internally, one final cast)."""
        t = self.tensors
        if self.fmt == "native":
            return t["weight"].to(dtype)
        if self.fmt == "fp8":
            return formats.dequant_fp8_block(t["weight"], t["scale"], dtype)
        if self.fmt == "mxfp4":
            return formats.dequant_mxfp4(t["weight"], t["scale"], dtype)
        inner = torch.float64 if dtype == torch.float64 else torch.float32
        return exl3.effective_weight(t["trellis"], t["suh"], t["svh"], self.codebook, inner).T.to(dtype)

    def materialize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight in `dtype`, dequantised once and cached (a new dtype replaces the cache)."""
        if self._dense is None or self._dense.dtype != dtype:
            self._dense = None
            self._dense = self.dequantize(dtype).contiguous()
        return self._dense

    def release(self) -> None:
        self._dense = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W_eff^T` in x's dtype (x: `[..., in_features]`)."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{self.name}: input has {x.shape[-1]} features, layer expects {self.in_features}")
        return x @ self.materialize(x.dtype).T

    __call__ = forward

    def __repr__(self) -> str:
        return f"Linear({self.name!r}, fmt={self.fmt}, in={self.in_features}, out={self.out_features})"


# --------------------------------------------------------------------------------------------------------------
# format detection and slice reading
# --------------------------------------------------------------------------------------------------------------


def detect_format(ckpt: Checkpoint, prefix: str) -> str:
    if ckpt.has(f"{prefix}.trellis"):
        return "exl3"
    weight = f"{prefix}.weight"
    if not ckpt.has(weight):
        raise CheckpointError(f"linear {prefix!r}: neither {weight!r} nor {prefix + '.trellis'!r} in checkpoint")
    dtype = ckpt.dtype(weight)
    if ckpt.has(f"{prefix}.scale"):
        if dtype == "F8_E4M3":
            return "fp8"
        if dtype in ("I8", "U8"):
            return "mxfp4"
        raise CheckpointError(f"tensor {weight!r}: dtype {dtype} with a .scale is neither FP8 (F8_E4M3) nor MXFP4 (I8)")
    if dtype in NATIVE_DTYPES:
        return "native"
    raise CheckpointError(f"tensor {weight!r}: dtype {dtype} needs a {prefix + '.scale'!r} tensor, which is missing")


def _full_shape(ckpt: Checkpoint, prefix: str, fmt: str) -> tuple[int, int]:
    """(out, in) of the whole layer, checking that all tensors of the group agree."""
    if fmt == "exl3":
        # the stored [in, out] = [k, n]; the same check as the kernels' layout, on the entries before any read
        dims = exl3.check_group(prefix, *(ckpt.info(f"{prefix}.{part}") for part in ("trellis", "suh", "svh")))
        for marker in ("mul1", "mcg"):
            if ckpt.has(f"{prefix}.{marker}"):
                ckpt.expect(f"{prefix}.{marker}", shape=(), dtypes=("I32",))
        return dims.n, dims.k
    w = ckpt.info(f"{prefix}.weight")
    if len(w.shape) != 2:
        raise CheckpointError(f"tensor {w.name!r}: shape {list(w.shape)} is not 2-d")
    rows, cols = w.shape
    if fmt == "native":
        return rows, cols
    if fmt == "fp8":
        ckpt.expect(f"{prefix}.scale", shape=(-(-rows // 32), -(-cols // 32)), dtypes=("F8_E8M0", "U8"))
        return rows, cols
    in_features = cols * 2
    ckpt.expect(f"{prefix}.scale", shape=(rows, -(-in_features // 32)), dtypes=("F8_E8M0", "U8"))
    return rows, in_features


class _SliceReader:
    """Reads one tensor of the group restricted to this rank's [lo, hi) of the split dimension."""

    def __init__(self, ckpt: Checkpoint, prefix: str, split: str | None, lo: int, hi: int):
        self.ckpt, self.prefix, self.split, self.lo, self.hi = ckpt, prefix, split, lo, hi

    def read(self, part: str, dim_by_split: dict[str, int], unit: int = 1, ceil: bool = False) -> torch.Tensor:
        """`dim_by_split` maps the split kind to the tensor dim to slice (absent: read whole); indices / unit."""
        name = f"{self.prefix}.{part}"
        dim = dim_by_split.get(self.split) if self.split else None
        if dim is None:
            return self.ckpt.get(name)
        start = self.lo // unit
        stop = -(-self.hi // unit) if ceil else self.hi // unit
        return self.ckpt.get_slice(name, dim, start, stop)


def _read_tensors(reader: _SliceReader, fmt: str) -> tuple[dict[str, torch.Tensor], str | None]:
    if fmt == "native":
        return {"weight": reader.read("weight", {"col": 0, "row": 1})}, None
    if fmt == "fp8":
        return {
            "weight": reader.read("weight", {"col": 0, "row": 1}),
            "scale": reader.read("scale", {"col": 0, "row": 1}, unit=32, ceil=True),
        }, None
    if fmt == "mxfp4":
        return {
            "weight": reader.read("weight", {"col": 0, "row": 1}, unit=1 if reader.split == "col" else 2),
            "scale": reader.read("scale", {"col": 0, "row": 1}, unit=1 if reader.split == "col" else 32, ceil=True),
        }, None
    # EXL3 is stored [in, out]: outputs are trellis dim 1 and svh, inputs trellis dim 0 and suh.
    group = {
        "trellis": reader.read("trellis", {"col": 1, "row": 0}, unit=16),
        "suh": reader.read("suh", {"row": 0}),
        "svh": reader.read("svh", {"col": 0}),
    }
    markers = {m: reader.read(m, {}) for m in ("mul1", "mcg") if reader.ckpt.has(f"{reader.prefix}.{m}")}
    codebook = exl3.codebook_from_group(markers, reader.prefix)
    return group, codebook
