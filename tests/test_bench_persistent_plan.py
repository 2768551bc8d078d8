"""bench/persistent_plan.py predicts from a stored decode_step result: its layer table builds into a valid plan
(every need an earlier op, the layers chained), and the prediction is consistent: the persistent step is no shorter
than its critical path or the instruction floor's share the table gives it, the calibrated launch chain equals the
measured graph, and a longer flag hop never makes the step faster."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
STEP = ROOT / "bench" / "results" / "decode_step_aligned_b4c0e7f.json"


def test_the_layer_table_chains_the_layers():
    from persistent_plan import layer_ops

    from dsv41.kernels.step.persistent_plan import build

    ops = [op for L in range(3) for op in layer_ops(L, 20_000.0, 20_000.0, 1.0, 132)]
    plan = build(ops)
    first = [op for op in ops if op.name == "L1.attn_site"][0]
    assert [n.op for n in first.needs] == ["L0.down"]
    assert len(plan.items) == sum(op.tiles for op in ops)


def test_the_prediction_is_consistent(tmp_path):
    if not STEP.exists():
        pytest.skip(f"{STEP.name} is not in this checkout")
    from persistent_plan import main

    out = tmp_path / "plan.json"
    assert main(["--step", str(STEP), "--layers", "4", "--flag-us", "0.5,1.5", "--item-us", "1.0", "--out",
                 str(out)]) == 0
    res = json.loads(out.read_text())
    a, b = res["runs"]
    for run in (a, b):
        assert run["persistent_ms"] >= run["critical_path_ms"] - 1e-9
        chain = run["kernel_chain_no_gap_ms"] + run["implied_gap_us"] * run["ops_a_layer"] * 4 / 1e3
        assert chain == pytest.approx(res["graph_ms"])
    assert b["persistent_ms"] > a["persistent_ms"], "a slower flag hop must cost time on a latency-bound chain"
