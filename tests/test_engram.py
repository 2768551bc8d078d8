"""The Engram layer (dsv41.model.engram, MODEL.md §9.4): gate and mix against a restatement, the whole layer on
the oracle fixture's weights at TP 1/2/4, the live mask, and where its tensors live (host tables, compute on the
streams' device).

The table, hashing and token-map pieces have their own files: tests/test_engram_{tables,hashing,token_map}.py.
"""

import math

import pytest
import torch
from safetensors.torch import load_file

from dsv41.engram.shards import write_engram_shards
from dsv41.engram.tables import EngramTable
from dsv41.model.engram import EngramLayer, engram_gate, engram_mix, engram_wkv_input_range
from engram_harness import (  # noqa: F401 (pytest fixtures)
    ORACLE,
    cfg,
    fixture_wkv,
    fp8_table,
    hasher,
    input_ids,
    restated_mix,
    weights,
)

# --- gate and mix ------------------------------------------------------------------------------------------------


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


def test_wkv_input_range_of_the_release_split():
    assert engram_wkv_input_range(256, 24, 0, 2) == (0, 3072)
    assert engram_wkv_input_range(256, 24, 1, 2) == (3072, 6144)


def oracle_streams(n=None):
    """What enters the Engram in front of layer 1 in the oracle's one-shot forward."""
    streams = load_file(ORACLE / "activations_oneshot.safetensors")["layer_0.streams_out"]
    return streams if n is None else streams[:n]


def restated_layer(weights, cfg, layer, streams, row_ids):
    table = weights[f"layers.{layer}.engram.embed.weight"]
    rows = table[row_ids].reshape(row_ids.shape[0], -1)
    kv = rows.double() @ weights[f"layers.{layer}.engram.wkv.weight"].double().T
    return restated_mix(streams, kv, weights[f"layers.{layer}.engram.q_weight"],
                        weights[f"layers.{layer}.engram.k_weight"], cfg.rms_norm_eps)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_layer_on_fixture_weights(cfg, weights, hasher, input_ids, world):
    streams = oracle_streams()
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


def test_live_mask_shuts_image_positions(hasher, cfg, weights, input_ids):
    ids = list(input_ids[:10])
    ids[4] = cfg.image_token_id
    live = hasher.live(ids)
    assert live.tolist() == [i != 4 for i in range(10)]
    streams = oracle_streams(10)
    layer = EngramLayer(1, EngramTable.from_checkpoint(ORACLE, 1, cfg), fixture_wkv(weights, 1),
                        weights["layers.1.engram.q_weight"], weights["layers.1.engram.k_weight"], cfg.rms_norm_eps)
    out = layer(streams, hasher.hash(ids)[:, cfg.engram_layer_ids.index(1)], live)
    assert torch.equal(out[4], streams[4])
    assert not torch.equal(out[3], streams[3]) and not torch.equal(out[5], streams[5])


def test_layer_computes_on_the_streams_device(cfg, weights, hasher, input_ids):
    """The layer asks the table for its rows on the streams' device (not on the CPU, where the table is) and
    everything after the gather stays there; checked here with spies, on CUDA by `test_layer_on_cuda`."""
    table = EngramTable.from_checkpoint(ORACLE, 1, cfg)
    asked, projected = [], []
    gather, wkv = table.gather, fixture_wkv(weights, 1)
    table.gather = lambda ids, device=None: asked.append(device) or gather(ids, device)
    layer = EngramLayer(1, table, lambda x: projected.append(x.device) or wkv(x),
                        weights["layers.1.engram.q_weight"], weights["layers.1.engram.k_weight"], cfg.rms_norm_eps)
    streams = oracle_streams(8)
    out = layer(streams, hasher.hash(input_ids[:8])[:, cfg.engram_layer_ids.index(1)])
    assert asked == [streams.device] and projected == [streams.device] and out.device == streams.device


@pytest.mark.gpu
def test_layer_on_cuda(tmp_path, cfg, weights, hasher, input_ids, fp8_table):
    """The model on the GPU: tables in host memory, row ids / streams / weights on cuda. Rows arrive on cuda
    bit-equal to the CPU's (f32 checkpoint and FP8 shard tables); the layer's output stays on cuda and matches
    the CPU layer within fp32 matmul rounding."""
    cuda = torch.device("cuda")
    row_ids = hasher.hash(input_ids)
    ids1, ids3 = (row_ids[:, cfg.engram_layer_ids.index(L)] for L in (1, 3))
    table = EngramTable.from_checkpoint(ORACLE, 1, cfg)
    rows = table.gather(ids1.to(cuda))
    assert rows.device.type == "cuda" and torch.equal(rows.cpu(), table.gather(ids1))
    values, scales = fp8_table
    fp8 = EngramTable.from_shard_file(write_engram_shards(tmp_path, 3, values, scales, cfg, 1)[0], 3, cfg)
    assert torch.equal(fp8.gather(ids3.to(cuda)).cpu(), fp8.gather(ids3))

    on_gpu = {k: v.to(cuda) for k, v in weights.items() if k.startswith("layers.1.engram.")}
    streams, live = oracle_streams(), hasher.live(input_ids)
    gpu_layer = EngramLayer(1, table, fixture_wkv(on_gpu, 1), on_gpu["layers.1.engram.q_weight"],
                            on_gpu["layers.1.engram.k_weight"], cfg.rms_norm_eps)
    out = gpu_layer(streams.to(cuda), ids1.to(cuda), live.to(cuda))
    assert out.device.type == "cuda" and out.dtype == streams.dtype
    cpu_layer = EngramLayer(1, table, fixture_wkv(weights, 1), weights["layers.1.engram.q_weight"],
                            weights["layers.1.engram.k_weight"], cfg.rms_norm_eps)
    torch.testing.assert_close(out.cpu(), cpu_layer(streams, ids1, live), rtol=1e-4, atol=1e-4)
