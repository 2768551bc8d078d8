"""Engram (dsv41.model.engram): token map, hash constants and ids, tables and shard files, module math.

Expected values come from MODEL.md §9 / EXL3-ENGRAM.md §5 (release constants), from the oracle fixture (made by
the transformers implementation), or from straightforward restatements written here.
"""

import json
import math
import os
import struct
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models

from dsv41.config import ModelConfig
from dsv41.errors import CheckpointError, ConfigError, TokenizerError
from dsv41.engram.tables import (
    EngramConstants,
    EngramHasher,
    EngramLayer,
    EngramTable,
    build_compressed_token_map,
    engram_gate,
    engram_mix,
    engram_wkv_input_range,
    head_shard,
    quantize_rows_fp8,
    read_shard_header,
    shard_file_name,
    write_engram_shard,
    write_engram_shards,
)
from dsv41.tokenizer import Tokenizer

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
ORACLE = SHARED / "fixtures" / "oracle-tiny-a"

RELEASE = SimpleNamespace(
    engram_layer_ids=[1, 14], engram_max_ngram_size=4, engram_vocab_size=16_000_000, engram_n_heads=8,
    engram_head_dim=256, engram_compressed_vocab_size=99092, engram_num_embeddings=[384006168, 384016682],
)


@pytest.fixture(scope="module")
def cfg():
    return ModelConfig.from_file(ORACLE / "config.json")


@pytest.fixture(scope="module")
def fixture_hashes():
    return load_file(ORACLE / "engram_hashes.safetensors")


@pytest.fixture(scope="module")
def input_ids():
    return json.loads((ORACLE / "inputs.json").read_text())["input_ids"][0]


@pytest.fixture(scope="module")
def hasher(cfg):
    return EngramHasher.from_tokenizer(cfg, Tokenizer.from_dir(ORACLE))


@pytest.fixture(scope="module")
def weights():
    return load_file(ORACLE / "model.safetensors")


def trial_division_is_prime(n):
    return n > 1 and all(n % d for d in range(2, math.isqrt(n) + 1))


# --- release constants (MODEL.md §9.2, EXL3-ENGRAM.md §5.3) --------------------------------------------------------


def test_release_multipliers():
    c = EngramConstants.from_config(RELEASE)
    assert c.multipliers.tolist() == [
        [76632096046245, 4839876093313, 35959672319349, 73987337458391],
        [67716810739261, 51510806800915, 30921347202721, 82619226485591],
    ]


def test_release_primes():
    c = EngramConstants.from_config(RELEASE)
    assert c.num_rows == (384006168, 384016682)
    assert [int(s) for s in c.primes.flatten(1).sum(1)] == [384006168, 384016682]
    flat = c.primes.flatten().tolist()
    # the 48 buckets are exactly the first 48 primes above 16,000,000, in (layer, order, head) order
    expected = [n for n in range(16_000_000, 16_000_890) if trial_division_is_prime(n)]
    assert flat == expected
    assert (flat[0], flat[1], flat[2], flat[23], flat[24], flat[47]) == (
        16000057, 16000079, 16000081, 16000463, 16000477, 16000889)
    assert c.offsets[0, 0] == 0 and c.offsets[0, 1] == 16000057
    assert c.offsets[1, 23] + c.primes[1, 2, 7] == 384016682


def test_release_rank_split():
    c = EngramConstants.from_config(RELEASE)
    assert head_shard(24, 0, 2) == (0, 12) and head_shard(24, 1, 2) == (12, 24)
    assert c.row_range(1, 0, 12) == (0, 192_001_740)
    assert c.row_range(1, 12, 24) == (192_001_740, 384_006_168)
    assert c.row_range(14, 0, 12) == (0, 192_007_016)
    assert c.row_range(14, 12, 24) == (192_007_016, 384_016_682)
    assert engram_wkv_input_range(256, 24, 1, 2) == (3072, 6144)


@pytest.mark.parametrize("n_cols,world", [(24, 1), (24, 3), (24, 5), (6, 4), (6, 8), (3, 2)])
def test_head_shard_covers_every_column_once(n_cols, world):
    ranges = [head_shard(n_cols, r, world) for r in range(world)]
    covered = [c for lo, hi in ranges for c in range(lo, hi)]
    assert covered == list(range(n_cols))


def test_num_embeddings_mismatch_is_a_config_error():
    bad = SimpleNamespace(**{**vars(RELEASE), "engram_num_embeddings": [384006168, 1]})
    with pytest.raises(ConfigError, match="engram_num_embeddings"):
        EngramConstants.from_config(bad)


# --- against the oracle fixture ------------------------------------------------------------------------------------


def test_fixture_token_map(fixture_hashes, cfg):
    token_map, size = build_compressed_token_map(Tokenizer.from_dir(ORACLE))
    assert size == cfg.engram_compressed_vocab_size == 271
    assert torch.equal(token_map, fixture_hashes["token_map"])


def test_fixture_constants(fixture_hashes, cfg):
    c = EngramConstants.from_config(cfg)
    assert torch.equal(c.primes, fixture_hashes["primes"])
    assert torch.equal(c.offsets, fixture_hashes["offsets"])
    assert torch.equal(c.multipliers, fixture_hashes["multipliers"])
    assert list(c.num_rows) == list(cfg.engram_num_embeddings)


def test_fixture_hash_ids_one_shot(hasher, fixture_hashes, input_ids):
    assert torch.equal(hasher.hash(input_ids), fixture_hashes["hash_ids"])


@pytest.mark.parametrize("chunks", [[13, 16, 8] + [1] * 11, [1] * 48, [2, 46], [47, 1], [5, 0, 43]])
def test_fixture_hash_ids_chunked(hasher, fixture_hashes, input_ids, chunks):
    history, parts, start = hasher.new_history(), [], 0
    for n in chunks:
        parts.append(hasher.hash(input_ids[start:start + n], history))
        start += n
    assert torch.equal(torch.cat(parts), fixture_hashes["hash_ids"])


def test_compressed_size_mismatch_is_a_tokenizer_error(cfg):
    bad = SimpleNamespace(**{**vars(RELEASE), "engram_compressed_vocab_size": 99092, "vocab_size": 320,
                             "engram_pad_token_id": 2})
    with pytest.raises(TokenizerError, match="99092"):
        EngramHasher.from_tokenizer(bad, Tokenizer.from_dir(ORACLE))


# --- hashing rules restated by hand ----------------------------------------------------------------------------


def reference_hash(compressed, dead, constants, pad):
    """Row ids by the letter of MODEL.md §9.3, in plain Python integers."""
    out = []
    for t in range(len(compressed)):
        c, blocked = [], False
        for k in range(constants.max_ngram):
            if t - k < 0 or dead[t - k]:
                blocked = True
            c.append(pad if blocked else compressed[t - k])
        per_layer = []
        for li in range(len(constants.layer_ids)):
            mult = constants.multipliers[li].tolist()
            rolling, cols = c[0] * mult[0], []
            for k in range(1, constants.max_ngram):
                rolling ^= c[k] * mult[k]
                for h in range(constants.n_heads):
                    col = (k - 1) * constants.n_heads + h
                    cols.append(rolling % int(constants.primes[li, k - 1, h]) + int(constants.offsets[li, col]))
            per_layer.append(cols)
        out.append(per_layer)
    return torch.tensor(out, dtype=torch.int64)


def test_image_tokens_block_the_look_back(hasher, cfg, input_ids):
    ids = list(input_ids[:20])
    ids[7] = ids[8] = cfg.image_token_id  # an image span of two positions
    dead = [i == cfg.image_token_id for i in ids]
    compressed = [int(hasher.token_map[i]) for i in ids]
    expected = reference_hash(compressed, dead, hasher.constants, hasher.pad_id)
    assert torch.equal(hasher.hash(ids), expected)
    # right after the span every order is the all-pad-lookback n-gram of the current token
    after = hasher.hash([ids[9]])  # a fresh sequence starting with that token
    assert torch.equal(hasher.hash(ids)[9], after[0])
    # and the same in chunks cut inside the span
    history = hasher.new_history()
    parts = [hasher.hash(ids[:8], history), hasher.hash(ids[8:10], history), hasher.hash(ids[10:], history)]
    assert torch.equal(torch.cat(parts), expected)


def test_explicit_dead_mask(hasher, input_ids):
    ids = input_ids[:12]
    dead = torch.zeros(12, dtype=torch.bool)
    dead[5] = True
    compressed = [int(hasher.token_map[i]) for i in ids]
    expected = reference_hash(compressed, dead.tolist(), hasher.constants, hasher.pad_id)
    assert torch.equal(hasher.hash(ids, dead=dead), expected)


def test_hash_ids_stay_inside_their_buckets(hasher, input_ids):
    ids = hasher.hash(input_ids)
    c = hasher.constants
    for li in range(len(c.layer_ids)):
        lo = c.offsets[li]
        hi = lo + c.primes[li].flatten()
        assert bool(((ids[:, li] >= lo) & (ids[:, li] < hi)).all())


# --- compressed token map: the normaliser chain by hand ---------------------------------------------------------


def test_compressed_map_normaliser_rules():
    # byte-level spellings: Ġ = space, Ċ = newline, ĉ = tab, Ã© = "é" (two bytes), a lone Ã = a partial byte
    vocab = ["<s>", "ĠThe", "the", "THE", "Ġ", "ĠĠ", "Ċ", "ĉĠ", "cafÃ©", "cafe", "ĠCAFE", "Ã", "©", "Ã©", "e",
             "Ġx", "x"]
    raw = RawTokenizer(models.BPE(vocab={t: i for i, t in enumerate(vocab)}, merges=[]))
    raw.decoder = decoders.ByteLevel()
    token_map, size = build_compressed_token_map(raw)
    expected_groups = [
        ["<s>"], ["ĠThe", "the", "THE"],  # case and leading space fold
        ["Ġ", "ĠĠ", "Ċ", "ĉĠ"],  # any whitespace run is the one-space key, kept by the sentinel
        ["cafÃ©", "cafe", "ĠCAFE"],  # accents stripped
        ["Ã"], ["©"],  # partial UTF-8: keyed by the raw token string, so they stay apart
        ["Ã©", "e"], ["Ġx", "x"],
    ]
    assert size == len(expected_groups)
    for new_id, group in enumerate(expected_groups):  # ids in order of first appearance
        assert [int(token_map[vocab.index(t)]) for t in group] == [new_id] * len(group)


# --- the module math ---------------------------------------------------------------------------------------------


def restated_mix(x, kv, qw, kw, eps, live=None):
    """MODEL.md §9.4 one token and one stream at a time, in float64."""
    T, hc, d = x.shape
    x64, kv64, w = x.double(), kv.double(), (qw.double() * kw.double())
    out = x64.clone()
    for t in range(T):
        value = kv64[t, hc * d:]
        for c in range(hc):
            key = kv64[t, c * d:(c + 1) * d]
            xs = x64[t, c]
            dot = float((xs * w[c] * key).sum())
            dot /= math.sqrt(float((xs * xs).mean()) + eps) * math.sqrt(float((key * key).mean()) + eps)
            dot /= math.sqrt(d)
            root = math.sqrt(max(abs(dot), 1e-6))
            gate = 1 / (1 + math.exp(-math.copysign(root, dot)))
            if live is not None and not live[t]:
                gate = 0.0
            out[t, c] = xs + gate * value
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mix_matches_restatement(dtype):
    g = torch.Generator().manual_seed(0)
    T, hc, d = 5, 4, 64
    x = torch.randn(T, hc, d, generator=g).to(dtype)
    kv = torch.randn(T, (hc + 1) * d, generator=g)
    qw, kw = torch.randn(hc, d, generator=g), torch.randn(hc, d, generator=g)
    live = torch.tensor([True, True, False, True, True])
    out = engram_mix(x, kv, qw, kw, 1e-20, live)
    assert out.dtype == dtype
    expected = restated_mix(x.float(), kv, qw, kw, 1e-20, live.tolist())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected.to(dtype).double(), rtol=tol, atol=tol)
    assert torch.equal(out[2], x[2])  # gate shut: untouched


def test_gate_hand_cases():
    d = 4
    ones = torch.ones(1, 1, d)
    w = torch.ones(1, d)
    # score = 4 / sqrt(4) = 2 with unit RMS on both sides
    assert engram_gate(ones, ones, w, w, 1e-20).item() == pytest.approx(1 / (1 + math.exp(-math.sqrt(2))))
    # sign: the negative key gives 1 - the positive gate
    assert engram_gate(ones, -ones, w, w, 1e-20).item() == pytest.approx(1 / (1 + math.exp(math.sqrt(2))))
    # floor: an orthogonal key (score 0) and a tiny score both give sigmoid(±sqrt(1e-6))
    x = torch.tensor([[[1.0, 0.0, 0.0, 0.0]]])
    k = torch.tensor([[[0.0, 1.0, 0.0, 0.0]]])
    floor = 1 / (1 + math.exp(-1e-3))
    assert engram_gate(x, k, w, w, 1e-20).item() == pytest.approx(floor, abs=1e-7)
    tiny = torch.tensor([[[1.0, 1e-9, 0.0, 0.0]]])
    k2 = torch.tensor([[[0.0, 1.0, 0.0, 0.0]]])
    assert engram_gate(tiny, k2, w, w, 1e-20).item() == pytest.approx(floor, abs=1e-7)
    assert engram_gate(tiny, -k2, w, w, 1e-20).item() == pytest.approx(1 - floor, abs=1e-7)
    # only q ⊙ k matters
    assert engram_gate(ones, ones, 2 * w, 0.5 * w, 1e-20).item() == engram_gate(ones, ones, w, w, 1e-20).item()


def test_gate_normalises_each_stream_on_its_own():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, 32, generator=g)
    key = torch.randn(3, 4, 32, generator=g)
    w = torch.randn(4, 32, generator=g)
    base = engram_gate(x, key, w, torch.ones(4, 32), 1e-20)
    scaled = x.clone()
    scaled[:, 1] *= 1000.0  # one stream much louder: a joint RMS would change every stream's gate
    torch.testing.assert_close(engram_gate(scaled, key, w, torch.ones(4, 32), 1e-20), base, rtol=1e-5, atol=1e-6)
    key_scaled = key.clone()
    key_scaled[:, 2] *= 1e-3
    torch.testing.assert_close(engram_gate(x, key_scaled, w, torch.ones(4, 32), 1e-20), base, rtol=1e-5, atol=1e-6)


def test_mix_rejects_a_wrong_kv_width():
    with pytest.raises(ValueError, match="kv"):
        engram_mix(torch.zeros(2, 4, 8), torch.zeros(2, 4 * 8), torch.ones(4, 8), torch.ones(4, 8), 1e-20)


# --- the whole layer on the fixture's weights ----------------------------------------------------------------------


def fixture_wkv(weights, layer, rows=None):
    weight = weights[f"layers.{layer}.engram.wkv.weight"]
    if rows is not None:
        weight = weight[:, rows[0]:rows[1]]
    return lambda x: x @ weight.T


def restated_layer(weights, cfg, layer, streams, row_ids):
    table = weights[f"layers.{layer}.engram.embed.weight"]
    rows = table[row_ids].reshape(row_ids.shape[0], -1)
    kv = rows.double() @ weights[f"layers.{layer}.engram.wkv.weight"].double().T
    return restated_mix(streams, kv, weights[f"layers.{layer}.engram.q_weight"],
                        weights[f"layers.{layer}.engram.k_weight"], cfg.rms_norm_eps)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_layer_on_fixture_weights(cfg, weights, hasher, input_ids, world):
    acts = load_file(ORACLE / "activations_oneshot.safetensors")
    streams = acts["layer_0.streams_out"]  # what enters the Engram in front of layer 1
    li = cfg.engram_layer_ids.index(1)
    row_ids = hasher.hash(input_ids)[:, li]
    expected = restated_layer(weights, cfg, 1, streams, row_ids)

    partials = []
    for rank in range(world):
        table = EngramTable.from_checkpoint(ORACLE, 1, cfg, rank=rank, world=world)
        start, end = engram_wkv_input_range(cfg.engram_head_dim, cfg.engram_cols, rank, world)
        layer = EngramLayer(1, table, fixture_wkv(weights, 1, (start, end)),
                            weights["layers.1.engram.q_weight"], weights["layers.1.engram.k_weight"],
                            cfg.rms_norm_eps, sum_partials=lambda p: partials.append(p) or p)
        assert layer.wkv_input_range == (start, end)
        layer(streams, row_ids)
    total = torch.stack(partials).sum(0)
    # the rank-summed kv through the last rank's gate equals the single-rank result
    full = EngramLayer(1, EngramTable.from_checkpoint(ORACLE, 1, cfg), fixture_wkv(weights, 1),
                       weights["layers.1.engram.q_weight"], weights["layers.1.engram.k_weight"], cfg.rms_norm_eps)
    out = full(streams, row_ids)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    summed = engram_mix(streams, total, weights["layers.1.engram.q_weight"], weights["layers.1.engram.k_weight"],
                        cfg.rms_norm_eps)
    torch.testing.assert_close(summed, out, rtol=1e-5, atol=1e-5)
    assert not torch.equal(out, streams)


# --- tables: checkpoint tensors, FP8, shard files -------------------------------------------------------------------


def fp8_reference_rows(values_u8, scales_u8):
    """e4m3(q) × 2^(e − 127) per 32 values, by hand (byte 0 scale read as 0, like the release's readers)."""
    vals = values_u8.view(torch.float8_e4m3fn).float()
    exp = scales_u8.to(torch.float64)
    scale = torch.where(scales_u8 == 0, torch.zeros_like(exp), torch.pow(2.0, exp - 127)).float()
    return vals * scale.repeat_interleave(32, dim=1)[:, :vals.shape[1]]


@pytest.fixture(scope="module")
def fp8_table(weights):
    """Layer 3's fixture table quantised to the release's FP8 row format (head_dim 16: one scale per row)."""
    values, scales = quantize_rows_fp8(weights["layers.3.engram.embed.weight"] * 3.0)
    return values, scales


def test_quantize_rows_fp8_is_close_and_power_of_two(weights, fp8_table):
    values, scales = fp8_table
    source = weights["layers.3.engram.embed.weight"] * 3.0
    back = fp8_reference_rows(values, scales)
    assert scales.shape == (source.shape[0], 1)
    torch.testing.assert_close(back, source, rtol=0.07, atol=1e-6)  # e4m3 has a 3-bit mantissa
    assert float(back.abs().max(1).values.div(source.abs().max(1).values).min()) > 0.9


def test_fp8_checkpoint_table(tmp_path, cfg, fp8_table, hasher, input_ids):
    values, scales = fp8_table
    save_file({"layers.3.engram.embed.weight": values.view(torch.float8_e4m3fn),
               "layers.3.engram.embed.scale": scales.view(torch.float8_e8m0fnu)},
              tmp_path / "model-00001.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "layers.3.engram.embed.weight": "model-00001.safetensors",
        "layers.3.engram.embed.scale": "model-00001.safetensors"}}))
    table = EngramTable.from_checkpoint(tmp_path, 3, cfg)
    row_ids = hasher.hash(input_ids)[:, cfg.engram_layer_ids.index(3)]
    expected = fp8_reference_rows(values, scales)[row_ids]
    assert torch.equal(table.gather(row_ids), expected)
    in_memory = EngramTable.from_tensors(values.view(torch.float8_e4m3fn), scales, 3, cfg)
    assert torch.equal(in_memory.gather(row_ids), expected)


def test_checkpoint_table_errors(tmp_path, cfg, weights):
    save_file({"other": torch.zeros(1)}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="layers.1.engram.embed.weight.* not found"):
        EngramTable.from_checkpoint(tmp_path, 1, cfg)
    save_file({"layers.1.engram.embed.weight": torch.zeros(461, 16)}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"shape \[461, 16\], expected \[462, 16\]"):
        EngramTable.from_checkpoint(tmp_path, 1, cfg)
    save_file({"layers.1.engram.embed.weight": torch.zeros(462, 16, dtype=torch.float8_e4m3fn)},
              tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="layers.1.engram.embed.scale"):
        EngramTable.from_checkpoint(tmp_path, 1, cfg)
    # a truncated shard
    save_file({"layers.1.engram.embed.weight": weights["layers.1.engram.embed.weight"]}, tmp_path / "model.safetensors")
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        EngramTable.from_checkpoint(tmp_path, 1, cfg)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_files_round_trip(tmp_path, cfg, fp8_table, hasher, input_ids, world):
    values, scales = fp8_table
    paths = write_engram_shards(tmp_path, 3, values, scales, cfg, world)
    assert [p.name for p in paths] == [shard_file_name(3, r, world) for r in range(world)]
    reference = fp8_reference_rows(values, scales)
    row_ids = hasher.hash(input_ids)[:, cfg.engram_layer_ids.index(3)]
    constants = EngramConstants.from_config(cfg)
    pieces = []
    for rank, path in enumerate(paths):
        c0, c1 = head_shard(cfg.engram_cols, rank, world)
        lo, hi = constants.row_range(3, c0, c1)
        header = read_shard_header(path)
        assert header == {"layer": 3, "lo": lo, "hi": hi, "total rows": 630, "row bytes": 17}
        assert path.stat().st_size == 4096 + (hi - lo) * 17
        raw = path.read_bytes()
        # the spec's magic number, as packers write it (its little-endian bytes spell "DSV1EN41", not the
        # "DSV41EN1" the spec's prose says; the number is what existing shard files carry)
        assert struct.unpack("<Q", raw[:8])[0] == 0x31344E4531565344
        assert raw[48:4096] == bytes(4048)
        first = raw[4096:4096 + 17] if hi > lo else b""
        assert first == (bytes(values[lo].tolist()) + bytes(scales[lo].tolist()) if hi > lo else b"")
        table = EngramTable.from_shard_file(path, 3, cfg, rank=rank, world=world)
        assert table.cols == (c0, c1)
        pieces.append(table.gather(row_ids))
    gathered = torch.cat(pieces, dim=1)
    assert torch.equal(gathered, reference[row_ids])


def write_rank0_of_2(tmp_path, cfg, fp8_table):
    values, scales = fp8_table
    return write_engram_shards(tmp_path, 3, values, scales, cfg, 2)[0]


def patch_header(path, field_index, value):
    data = bytearray(path.read_bytes())
    struct.pack_into("<Q", data, 8 * field_index, value)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("field,index,value", [
    ("layer", 1, 1), ("lo", 2, 5), ("hi", 3, 10), ("total rows", 4, 631), ("row bytes", 5, 264)])
def test_shard_header_mismatch_names_the_field(tmp_path, cfg, fp8_table, field, index, value):
    path = write_rank0_of_2(tmp_path, cfg, fp8_table)
    patch_header(path, index, value)
    with pytest.raises(CheckpointError, match=f"header field '{field}' is {value}"):
        EngramTable.from_shard_file(path, 3, cfg, rank=0, world=2)


def test_shard_file_errors(tmp_path, cfg, fp8_table):
    path = write_rank0_of_2(tmp_path, cfg, fp8_table)
    # opened as the wrong rank: its lo/hi do not match
    with pytest.raises(CheckpointError, match="header field 'lo'"):
        EngramTable.from_shard_file(path, 3, cfg, rank=1, world=2)
    # wrong layer asked for
    with pytest.raises(CheckpointError, match="header field 'layer' is 3, expected 1"):
        EngramTable.from_shard_file(path, 1, cfg, rank=0, world=2)
    good = path.read_bytes()
    path.write_bytes(good[:-1])
    with pytest.raises(CheckpointError, match="bytes, expected"):
        EngramTable.from_shard_file(path, 3, cfg, rank=0, world=2)
    path.write_bytes(good + b"\0")
    with pytest.raises(CheckpointError, match="bytes, expected"):
        EngramTable.from_shard_file(path, 3, cfg, rank=0, world=2)
    path.write_bytes(b"NOTMAGIC" + good[8:])
    with pytest.raises(CheckpointError, match="magic"):
        EngramTable.from_shard_file(path, 3, cfg, rank=0, world=2)
    path.write_bytes(good[:20])
    with pytest.raises(CheckpointError, match="truncated"):
        EngramTable.from_shard_file(path, 3, cfg, rank=0, world=2)
    with pytest.raises(CheckpointError, match="cannot open"):
        EngramTable.from_shard_file(tmp_path / "missing.bin", 3, cfg, rank=0, world=2)


def test_gather_refuses_rows_of_another_rank(tmp_path, cfg, fp8_table, hasher, input_ids):
    path = write_rank0_of_2(tmp_path, cfg, fp8_table)
    table = EngramTable.from_shard_file(path, 3, cfg, rank=0, world=2)
    row_ids = hasher.hash(input_ids)[:, cfg.engram_layer_ids.index(3)]
    assert table.cols == (0, 3)
    table.gather(row_ids[:, :3])
    with pytest.raises(ValueError, match="outside this rank"):
        table.gather(row_ids[:, 3:6])  # rank 1's columns


ROW_1234 = [b if b not in (0x7F, 0xFF) else 0 for b in range(256)]  # 0x7F/0xFF are e4m3fn NaN


def test_shard_reader_is_lazy(tmp_path):
    """A ~1.1 GB (sparse) shard file: gathering a few rows must not read the table into memory."""
    config = SimpleNamespace(engram_layer_ids=[1], engram_max_ngram_size=4, engram_vocab_size=180_000,
                             engram_n_heads=8, engram_head_dim=256, engram_compressed_vocab_size=1000,
                             engram_num_embeddings=[0])
    constants = EngramConstants.from_config(SimpleNamespace(**{**vars(config), "engram_num_embeddings":
                                                               [int(_prime_sum(config))]}))
    rows = constants.num_rows[0]
    path = tmp_path / shard_file_name(1, 0, 1)
    tiny_values = torch.zeros(1, 256, dtype=torch.uint8)
    write_engram_shard(path, 1, 0, 0, rows, tiny_values, torch.zeros(1, 8, dtype=torch.uint8))  # header only
    patch_header(path, 3, rows)  # hi
    with open(path, "r+b") as handle:  # sparse: the rows read back as zeros without using disk
        handle.truncate(4096 + rows * 264)
        handle.seek(4096 + 1234 * 264)
        handle.write(bytes(ROW_1234) + bytes([127] * 8))  # row 1234: every non-NaN e4m3 code, scale 1
    assert path.stat().st_size > 1_000_000_000
    process = psutil.Process(os.getpid())
    before = process.memory_info().rss
    table = EngramTable.from_shard_file(path, 1, constants=constants, config=None)
    ids = torch.tensor([[1234] + [0] * 23, [rows - 1] + [5_000_000] * 23])
    ids = torch.minimum(ids, torch.tensor(rows - 1))
    out = table.gather(ids)
    grown = process.memory_info().rss - before
    assert grown < 64 * 2**20, f"gathering 48 rows grew RSS by {grown / 2**20:.0f} MiB"
    expected = torch.tensor(ROW_1234, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    assert torch.equal(out[0, 0], expected)
    assert torch.equal(out[1], torch.zeros(24, 256))


def _prime_sum(config):
    from dsv41.engram.tables import engram_primes

    return engram_primes(config).sum()


def test_bf16_checkpoint_table_equals_fp32(cfg, weights, hasher, input_ids):
    # the fixture's bf16 file holds the same numbers (its README: every value is exact in bf16)
    bf16 = EngramTable.from_checkpoint(ORACLE / "model.bf16.safetensors", 1, cfg)
    row_ids = hasher.hash(input_ids)[:, cfg.engram_layer_ids.index(1)]
    expected = weights["layers.1.engram.embed.weight"][row_ids]
    assert torch.equal(bf16.gather(row_ids), expected)
    in_memory = EngramTable.from_tensors(weights["layers.1.engram.embed.weight"].bfloat16(), None, 1, cfg)
    assert torch.equal(in_memory.gather(row_ids), expected)


def test_ids_beyond_the_tokenizer_hash_like_the_pad(cfg):
    token_map, _ = build_compressed_token_map(Tokenizer.from_dir(ORACLE))
    wider = SimpleNamespace(**{k: getattr(cfg, k) for k in (
        "engram_layer_ids", "engram_max_ngram_size", "engram_vocab_size", "engram_n_heads", "engram_head_dim",
        "engram_compressed_vocab_size", "engram_num_embeddings", "engram_pad_token_id", "image_token_id")},
        vocab_size=330)
    h = EngramHasher(wider, token_map)
    assert torch.equal(h.hash([5, 325, 7]), h.hash([5, cfg.engram_pad_token_id, 7]))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        h.hash([330])


def test_live_mask_shuts_image_positions(hasher, cfg, weights, input_ids):
    ids = list(input_ids[:10])
    ids[4] = cfg.image_token_id
    live = hasher.live(ids)
    assert live.tolist() == [i != 4 for i in range(10)]
    streams = load_file(ORACLE / "activations_oneshot.safetensors")["layer_0.streams_out"][:10]
    layer = EngramLayer(1, EngramTable.from_checkpoint(ORACLE, 1, cfg), fixture_wkv(weights, 1),
                        weights["layers.1.engram.q_weight"], weights["layers.1.engram.k_weight"], cfg.rms_norm_eps)
    out = layer(streams, hasher.hash(ids)[:, cfg.engram_layer_ids.index(1)], live)
    assert torch.equal(out[4], streams[4])
    assert not torch.equal(out[3], streams[3]) and not torch.equal(out[5], streams[5])
