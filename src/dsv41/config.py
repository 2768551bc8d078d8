"""Model configuration: parse config.json in its release spellings and derive every layer's role.

Three spellings are accepted:
- the release's composite HF file (`model_type: deepseek_v41`, fields nested under `text_config`),
- a plain text config (the same field names at top level),
- the flat `inference/config.json` (`dim`, `n_layers`, `window_size`, ...), mapped onto the HF names.
`quantization_config` (fp8 release or the EXL3 pack) is kept as a `QuantConfig`.

Layer roles (SWA-only, KV source, reuse, reindex, candidate source, Engram, DSpark) are derived from the
config lists, never from hard-coded layer numbers (MODEL.md §2, pitfall 1).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError

# inference/config.json name -> HF text_config name
_FLAT_NAMES = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "moe_inter_dim": "moe_intermediate_size",
    "n_mtp_layers": "num_nextn_predict_layers",
    "n_heads": "num_attention_heads",
    "n_activated_experts": "num_experts_per_tok",
    "score_func": "scoring_func",
    "route_scale": "routed_scaling_factor",
    "rope_head_dim": "qk_rope_head_dim",
    "norm_eps": "rms_norm_eps",
    "window_size": "sliding_window",
    "kv_source_layers": "kv_source_layer_ids",
    "index_source_layers": "index_source_layer_ids",
    "candidate_source_layer": "candidate_source_layer_id",
    "engram_pad_id": "engram_pad_token_id",
    "dspark_n_activated_experts": "dspark_num_experts_per_tok",
}


@dataclass(frozen=True)
class QuantConfig:
    """`quantization_config` of the checkpoint: `fp8` (release) or `exl3` (the EXL3 pack)."""

    method: str
    raw: dict = field(default_factory=dict)

    @property
    def is_exl3(self) -> bool:
        return self.method == "exl3"


@dataclass(frozen=True)
class LayerRole:
    """What one attention layer does. `index` counts backbone layers 0.., then DSpark blocks after them."""

    index: int
    compress_ratio: int
    kv_source: int | None  # layer whose compressed KV this layer reads (itself when it compresses)
    index_source: int | None  # layer whose top-k this layer uses (itself when it scores)
    is_candidate_source: bool = False
    uses_candidates: bool = False  # re-scores only inside the candidate source's block pool
    is_dspark: bool = False

    @property
    def swa_only(self) -> bool:
        return self.compress_ratio == 0

    @property
    def compresses(self) -> bool:
        """Owns a compressor and writes the shared compressed KV (and index keys)."""
        return self.kv_source == self.index and not self.swa_only

    @property
    def scores(self) -> bool:
        """Runs the lightning indexer with its own query (Full or Reindex)."""
        return self.index_source == self.index and not self.swa_only

    @property
    def mode(self) -> str:
        if self.swa_only:
            return "swa"
        if self.compresses:
            return "full"
        return "reindex" if self.scores else "reuse"

    @property
    def rope_kind(self) -> str:
        """`plain` (rope_theta, no YaRN) for ratio-0 layers and DSpark blocks; `compress` otherwise."""
        return "plain" if self.swa_only else "compress"


def _get(d: dict, name: str, kind: type | tuple, *, default: Any = ..., where: str = "text_config") -> Any:
    if name not in d or d[name] is None:
        if default is ...:
            raise ConfigError(f"config.json: missing field {where}.{name}")
        return default
    v = d[name]
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    if isinstance(v, bool) and kind is not bool:
        raise ConfigError(f"config.json: field {where}.{name} must be {_kind_name(kind)}, got {v!r}")
    if not isinstance(v, kind):
        raise ConfigError(f"config.json: field {where}.{name} must be {_kind_name(kind)}, got {v!r}")
    return v


def _kind_name(kind) -> str:
    if isinstance(kind, tuple):
        return " or ".join(k.__name__ for k in kind)
    return {"int": "an integer", "float": "a number", "list": "a list", "str": "a string",
            "bool": "a boolean", "dict": "an object"}.get(kind.__name__, kind.__name__)


def _int_list(d: dict, name: str, *, default: Any = ...) -> list[int]:
    v = _get(d, name, list, default=default)
    if v is default and default is not ...:
        return v
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise ConfigError(f"config.json: field text_config.{name} must be a list of integers, got {v!r}")
    return list(v)


def _positive(name: str, v: int | float) -> None:
    if v <= 0:
        raise ConfigError(f"config.json: field text_config.{name} must be positive, got {v!r}")


@dataclass(frozen=True)
class ModelConfig:
    # core sizes
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    swiglu_limit: float
    rms_norm_eps: float
    max_position_embeddings: int
    # rope
    rope_theta: float
    compress_rope_theta: float
    yarn_factor: float
    yarn_beta_fast: float
    yarn_beta_slow: float
    yarn_original_max_position: int
    # moe
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    # attention / CSA2
    sliding_window: int
    compress_ratios: tuple[int, ...]
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    candidate_source_layer_id: int | None
    candidate_topk_blocks: int
    candidate_block_size: int
    # mHC
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    # Engram
    engram_layer_ids: tuple[int, ...]
    engram_num_embeddings: tuple[int, ...]
    engram_max_ngram_size: int
    engram_vocab_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_pad_token_id: int
    engram_compressed_vocab_size: int
    # DSpark
    num_nextn_predict_layers: int
    dspark_block_size: int
    dspark_noise_token_id: int | None
    dspark_target_layer_ids: tuple[int, ...]
    dspark_markov_rank: int
    dspark_n_routed_experts: int
    dspark_num_experts_per_tok: int
    # misc
    image_token_id: int | None
    bos_token_id: int | None
    eos_token_id: int | None
    gate_temp: float = 1.0
    quant: QuantConfig | None = None
    roles: tuple[LayerRole, ...] = ()

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"config.json not found: {path}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: top level must be a JSON object")
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        top = raw
        if "text_config" in raw:
            text = raw["text_config"]
            if not isinstance(text, dict):
                raise ConfigError("config.json: field text_config must be an object")
            # top-level housekeeping (image_token_id, quantization_config, ...) fills gaps of text_config
            text = {**{k: v for k, v in raw.items() if k not in ("text_config", "vision_config")}, **text}
        else:
            text = dict(raw)
        text = _unflatten(text)
        quant = _parse_quant(top.get("quantization_config", text.get("quantization_config")))

        t = text
        rs = _get(t, "rope_scaling", dict, default={})
        n_layers = _get(t, "num_hidden_layers", int)
        n_mtp = _get(t, "num_nextn_predict_layers", int, default=0)
        ratios = _int_list(t, "compress_ratios")
        if len(ratios) < n_layers:
            raise ConfigError(
                f"config.json: field text_config.compress_ratios has {len(ratios)} entries, expected at least "
                f"num_hidden_layers ({n_layers})")
        # entries past the backbone describe draft blocks (the release lists 40 + 3); absent ones are ratio 0
        ratios = (ratios + [0] * n_mtp)[:n_layers + n_mtp]
        for i, r in enumerate(ratios):
            if r < 0:
                raise ConfigError(f"config.json: field text_config.compress_ratios[{i}] = {r} is not a ratio")
        if any(r != 0 for r in ratios[n_layers:]):
            raise ConfigError("config.json: field text_config.compress_ratios: DSpark blocks must have ratio 0")

        kv_sources = _int_list(t, "kv_source_layer_ids", default=None)
        if kv_sources is None:
            kv_sources = _derive_kv_sources(ratios[:n_layers])
        index_sources = _int_list(t, "index_source_layer_ids", default=None)
        if index_sources is None:
            index_sources = list(kv_sources)
        cand = _get(t, "candidate_source_layer_id", int, default=None)
        if cand is None and _get(t, "candidate_topk_blocks", int, default=0) > 0:
            # HF's rule without an explicit id: the first ratio-1 KV source publishes the candidate blocks
            cand = next((s for s in kv_sources if ratios[s] == 1), None)

        engram_ids = _int_list(t, "engram_layer_ids", default=[])
        has_engram = bool(engram_ids)
        need_engram = ... if has_engram else 0

        cfg = cls(
            vocab_size=_get(t, "vocab_size", int),
            hidden_size=_get(t, "hidden_size", int),
            moe_intermediate_size=_get(t, "moe_intermediate_size", int),
            num_hidden_layers=n_layers,
            num_attention_heads=_get(t, "num_attention_heads", int),
            num_key_value_heads=_get(t, "num_key_value_heads", int, default=1),
            head_dim=_get(t, "head_dim", int),
            qk_rope_head_dim=_get(t, "qk_rope_head_dim", int),
            q_lora_rank=_get(t, "q_lora_rank", int),
            o_lora_rank=_get(t, "o_lora_rank", int),
            o_groups=_get(t, "o_groups", int),
            swiglu_limit=_get(t, "swiglu_limit", float, default=10.0),
            rms_norm_eps=_get(t, "rms_norm_eps", float),
            max_position_embeddings=_get(t, "max_position_embeddings", int, default=1 << 20),
            rope_theta=_get(t, "rope_theta", float),
            compress_rope_theta=_get(t, "compress_rope_theta", float),
            yarn_factor=_get(rs, "factor", float, default=1.0, where="rope_scaling"),
            yarn_beta_fast=_get(rs, "beta_fast", float, default=32.0, where="rope_scaling"),
            yarn_beta_slow=_get(rs, "beta_slow", float, default=1.0, where="rope_scaling"),
            yarn_original_max_position=_get(rs, "original_max_position_embeddings", int, default=0,
                                            where="rope_scaling"),
            n_routed_experts=_get(t, "n_routed_experts", int),
            n_shared_experts=_get(t, "n_shared_experts", int, default=1),
            num_experts_per_tok=_get(t, "num_experts_per_tok", int),
            scoring_func=_get(t, "scoring_func", str, default="sqrtsoftplus"),
            norm_topk_prob=_get(t, "norm_topk_prob", bool, default=True),
            routed_scaling_factor=_get(t, "routed_scaling_factor", float, default=1.0),
            sliding_window=_get(t, "sliding_window", int),
            compress_ratios=tuple(ratios),
            kv_source_layer_ids=tuple(kv_sources),
            index_source_layer_ids=tuple(index_sources),
            index_n_heads=_get(t, "index_n_heads", int),
            index_head_dim=_get(t, "index_head_dim", int),
            index_topk=_get(t, "index_topk", int),
            candidate_source_layer_id=cand,
            candidate_topk_blocks=_get(t, "candidate_topk_blocks", int, default=0 if cand is None else ...),
            candidate_block_size=_get(t, "candidate_block_size", int, default=1 if cand is None else ...),
            hc_mult=_get(t, "hc_mult", int),
            hc_sinkhorn_iters=_get(t, "hc_sinkhorn_iters", int),
            hc_eps=_get(t, "hc_eps", float),
            engram_layer_ids=tuple(engram_ids),
            engram_num_embeddings=tuple(_int_list(t, "engram_num_embeddings", default=[] if not has_engram else ...)),
            engram_max_ngram_size=_get(t, "engram_max_ngram_size", int, default=need_engram),
            engram_vocab_size=_get(t, "engram_vocab_size", int, default=need_engram),
            engram_n_heads=_get(t, "engram_n_heads", int, default=need_engram),
            engram_head_dim=_get(t, "engram_head_dim", int, default=need_engram),
            engram_pad_token_id=_get(t, "engram_pad_token_id", int, default=need_engram),
            engram_compressed_vocab_size=_get(t, "engram_compressed_vocab_size", int, default=need_engram),
            num_nextn_predict_layers=n_mtp,
            dspark_block_size=_get(t, "dspark_block_size", int, default=... if n_mtp else 0),
            dspark_noise_token_id=_get(t, "dspark_noise_token_id", int, default=... if n_mtp else None),
            dspark_target_layer_ids=tuple(_int_list(t, "dspark_target_layer_ids", default=... if n_mtp else [])),
            dspark_markov_rank=_get(t, "dspark_markov_rank", int, default=... if n_mtp else 0),
            dspark_n_routed_experts=_get(t, "dspark_n_routed_experts", int, default=... if n_mtp else 0),
            dspark_num_experts_per_tok=_get(t, "dspark_num_experts_per_tok", int, default=... if n_mtp else 0),
            image_token_id=_get(t, "image_token_id", int, default=None),
            bos_token_id=_get(t, "bos_token_id", int, default=None),
            eos_token_id=_first_id(_get(t, "eos_token_id", (int, list), default=None)),
            gate_temp=_get(t, "gate_temp", float, default=1.0),
            quant=quant,
        )
        cfg._validate()
        object.__setattr__(cfg, "roles", tuple(_derive_roles(cfg)))
        return cfg

    # ------------------------------------------------------------------ checks
    def _validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "head_dim", "qk_rope_head_dim", "q_lora_rank", "o_lora_rank",
                     "o_groups", "n_routed_experts", "num_experts_per_tok", "sliding_window", "index_n_heads",
                     "index_head_dim", "index_topk", "hc_mult", "hc_sinkhorn_iters", "rope_theta",
                     "compress_rope_theta"):
            _positive(name, getattr(self, name))
        if self.num_key_value_heads != 1:
            raise ConfigError("config.json: field text_config.num_key_value_heads must be 1 (one shared K = V latent)")
        if self.qk_rope_head_dim > self.head_dim or self.qk_rope_head_dim % 2:
            raise ConfigError("config.json: field text_config.qk_rope_head_dim must be even and <= head_dim")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ConfigError("config.json: field text_config.index_head_dim must be >= qk_rope_head_dim")
        if self.num_attention_heads % self.o_groups:
            raise ConfigError("config.json: field text_config.o_groups must divide num_attention_heads")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError("config.json: field text_config.num_experts_per_tok exceeds n_routed_experts")
        if self.scoring_func != "sqrtsoftplus":  # the only router V4.1 has (MODEL.md §8)
            raise ConfigError(f"config.json: field text_config.scoring_func: unknown value {self.scoring_func!r}")
        n = self.num_hidden_layers
        for name in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids"):
            for x in getattr(self, name):
                if not 0 <= x < n:
                    raise ConfigError(f"config.json: field text_config.{name} has layer {x} outside 0..{n - 1}")
        for s in self.kv_source_layer_ids:
            if self.compress_ratios[s] == 0:
                raise ConfigError(f"config.json: field text_config.kv_source_layer_ids: layer {s} has "
                                  "compress ratio 0 and cannot be a KV source")
        if self.candidate_source_layer_id is not None:
            c = self.candidate_source_layer_id
            if c not in self.index_source_layer_ids:
                raise ConfigError("config.json: field text_config.candidate_source_layer_id must be an index source")
            _positive("candidate_topk_blocks", self.candidate_topk_blocks)
            _positive("candidate_block_size", self.candidate_block_size)
        if self.engram_layer_ids:
            if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
                raise ConfigError("config.json: field text_config.engram_num_embeddings must have one entry per "
                                  "engram layer")
            for name in ("engram_max_ngram_size", "engram_vocab_size", "engram_n_heads", "engram_head_dim",
                         "engram_compressed_vocab_size"):
                _positive(name, getattr(self, name))
            if self.engram_max_ngram_size < 2:
                raise ConfigError("config.json: field text_config.engram_max_ngram_size must be >= 2")
        if self.num_nextn_predict_layers:
            for name in ("dspark_block_size", "dspark_markov_rank", "dspark_n_routed_experts",
                         "dspark_num_experts_per_tok"):
                _positive(name, getattr(self, name))
            for x in self.dspark_target_layer_ids:
                if not 0 <= x < n:
                    raise ConfigError(f"config.json: field text_config.dspark_target_layer_ids has layer {x} "
                                      f"outside 0..{n - 1}")

    # ------------------------------------------------------------------ derived
    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.o_groups

    @property
    def engram_cols(self) -> int:
        """Hash columns per Engram layer: (max_ngram - 1) orders x heads."""
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads if self.engram_layer_ids else 0

    @property
    def n_dspark(self) -> int:
        return self.num_nextn_predict_layers

    def role(self, layer: int) -> LayerRole:
        return self.roles[layer]

    def yarn_range(self) -> tuple[int, int]:
        """(low, high) of the YaRN ramp for the compress rope table (MODEL.md §7.1)."""
        dim = self.qk_rope_head_dim
        base = self.compress_rope_theta
        orig = self.yarn_original_max_position

        def corr(rot: float) -> float:
            return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corr(self.yarn_beta_fast)), 0)
        high = min(math.ceil(corr(self.yarn_beta_slow)), dim - 1)
        return low, high


# names that mean the same field in different exports; the first spelling is the one used here
_ALIASES = {"engram_pad_id": "engram_pad_token_id"}


def _unflatten(t: dict) -> dict:
    """Map flat inference/config.json names and known aliases onto the HF names (HF names win when both exist)."""
    out = dict(t)
    for alias, name in _ALIASES.items():
        if alias in t and name not in t:
            out[name] = t[alias]
    if "dim" not in t and "n_layers" not in t:
        return out
    for flat, hf in _FLAT_NAMES.items():
        if flat in t and hf not in t:
            out[hf] = t[flat]
    if "rope_scaling" not in t and "rope_factor" in t:
        out["rope_scaling"] = {
            "rope_type": "yarn",
            "factor": t["rope_factor"],
            "beta_fast": t.get("beta_fast", 32),
            "beta_slow": t.get("beta_slow", 1),
            "original_max_position_embeddings": t.get("original_seq_len", 0),
        }
    if "max_position_embeddings" not in out and "original_seq_len" in t and "rope_factor" in t:
        out["max_position_embeddings"] = int(t["original_seq_len"] * t["rope_factor"])
    return out


def _first_id(v: int | list | None) -> int | None:
    """eos_token_id may be a list in HF configs; the first entry is the one that ends a reply."""
    if isinstance(v, list):
        return v[0] if v else None
    return v


def _parse_quant(q: Any) -> QuantConfig | None:
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ConfigError("config.json: field quantization_config must be an object")
    method = q.get("quant_method")
    if method not in ("fp8", "exl3"):
        raise ConfigError(f"config.json: field quantization_config.quant_method must be 'fp8' or 'exl3', "
                          f"got {method!r}")
    if method == "exl3":
        bits = q.get("bits")
        if bits is not None and (isinstance(bits, bool) or not isinstance(bits, (int, float)) or bits <= 0):
            raise ConfigError(f"config.json: field quantization_config.bits must be a positive number, got {bits!r}")
    return QuantConfig(method=method, raw=dict(q))


def _derive_kv_sources(ratios: list[int]) -> list[int]:
    """Without an explicit list: the first layer of each run of equal non-zero ratios (HF's rule)."""
    out, prev = [], 0
    for i, r in enumerate(ratios):
        if r and r != prev:
            out.append(i)
        prev = r
    return out


def _latest(sources: tuple[int, ...], layer: int) -> int | None:
    before = [s for s in sources if s <= layer]
    return max(before) if before else None


def _derive_roles(cfg: ModelConfig) -> list[LayerRole]:
    roles = []
    cand = cfg.candidate_source_layer_id
    n = cfg.num_hidden_layers
    for layer in range(n + cfg.num_nextn_predict_layers):
        ratio = cfg.compress_ratios[layer]
        if layer >= n or ratio == 0:
            roles.append(LayerRole(layer, 0, None, None, is_dspark=layer >= n))
            continue
        kv = _latest(cfg.kv_source_layer_ids, layer)
        ix = _latest(cfg.index_source_layer_ids, layer)
        if kv is None:
            raise ConfigError(f"config.json: layer {layer} has compress ratio {ratio} but no KV source at or "
                              "before it (kv_source_layer_ids)")
        if ix is None:
            raise ConfigError(f"config.json: layer {layer} has compress ratio {ratio} but no index source at or "
                              "before it (index_source_layer_ids)")
        if cfg.compress_ratios[kv] != ratio:
            raise ConfigError(f"config.json: layer {layer} (ratio {ratio}) reads KV source {kv} of ratio "
                              f"{cfg.compress_ratios[kv]}")
        uses_candidates = (cand is not None and ix == layer and layer > cand
                           and kv == _latest(cfg.kv_source_layer_ids, cand) and layer not in cfg.kv_source_layer_ids)
        roles.append(LayerRole(layer, ratio, kv, ix, is_candidate_source=(layer == cand),
                               uses_candidates=uses_candidates))
    return roles
