"""bench/step_ops.py on a slimmed tiny config (CPU, Triton's interpreter, in a child process) and the GB10
projection's formula on a hand-made step_ops JSON. No timing assertions: only the JSON's shape, positive times and
the byte accounting, which is exact here: at an odd context every ratio-2 layer closes a group in the step, so
every index-key projection runs and the classes' EXL3 / dense bytes equal decode_step.step_reads of the same step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

# the tiny model slimmed (tests/test_runtime_fast.py's LITE, the tiny's Engram kept): 4 layers with every
# attention role (SWA; ratio-2 source + indexer + Engram; ratio-2 reuse; ratio-1 candidate source)
LITE = {"hidden_size": 128, "num_attention_heads": 2, "o_groups": 2, "q_lora_rank": 128, "o_lora_rank": 128,
        "moe_intermediate_size": 256, "n_routed_experts": 3, "num_experts_per_tok": 2, "num_hidden_layers": 6,
        "compress_ratios": [0, 2, 2, 1, 1, 1, 0, 0, 0], "kv_source_layer_ids": [1, 3],
        "index_source_layer_ids": [1, 3, 4], "candidate_source_layer_id": 3, "index_n_heads": 2,
        "dspark_target_layer_ids": [3, 4, 5], "dspark_n_routed_experts": 3}


@pytest.fixture(scope="module")
def step_ops_json(tmp_path_factory, tiny_model_dir) -> dict:
    out = tmp_path_factory.mktemp("step_ops") / "step_ops.json"
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, str(REPO / "bench" / "step_ops.py"), "--tiny", "--overrides", json.dumps(LITE),
                    "--layers", "4", "--context", "41", "--iters", "1", "--warmup", "0", "--out", str(out)],
                   check=True, env=env, cwd=REPO, timeout=300)
    return json.loads(out.read_text())


def test_step_ops_tiny(step_ops_json):
    so = step_ops_json
    assert {"commit", "device", "torch", "triton", "args", "ceiling_gbps"} <= set(so)
    row = so["steps"][0]
    groups = {c["group"] for c in row["classes"]}
    assert {"exl3", "head", "moe", "router", "mhc", "rowops", "attention", "indexer", "engram", "embed", "comm",
            "sampling"} <= groups
    for c in row["classes"]:
        assert c["calls"] > 0 and c["bytes"] >= 0
        # a container's own time is a difference of two timed passes (may be near zero or below on a busy
        # host); its time with its leaves is measured directly
        assert (c["ms_with_leaves"] if c["container"] else c["ms"]) > 0, c
    kinds = {c["class"].split()[1] for c in row["classes"] if c["group"] == "exl3"}
    assert {"attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b", "attn.compressor.wkv",
            "attn.indexer.wq_b", "attn.indexer.wk", "ffn.shared_experts.w1", "engram.wkv"} <= kinds
    moe = next(c for c in row["classes"] if c["group"] == "moe" and c["exl3_bytes"])
    assert moe["distinct_experts"] > 0
    chk = row["bytes_check"]
    assert chk["index_wk_uncalled_bytes"] == 0  # odd context: every group closes
    assert chk["classes_exl3_bytes"] == chk["step_reads_exl3_bytes"] and chk["exl3_equal"]
    assert chk["classes_dense_bytes"] == chk["step_reads_dense_bytes"] and chk["dense_equal"]
    assert sum(c["exl3_bytes"] + c["dense_bytes"] for c in row["classes"]) == (
        row["step_reads"]["exl3_bytes"] + row["step_reads"]["dense_bytes"])


def test_gb10_projection_formula(tmp_path):
    import gb10_projection as g

    # H200 ceiling 4000 GB/s, GB10 200 GB/s
    ops = [  # bytes-bound: 40e6 B / 4000 GB/s = 0.01 ms floor, measured 0.02 ms: 50% of the ceiling
        {"class": "a", "group": "exl3", "calls": 1, "ms": 0.02, "bytes": 40e6},
        # instruction-bound: 4 MB in 1 ms (0.1%), 100 us a call
        {"class": "b", "group": "exl3", "calls": 10, "ms": 1.0, "bytes": 4e6},
        # latency-bound: 100 calls of 5 us
        {"class": "c", "group": "rowops", "calls": 100, "ms": 0.5, "bytes": 0},
        {"class": "d", "group": "comm", "calls": 3, "ms": 9.0, "bytes": 0},  # replaced by comm_ms
    ]
    so = {"commit": "x", "device": "test", "ceiling_gbps": 4000.0, "steps": [{"rows": 1, "classes": ops}]}
    ds = {"steps": [{"mode": "decode", "rows": 1, "step_ms": 10.0, "device_ms": 6.0},
                    {"mode": "verify", "rows": 6, "step_ms": 12.0}], "ceilings": {"read_gbps": 4000.0}}
    (tmp_path / "so.json").write_text(json.dumps(so))
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    out = tmp_path / "g.json"
    g.main(["--step-ops", str(tmp_path / "so.json"), "--decode-step", str(tmp_path / "ds.json"), "--out", str(out),
            "--gb10-gbps", "200", "--compute-ratio", "0.5", "--launch-us", "8", "--latency-us", "20",
            "--bytes-frac", "0.4", "--comm-ms", "1", "--draft-ms", "2", "--tokens-per-round", "code=4,prose=2"])
    res = json.loads(out.read_text())
    by = {r["class"]: r for r in res["ops"]}
    assert set(by) == {"a", "b", "c"}
    # a: bytes-bound, 0.02 ms * 4000/200 = 0.4 ms (its GB10 floor 40e6/200e9 = 0.2 ms)
    assert by["a"]["bound"] == "bytes" and by["a"]["gb10_ms"] == pytest.approx(0.4)
    assert by["a"]["achieved_h200"] == pytest.approx(0.5)
    # b: instruction-bound, 1 ms / 0.5 = 2 ms (floor 0.02 ms)
    assert by["b"]["bound"] == "instruction" and by["b"]["gb10_ms"] == pytest.approx(2.0)
    # c: latency-bound, 100 calls * max(8, 5) us = 0.8 ms
    assert by["c"]["bound"] == "latency" and by["c"]["gb10_ms"] == pytest.approx(0.8)
    # step = 0.4 + 2 + 0.8 + comm 1 + host (10 - 6) = 8.2 ms; round = 8.2 * (12 / 10) + 2 = 11.84 ms
    assert res["step_ms"] == pytest.approx(8.2)
    assert res["round_ms"] == pytest.approx(11.84)
    assert res["tokens_per_s"]["code"] == pytest.approx(4 / 11.84e-3)
    assert res["tokens_per_s"]["prose"] == pytest.approx(2 / 11.84e-3)
    assert res["bandwidth_floor_ms"] == pytest.approx(0.2 + 0.02)
    assert "| a | 1 |" in g.markdown(res)
