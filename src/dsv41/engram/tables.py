"""Engram: the conditional n-gram memory added to the residual streams before the Engram layers (MODEL.md §9).

Four parts, in the order the data flows:

1. `build_compressed_token_map`: tokenizer id -> compressed id (tokens that normalise alike share one id).
2. `EngramConstants` + `EngramHasher`: per position, the table row ids of the 2..N-grams ending there
   (multipliers, prime buckets, offsets; a per-sequence look-back carried across chunks).
3. `EngramTable`: the row storage, read lazily from the checkpoint tensors or from the packed
   `engram-l{L}-r{rank}of{world}.bin` shard files (EXL3-ENGRAM.md §5), restricted to a rank's hash columns.
4. `engram_mix` / `EngramLayer`: gathered rows -> `wkv` -> one key per stream + a shared value; a per-stream
   sigmoid gate of a signed-sqrt score adds the value into each stream.

Tensor parallelism (EXL3-ENGRAM.md §5.3): the hash columns of a layer are split into contiguous blocks, one
per rank (`head_shard`). A rank gathers only its columns' rows, multiplies them by its slice of `wkv`'s input
rows (row-parallel), and the partial `kv` vectors are summed over ranks before the gate.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dsv41.errors import CheckpointError, ConfigError, TokenizerError
from dsv41.weights.formats import FP8_MAX, e4m3_to_float, e8m0_to_float, power_of_two_scale_byte
from dsv41.weights.safetensors_io import Checkpoint, TensorInfo, read_header

from dsv41.model.rowwise import f64

# A look-back slot that no n-gram may reach across: before the sequence start, or an image-span token.
DEAD = -1
# Lower bound on |score| before the square root in the gate (the release's clamp value).
GATE_SQRT_FLOOR = 1e-6
# One UE8M0 scale per this many values of an FP8 table row.
ROW_SCALE_BLOCK = 32


# ==============================================================================================================
# 1. compressed token map (MODEL.md §9.1)
# ==============================================================================================================

# Private-use character that shields a token consisting of exactly one space from `Strip`.
_LONE_SPACE_SENTINEL = "\ue000"


def _engram_normalizer():
    from tokenizers import Regex, normalizers

    return normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), _LONE_SPACE_SENTINEL),
        normalizers.Strip(),
        normalizers.Replace(_LONE_SPACE_SENTINEL, " "),
    ])


def build_compressed_token_map(tokenizer) -> tuple[torch.Tensor, int]:
    """(int64 `[len(tokenizer)]` map token id -> compressed id, number of compressed ids).

    `tokenizer` is a `dsv41.tokenizer.Tokenizer` or a raw `tokenizers.Tokenizer`. Each id is decoded alone
    with special tokens kept; a partial-UTF-8 token (its text contains U+FFFD) is keyed by its raw token
    string, any other by its normalised text (or the text itself when that normalises to ""). Compressed ids
    are handed out in order of first appearance.
    """
    backend = getattr(tokenizer, "backend", tokenizer)
    normalizer = _engram_normalizer()
    size = backend.get_vocab_size(with_added_tokens=True)
    ids_by_key: dict[str, int] = {}
    table = torch.empty(size, dtype=torch.int64)
    for token_id in range(size):
        text = backend.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = backend.id_to_token(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        table[token_id] = ids_by_key.setdefault(key, len(ids_by_key))
    return table, len(ids_by_key)


# ==============================================================================================================
# 2. hash constants and hash ids (MODEL.md §9.2-9.3, §15b.1)
# ==============================================================================================================

_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)  # deterministic Miller-Rabin below 3.3e24


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def engram_primes(config) -> torch.Tensor:
    """int64 `[n_layers, max_ngram-1, n_heads]` bucket sizes.

    For every (layer, n-gram order, head) in that order, the next prime above `engram_vocab_size - 1` that
    no earlier bucket took (the search restarts at the same point for each order; the global `seen` set is
    what moves it on).
    """
    seen: set[int] = set()
    layers = []
    for _ in config.engram_layer_ids:
        orders = []
        for _ in range(config.engram_max_ngram_size - 1):
            heads, candidate = [], config.engram_vocab_size - 1
            for _ in range(config.engram_n_heads):
                candidate += 1
                while candidate in seen or not is_prime(candidate):
                    candidate += 1
                seen.add(candidate)
                heads.append(candidate)
            orders.append(heads)
        layers.append(orders)
    return torch.tensor(layers, dtype=torch.int64)


def engram_offsets(primes: torch.Tensor) -> torch.Tensor:
    """int64 `[n_layers, n_cols]`: first table row of each hash column (exclusive cumsum of its layer's primes)."""
    flat = primes.flatten(1)
    return torch.cumsum(flat, dim=1) - flat


def engram_multipliers(config) -> torch.Tensor:
    """int64 `[n_layers, max_ngram]` odd multipliers, one per look-back distance.

    numpy `default_rng(10007 * layer_id)` draws in [0, B) with B chosen so that any compressed id times a
    multiplier stays inside int64; ×2+1 makes them odd.
    """
    bound = max(1, (np.iinfo(np.int64).max // config.engram_compressed_vocab_size) // 2)
    rows = []
    for layer_id in config.engram_layer_ids:
        draws = np.random.default_rng(10007 * layer_id).integers(0, bound, size=config.engram_max_ngram_size,
                                                                  dtype=np.int64)
        rows.append(draws * 2 + 1)
    return torch.from_numpy(np.stack(rows)).to(torch.int64)


def head_shard(n_cols: int, rank: int, world: int) -> tuple[int, int]:
    """Hash columns `[c0, c1)` of one layer owned by `rank` of `world`: contiguous blocks of ceil(n_cols/world)
    (the last ranks may get fewer, or none)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside world {world}")
    per_rank = -(-n_cols // world)
    c0 = min(rank * per_rank, n_cols)
    return c0, min(c0 + per_rank, n_cols)


@dataclass(frozen=True)
class EngramConstants:
    """Everything the hash needs that depends on the config alone."""

    layer_ids: tuple[int, ...]
    max_ngram: int
    n_heads: int
    head_dim: int
    primes: torch.Tensor  # [n_layers, max_ngram-1, n_heads]
    offsets: torch.Tensor  # [n_layers, n_cols]
    multipliers: torch.Tensor  # [n_layers, max_ngram]
    num_rows: tuple[int, ...]  # table rows per layer (= sum of its primes)

    @classmethod
    def from_config(cls, config) -> "EngramConstants":
        if not config.engram_layer_ids:
            raise ConfigError("config.json: Engram constants requested but text_config.engram_layer_ids is empty")
        primes = engram_primes(config)
        sums = tuple(int(s) for s in primes.flatten(1).sum(dim=1))
        declared = tuple(int(n) for n in config.engram_num_embeddings)
        if sums != declared:
            raise ConfigError(f"config.json: field text_config.engram_num_embeddings is {list(declared)}, but the "
                              f"prime buckets of the Engram layers sum to {list(sums)}")
        return cls(
            layer_ids=tuple(config.engram_layer_ids),
            max_ngram=config.engram_max_ngram_size,
            n_heads=config.engram_n_heads,
            head_dim=config.engram_head_dim,
            primes=primes,
            offsets=engram_offsets(primes),
            multipliers=engram_multipliers(config),
            num_rows=sums,
        )

    @property
    def n_cols(self) -> int:
        return (self.max_ngram - 1) * self.n_heads

    def layer_index(self, layer_id: int) -> int:
        if layer_id not in self.layer_ids:
            raise ConfigError(f"layer {layer_id} is not an Engram layer (engram_layer_ids = {list(self.layer_ids)})")
        return self.layer_ids.index(layer_id)

    def row_range(self, layer_id: int, c0: int, c1: int) -> tuple[int, int]:
        """Global rows `[lo, hi)` covered by hash columns `[c0, c1)` of a layer (one contiguous range)."""
        li = self.layer_index(layer_id)
        flat = self.primes[li].flatten()
        lo = int(flat[:c0].sum())
        return lo, lo + int(flat[c0:c1].sum())


class EngramHistory:
    """Per-sequence look-back: the last `max_ngram - 1` compressed ids (oldest first), DEAD where blocked."""

    def __init__(self, max_ngram: int):
        self.ids = torch.full((max_ngram - 1,), DEAD, dtype=torch.int64)

    def copy(self) -> "EngramHistory":
        other = EngramHistory.__new__(EngramHistory)
        other.ids = self.ids.clone()
        return other


class EngramHasher:
    """Token ids -> Engram row ids `[T, n_layers, n_cols]`, chunk by chunk with the look-back carried along.

    Row id for look-back order k (n-gram of k+1 tokens), head h of a layer:
    `(XOR_{s<=k} c[t-s]·mult[s]) mod prime[k-1][h] + offset[(k-1)·n_heads + h]`, where `c[t-s]` is the
    compressed id s positions back, replaced by the pad's compressed id once the look-back has met the
    sequence start or a DEAD (image) token (and for everything further back).
    """

    def __init__(self, config, token_map: torch.Tensor, constants: EngramConstants | None = None):
        self.constants = constants or EngramConstants.from_config(config)
        token_map = torch.as_tensor(token_map, dtype=torch.int64)
        pad_token = config.engram_pad_token_id
        if not 0 <= pad_token < token_map.numel():
            raise ConfigError(f"config.json: field text_config.engram_pad_token_id = {pad_token} is outside the "
                              f"tokenizer's {token_map.numel()} ids")
        self.pad_id = int(token_map[pad_token])
        # Ids the model can emit but the tokenizer lacks (model vocab > tokenizer) hash like the pad.
        if token_map.numel() < config.vocab_size:
            extra = torch.full((config.vocab_size - token_map.numel(),), self.pad_id, dtype=torch.int64)
            token_map = torch.cat([token_map, extra])
        self.token_map = token_map
        self.image_token_id = getattr(config, "image_token_id", None)

    @classmethod
    def from_tokenizer(cls, config, tokenizer) -> "EngramHasher":
        token_map, size = build_compressed_token_map(tokenizer)
        if size != config.engram_compressed_vocab_size:
            raise TokenizerError(f"the tokenizer gives {size} compressed Engram ids but config.json field "
                                 f"text_config.engram_compressed_vocab_size is {config.engram_compressed_vocab_size}")
        return cls(config, token_map)

    def new_history(self) -> EngramHistory:
        return EngramHistory(self.constants.max_ngram)

    def live(self, token_ids) -> torch.Tensor:
        """bool `[T]`: False at image-span tokens, whose Engram gate is shut (pass to `EngramLayer.forward`)."""
        ids = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1)
        if self.image_token_id is None:
            return torch.ones_like(ids, dtype=torch.bool)
        return ids != self.image_token_id

    def hash(self, token_ids, history: EngramHistory | None = None, dead: torch.Tensor | None = None
             ) -> torch.Tensor:
        """Row ids `[T, n_layers, n_cols]` (int64) for a chunk of one sequence; updates `history` in place.

        `history=None` hashes the chunk as the start of a sequence. `dead` (bool `[T]`) marks extra DEAD
        positions; image tokens (`image_token_id`) are always DEAD.
        """
        c = self.constants
        ids = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1).cpu()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.token_map.numel()):
            raise ValueError(f"token id outside the vocabulary of {self.token_map.numel()}")
        compressed = self.token_map[ids]
        is_dead = torch.zeros_like(ids, dtype=torch.bool) if dead is None else torch.as_tensor(dead).reshape(-1)
        if self.image_token_id is not None:
            is_dead = is_dead | (ids == self.image_token_id)
        compressed = torch.where(is_dead, torch.full_like(compressed, DEAD), compressed)

        if history is None:
            history = self.new_history()
        back = c.max_ngram - 1
        seq = torch.cat([history.ids, compressed])  # [back + T]
        history.ids = seq[-back:].clone()
        T = ids.numel()

        # tokens[:, s] = compressed id s positions back, pad once blocked (cumulatively along s)
        tokens, blocked = [], torch.zeros(T, dtype=torch.bool)
        for s in range(c.max_ngram):
            source = seq[back - s: back - s + T]
            blocked = blocked | (source == DEAD)
            tokens.append(torch.where(blocked, torch.full_like(source, self.pad_id), source))
        tokens = torch.stack(tokens, dim=1)  # [T, max_ngram]

        products = tokens[:, None, :] * c.multipliers[None, :, :]  # [T, n_layers, max_ngram]; cannot overflow
        rolling = products[..., 0]
        columns = []
        for k in range(1, c.max_ngram):
            rolling = torch.bitwise_xor(rolling, products[..., k])
            columns.append(torch.remainder(rolling[..., None], c.primes[None, :, k - 1, :]))  # floor modulo
        return torch.cat(columns, dim=-1) + c.offsets[None]


# ==============================================================================================================
# 3. table storage (MODEL.md §4.1, EXL3-ENGRAM.md §5)
# ==============================================================================================================

# EXL3-ENGRAM.md §5.4 calls this ASCII "DSV41EN1", but written little-endian its bytes are "DSV1EN41"; the number
# is what the public packers write and check, so the number is what we use.
SHARD_MAGIC = 0x31344E4531565344
SHARD_HEADER_BYTES = 4096
_SHARD_HEADER = struct.Struct("<QQQQQQ")  # magic, layer, lo, hi, total rows, row bytes

_SAFETENSORS_DTYPES = {  # name -> (numpy storage dtype, bytes per element, kind)
    "F8_E4M3": (np.uint8, 1, "fp8"),
    "BF16": (np.uint16, 2, "bf16"),
    "F16": (np.float16, 2, "f16"),
    "F32": (np.float32, 4, "f32"),
}


def shard_file_name(layer_id: int, rank: int, world: int) -> str:
    return f"engram-l{layer_id}-r{rank}of{world}.bin"


def fp8_row_bytes(head_dim: int) -> int:
    """Bytes of one packed FP8 row: the e4m3 values then one UE8M0 scale per 32 values."""
    return head_dim + -(-head_dim // ROW_SCALE_BLOCK)


class _RowSource:
    """Rows `[base, base + n)` of one layer's table as (memory-mapped) numpy arrays, dequantised on demand."""

    def __init__(self, values: np.ndarray, scales: np.ndarray | None, kind: str, base: int, keepalive=None):
        self.values, self.scales, self.kind, self.base = values, scales, kind, base
        self._keepalive = keepalive  # the mmap object behind the arrays

    def read(self, local_rows: np.ndarray) -> torch.Tensor:
        """float32 `[len(local_rows), head_dim]`; only the pages of those rows are touched."""
        raw = torch.from_numpy(np.ascontiguousarray(self.values[local_rows]))
        if self.kind == "fp8":
            values = e4m3_to_float(raw)
            scales = e8m0_to_float(torch.from_numpy(np.ascontiguousarray(self.scales[local_rows])))
            scales = scales.repeat_interleave(ROW_SCALE_BLOCK, dim=-1)[..., : values.shape[-1]]
            return values * scales
        if self.kind == "bf16":
            return raw.view(torch.bfloat16).float()
        return raw.float()


class EngramTable:
    """One Engram layer's table rows, for the hash columns `[c0, c1)` this rank owns.

    Nothing is read until `gather`; the backing file is memory-mapped, so only the touched rows' pages are
    read (the release's tables are ~94 GiB each).
    """

    def __init__(self, layer_id: int, constants: EngramConstants, source: _RowSource, rank: int, world: int,
                 where: str):
        self.layer_id = layer_id
        self.constants = constants
        self.rank, self.world = rank, world
        self.cols = head_shard(constants.n_cols, rank, world)
        self.lo, self.hi = constants.row_range(layer_id, *self.cols)
        self.total_rows = constants.num_rows[constants.layer_index(layer_id)]
        self.head_dim = constants.head_dim
        self.where = where
        self._source = source
        n_source = source.values.shape[0]
        if source.base > self.lo or source.base + n_source < self.hi:
            raise CheckpointError(f"{where}: holds rows [{source.base}, {source.base + n_source}) of layer "
                                  f"{layer_id}, rank {rank}/{world} needs [{self.lo}, {self.hi})")

    # --- constructors -----------------------------------------------------------------------------------------
    @classmethod
    def from_checkpoint(cls, source, layer_id: int, config, rank: int = 0, world: int = 1,
                        constants: EngramConstants | None = None) -> "EngramTable":
        """From `layers.{L}.engram.embed.weight` (+ `.scale` when FP8) of a checkpoint: a `Checkpoint`, a folder
        (`model.safetensors.index.json` + shards, or a single `model.safetensors`), or one .safetensors file.
        Headers are parsed and validated by `weights.safetensors_io`; the rows stay memory-mapped."""
        constants = constants or EngramConstants.from_config(config)
        lookup = _tensor_lookup(source)
        name = f"layers.{layer_id}.engram.embed.weight"
        weight_info = lookup(name)
        rows = constants.num_rows[constants.layer_index(layer_id)]
        if weight_info.dtype not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"{weight_info.file}: tensor {name} has dtype {weight_info.dtype}, expected one "
                                  f"of {sorted(_SAFETENSORS_DTYPES)}")
        np_dtype, _, kind = _SAFETENSORS_DTYPES[weight_info.dtype]
        _check_shape(weight_info, [rows, constants.head_dim])
        values, mm = _map_rows(weight_info, np_dtype)
        scales = None
        if kind == "fp8":
            scale_info = lookup(f"layers.{layer_id}.engram.embed.scale")
            if scale_info.dtype not in ("F8_E8M0", "U8"):
                raise CheckpointError(f"{scale_info.file}: tensor {scale_info.name} has dtype {scale_info.dtype}, "
                                      "expected F8_E8M0")
            _check_shape(scale_info, [rows, -(-constants.head_dim // ROW_SCALE_BLOCK)])
            scales, scale_mm = _map_rows(scale_info, np.uint8)
            mm = (mm, scale_mm)
        source = _RowSource(values, scales, kind, base=0, keepalive=mm)
        return cls(layer_id, constants, source, rank, world, where=f"{weight_info.file}: {name}")

    @classmethod
    def from_shard_file(cls, path: str | Path, layer_id: int, config, rank: int = 0, world: int = 1,
                        constants: EngramConstants | None = None) -> "EngramTable":
        """From a packed `engram-l{L}-r{rank}of{world}.bin` file; every header field is checked."""
        constants = constants or EngramConstants.from_config(config)
        path = Path(path)
        li = constants.layer_index(layer_id)
        lo, hi = constants.row_range(layer_id, *head_shard(constants.n_cols, rank, world))
        row_bytes = fp8_row_bytes(constants.head_dim)
        expected = {"layer": layer_id, "lo": lo, "hi": hi, "total rows": constants.num_rows[li],
                    "row bytes": row_bytes}
        header = read_shard_header(path)
        for field, want in expected.items():
            if header[field] != want:
                raise CheckpointError(f"{path}: header field '{field}' is {header[field]}, expected {want} "
                                      f"(layer {layer_id}, rank {rank} of {world})")
        size = path.stat().st_size
        want_size = SHARD_HEADER_BYTES + (hi - lo) * row_bytes
        if size != want_size:
            raise CheckpointError(f"{path}: file is {size} bytes, expected {want_size} "
                                  f"({hi - lo} rows of {row_bytes} bytes after the {SHARD_HEADER_BYTES}-byte header)")
        with open(path, "rb") as handle:
            mm = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        rows = np.ndarray((hi - lo, row_bytes), dtype=np.uint8, buffer=mm, offset=SHARD_HEADER_BYTES)
        source = _RowSource(rows[:, : constants.head_dim], rows[:, constants.head_dim:], "fp8", base=lo,
                            keepalive=mm)
        return cls(layer_id, constants, source, rank, world, where=str(path))

    @classmethod
    def from_tensors(cls, weight: torch.Tensor, scale: torch.Tensor | None, layer_id: int, config,
                     rank: int = 0, world: int = 1, constants: EngramConstants | None = None) -> "EngramTable":
        """From in-memory tensors (a whole table): float rows, or FP8 e4m3 rows + UE8M0 `[rows, head_dim/32]`."""
        constants = constants or EngramConstants.from_config(config)
        rows = constants.num_rows[constants.layer_index(layer_id)]
        where = f"layers.{layer_id}.engram.embed.weight"
        if list(weight.shape) != [rows, constants.head_dim]:
            raise CheckpointError(f"tensor {where} has shape {list(weight.shape)}, expected "
                                  f"{[rows, constants.head_dim]}")
        weight = weight.detach().cpu().contiguous()
        if weight.element_size() == 1:
            if scale is None:
                raise CheckpointError(f"tensor {where} is FP8 but layers.{layer_id}.engram.embed.scale is missing")
            want = [rows, -(-constants.head_dim // ROW_SCALE_BLOCK)]
            if list(scale.shape) != want:
                raise CheckpointError(f"tensor layers.{layer_id}.engram.embed.scale has shape {list(scale.shape)}, "
                                      f"expected {want}")
            source = _RowSource(weight.view(torch.uint8).numpy(), scale.detach().cpu().contiguous()
                                .view(torch.uint8).numpy(), "fp8", base=0)
        elif weight.dtype == torch.bfloat16:
            source = _RowSource(weight.view(torch.int16).numpy().view(np.uint16), None, "bf16", base=0)
        else:
            source = _RowSource(weight.float().numpy(), None, "f32", base=0)
        return cls(layer_id, constants, source, rank, world, where=where)

    # --- lookup -----------------------------------------------------------------------------------------------
    def gather(self, row_ids: torch.Tensor) -> torch.Tensor:
        """Rows for this rank's hash columns: `row_ids` `[T, n_cols]` (all columns, as the hasher gives them)
        or `[T, c1-c0]` (already restricted) -> float32 `[T, c1-c0, head_dim]`."""
        c0, c1 = self.cols
        row_ids = torch.as_tensor(row_ids, dtype=torch.int64).cpu()
        if row_ids.shape[-1] == self.constants.n_cols and (c1 - c0) != self.constants.n_cols:
            row_ids = row_ids[..., c0:c1]
        if row_ids.shape[-1] != c1 - c0:
            raise ValueError(f"row ids have {row_ids.shape[-1]} columns, expected {self.constants.n_cols} or {c1 - c0}")
        if row_ids.numel() and (int(row_ids.min()) < self.lo or int(row_ids.max()) >= self.hi):
            raise ValueError(f"{self.where}: row id outside this rank's rows [{self.lo}, {self.hi})")
        flat = (row_ids.reshape(-1) - self._source.base).numpy()
        return self._source.read(flat).reshape(*row_ids.shape, self.head_dim)


def _tensor_lookup(source) -> Callable[[str], "TensorInfo"]:
    """name -> validated TensorInfo, for a Checkpoint, a checkpoint folder or a single .safetensors file."""
    if isinstance(source, (str, Path)) and Path(source).is_file():
        infos, _ = read_header(Path(source))

        def lookup(name: str) -> TensorInfo:
            if name not in infos:
                raise CheckpointError(f"{source}: tensor {name} is missing")
            return infos[name]

        return lookup
    ckpt = source if isinstance(source, Checkpoint) else Checkpoint(source)
    return ckpt.info


def _check_shape(info: "TensorInfo", want: list[int]) -> None:
    if list(info.shape) != want:
        raise CheckpointError(f"{info.file}: tensor {info.name} has shape {list(info.shape)}, expected {want}")


def _map_rows(info: "TensorInfo", np_dtype) -> tuple[np.ndarray, mmap.mmap]:
    """A read-only [rows, cols] view of the tensor's bytes; pages are read only when rows are gathered."""
    try:
        with open(info.file, "rb") as handle:
            mm = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as exc:
        raise CheckpointError(f"{info.file}: cannot open ({exc.strerror})") from None
    return np.ndarray(info.shape, dtype=np_dtype, buffer=mm, offset=info.offset), mm


def read_shard_header(path: str | Path) -> dict:
    """The six header fields of an Engram shard file (magic checked)."""
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            head = handle.read(_SHARD_HEADER.size)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot open Engram shard ({exc.strerror})") from None
    if len(head) < _SHARD_HEADER.size:
        raise CheckpointError(f"{path}: truncated Engram shard header ({len(head)} bytes)")
    magic, layer, lo, hi, total, row_bytes = _SHARD_HEADER.unpack(head)
    if magic != SHARD_MAGIC:
        raise CheckpointError(f"{path}: not an Engram shard file (magic {magic:#018x}, expected {SHARD_MAGIC:#018x})")
    return {"layer": layer, "lo": lo, "hi": hi, "total rows": total, "row bytes": row_bytes}


def quantize_rows_fp8(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float `[n, head_dim]` -> (uint8 e4m3 bytes `[n, head_dim]`, uint8 UE8M0 `[n, ceil(head_dim/32)]`),
    one power-of-two scale per 32 values of a row (the release's Engram table format)."""
    rows = rows.float()
    n, dim = rows.shape
    n_blocks = -(-dim // ROW_SCALE_BLOCK)
    padded = torch.zeros(n, n_blocks * ROW_SCALE_BLOCK)
    padded[:, :dim] = rows.abs()
    scale_bytes = power_of_two_scale_byte(padded.view(n, n_blocks, ROW_SCALE_BLOCK).amax(-1), FP8_MAX)
    scales = e8m0_to_float(scale_bytes).repeat_interleave(ROW_SCALE_BLOCK, dim=1)[:, :dim]
    values = (rows / scales).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return values, scale_bytes


def write_engram_shard(path: str | Path, layer_id: int, lo: int, hi: int, total_rows: int,
                       values: np.ndarray | torch.Tensor, scales: np.ndarray | torch.Tensor,
                       chunk_rows: int = 1 << 18) -> None:
    """Write one shard file: header, then rows `[lo, hi)` of `values` (e4m3 bytes `[total_rows, head_dim]`) and
    `scales` (UE8M0 bytes `[total_rows, head_dim/32]`), each row's values followed by its scales.

    `values`/`scales` may be memory-mapped: they are copied in chunks, never materialised whole.
    """
    values = values.view(torch.uint8).numpy() if isinstance(values, torch.Tensor) else values
    scales = scales.view(torch.uint8).numpy() if isinstance(scales, torch.Tensor) else scales
    head_dim = values.shape[1]
    row_bytes = head_dim + scales.shape[1]
    if scales.shape[1] != -(-head_dim // ROW_SCALE_BLOCK) or values.shape[0] != scales.shape[0]:
        raise ValueError(f"values {values.shape} and scales {scales.shape} do not form FP8 Engram rows")
    if not 0 <= lo <= hi <= values.shape[0]:
        raise ValueError(f"rows [{lo}, {hi}) outside a table of {values.shape[0]} rows")
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as out:
        header = _SHARD_HEADER.pack(SHARD_MAGIC, layer_id, lo, hi, total_rows, row_bytes)
        out.write(header + bytes(SHARD_HEADER_BYTES - len(header)))
        for start in range(lo, hi, chunk_rows):
            stop = min(start + chunk_rows, hi)
            block = np.empty((stop - start, row_bytes), dtype=np.uint8)
            block[:, :head_dim] = values[start:stop]
            block[:, head_dim:] = scales[start:stop]
            out.write(block.tobytes())
    os.replace(tmp, path)


def write_engram_shards(out_dir: str | Path, layer_id: int, values, scales, config, world: int,
                        constants: EngramConstants | None = None) -> list[Path]:
    """Split one layer's FP8 table into the `world` rank files of EXL3-ENGRAM.md §5.3/§5.4; returns the paths."""
    constants = constants or EngramConstants.from_config(config)
    total = constants.num_rows[constants.layer_index(layer_id)]
    if values.shape[0] != total:
        raise ValueError(f"layer {layer_id} table has {values.shape[0]} rows, expected {total}")
    paths = []
    for rank in range(world):
        lo, hi = constants.row_range(layer_id, *head_shard(constants.n_cols, rank, world))
        path = Path(out_dir) / shard_file_name(layer_id, rank, world)
        write_engram_shard(path, layer_id, lo, hi, total, values, scales)
        paths.append(path)
    return paths


# ==============================================================================================================
# 4. the module forward (MODEL.md §9.4)
# ==============================================================================================================


def engram_wkv_input_range(head_dim: int, n_cols: int, rank: int, world: int) -> tuple[int, int]:
    """`wkv` input features `[start, end)` a rank multiplies (row-parallel): its hash columns' rows."""
    c0, c1 = head_shard(n_cols, rank, world)
    return c0 * head_dim, c1 * head_dim


def engram_project(rows: torch.Tensor, wkv: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype
                   ) -> torch.Tensor:
    """Gathered rows `[T, cols, head_dim]` -> `kv` (or this rank's partial of it) `[T, (hc+1)·d]`.

    The rows go in at the streams' dtype, as in the release (dequantised FP8 rows are exact in bf16).
    """
    return wkv(rows.reshape(rows.shape[0], -1).to(dtype))


def engram_gate(streams: torch.Tensor, key: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                eps: float) -> torch.Tensor:
    """fp32 gate `[T, hc]`: sigmoid(signed sqrt of the RMS-normalised, q⊙k-weighted stream·key score).

    Each stream is normalised on its own (not jointly over the streams); |score| is floored at 1e-6 before
    the square root and the sign is put back afterwards.
    """
    x = streams.float()
    key = key.float()
    d = x.shape[-1]
    weight = q_weight.float() * k_weight.float()  # only their product is ever used
    rstd = f64(torch.rsqrt, x.square().mean(-1) + eps) * f64(torch.rsqrt, key.square().mean(-1) + eps)
    score = (x * weight * key).sum(-1) * rstd / math.sqrt(d)
    # copysign, not sign(): a score of exactly 0 still gets the floor (sigmoid(±1e-3), not sigmoid(0)).
    return f64(lambda z: torch.sigmoid(torch.copysign(z.abs().clamp_min(GATE_SQRT_FLOOR).sqrt(), z)), score)


def engram_mix(streams: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
               eps: float, live: torch.Tensor | None = None) -> torch.Tensor:
    """`X[c] += g_c · value` for streams `[T, hc, d]` and the full (rank-summed) `kv` `[T, (hc+1)·d]`.

    `kv` = hc keys (one per stream) then one shared value. `live` (bool `[T]`, optional) False shuts the gate
    (image-span tokens). Computed in fp32, returned in the streams' dtype.
    """
    T, hc, d = streams.shape
    if kv.shape != (T, (hc + 1) * d):
        raise ValueError(f"Engram kv has shape {list(kv.shape)}, expected {[T, (hc + 1) * d]}")
    kv = kv.float()
    key = kv[:, : hc * d].reshape(T, hc, d)
    value = kv[:, hc * d:]
    gate = engram_gate(streams, key, q_weight, k_weight, eps)
    if live is not None:
        gate = gate * live.to(gate.device).reshape(T, 1).float()
    out = streams.float() + gate[..., None] * value[:, None, :]
    return out.to(streams.dtype)


class EngramLayer:
    """The Engram in front of one layer, for one rank: table rows -> wkv (row-parallel) -> sum -> gate -> add.

    `wkv` is this rank's slice of `layers.{L}.engram.wkv`: input features `wkv_input_range` of the full
    `[ (hc+1)·d, n_cols·head_dim ]` weight. `sum_partials` adds the ranks' partial `kv` (identity at TP=1,
    `Comm.sum_partials` otherwise).
    """

    def __init__(self, layer_id: int, table: EngramTable, wkv: Callable[[torch.Tensor], torch.Tensor],
                 q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                 sum_partials: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.layer_id = layer_id
        self.table = table
        self.wkv = wkv
        self.q_weight, self.k_weight = q_weight, k_weight
        self.eps = eps
        self.sum_partials = sum_partials or (lambda x: x)

    @property
    def cols(self) -> tuple[int, int]:
        return self.table.cols

    @property
    def wkv_input_range(self) -> tuple[int, int]:
        c0, c1 = self.table.cols
        return c0 * self.table.head_dim, c1 * self.table.head_dim

    def forward(self, streams: torch.Tensor, row_ids: torch.Tensor, live: torch.Tensor | None = None
                ) -> torch.Tensor:
        """streams `[T, hc, d]`, this layer's row ids `[T, n_cols]` -> updated streams."""
        rows = self.table.gather(row_ids).to(streams.device)
        kv = self.sum_partials(engram_project(rows, self.wkv, streams.dtype))
        return engram_mix(streams, kv, self.q_weight.to(streams.device), self.k_weight.to(streams.device),
                          self.eps, live)

    __call__ = forward
