"""Engram hash constants and row ids (MODEL.md §9.2-9.3, §15b.1, EXL3-ENGRAM.md §5.3).

Per position, the table row ids of the 2..N-grams ending there: odd multipliers per look-back distance, one
prime bucket per (layer, n-gram order, head), offsets that lay the buckets of a layer end to end, and a
per-sequence look-back carried across chunks. `head_shard` is the tensor-parallel split of a layer's hash
columns: contiguous blocks, one per rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dsv41.errors import ConfigError, TokenizerError

from .token_map import build_compressed_token_map

# A look-back slot that no n-gram may reach across: before the sequence start, or an image-span token.
DEAD = -1

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
        """Row ids `[T, n_layers, n_cols]` (int64, on the CPU, whatever the token ids' device) for a chunk of one
        sequence; updates `history` in place.

        `history=None` hashes the chunk as the start of a sequence. `dead` (bool `[T]`) marks extra DEAD
        positions; image tokens (`image_token_id`) are always DEAD.
        """
        return self.hash_many([(token_ids, history, dead)])

    def hash_many(self, chunks) -> torch.Tensor:
        """`hash` of several sequences' chunks in one pass: `chunks` of `(token_ids, history)` or `(token_ids,
        history, dead)`; row ids `[sum T, n_layers, n_cols]`, each chunk's rows in turn, the ids one `hash` call
        per chunk gives (each history updated in place). A decode step of many sequences pays the numpy ops once,
        not once a sequence (this runs on the host before every step's graph)."""
        c = self.constants
        tmap, mult, primes, offsets = self._arrays()
        back = c.max_ngram - 1
        items = [tuple(item) + (None,) * (3 - len(item)) for item in chunks]
        ids = [torch.as_tensor(t, dtype=torch.int64).reshape(-1).cpu().numpy() for t, _, _ in items]
        every = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
        if every.size and (int(every.min()) < 0 or int(every.max()) >= tmap.size):
            raise ValueError(f"token id outside the vocabulary of {tmap.size}")
        compressed = tmap[every]
        is_dead = every == self.image_token_id if self.image_token_id is not None else np.zeros(every.shape, bool)
        at = 0
        for (_, _, dead), chunk in zip(items, ids):
            if dead is not None:
                mark = torch.as_tensor(dead).to(device="cpu", dtype=torch.bool).reshape(-1).numpy()
                is_dead[at:at + chunk.size] |= mark
            at += chunk.size
        compressed = np.where(is_dead, DEAD, compressed)

        # one array of every chunk behind its look-back: [history_0, chunk_0, history_1, chunk_1, ...]
        pieces, rows, at, start = [], [], 0, 0
        for (_, history, _), chunk in zip(items, ids):
            past = (history.ids.numpy() if history is not None else np.full(back, DEAD, dtype=np.int64))
            here = compressed[at:at + chunk.size]
            pieces += [past, here]
            rows.append(np.arange(start + back, start + back + chunk.size))
            if history is not None:
                history.ids = torch.from_numpy(np.concatenate([past, here])[-back:].copy())
            at += chunk.size
            start += back + chunk.size
        seq = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
        where = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)

        # tokens[:, s] = compressed id s positions back, pad once blocked (cumulatively along s)
        source = seq[where[:, None] - np.arange(c.max_ngram)[None, :]]  # [R, max_ngram]
        blocked = np.logical_or.accumulate(source == DEAD, axis=1)
        tokens = np.where(blocked, self.pad_id, source)

        products = tokens[:, None, :] * mult[None, :, :]  # [R, n_layers, max_ngram]; cannot overflow
        rolling = products[..., 0]
        columns = []
        for k in range(1, c.max_ngram):
            rolling = rolling ^ products[..., k]
            columns.append(np.remainder(rolling[..., None], primes[None, :, k - 1, :]))  # floor modulo
        return torch.from_numpy(np.concatenate(columns, axis=-1) + offsets[None])

    def _arrays(self):
        """numpy views of the token map and the constants (made once)."""
        if getattr(self, "_np", None) is None:
            c = self.constants
            self._np = tuple(np.ascontiguousarray(t.numpy()) for t in (self.token_map, c.multipliers, c.primes,
                                                                         c.offsets))
        return self._np

