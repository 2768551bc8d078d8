"""bench/step_kernel_sweep.py on its tiny shapes (CPU, Triton's interpreter, in a child process: TRITON_INTERPRET must
be set before Triton decorates the kernels). No timing assertions: the JSON's shape, and every configuration's
outputs equal to the default configuration's within fp32 rounding."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_step_kernel_sweep_tiny(tmp_path):
    out = tmp_path / "sweep.json"
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, str(REPO / "bench" / "step_kernel_sweep.py"), "--tiny", "--device", "cpu",
                    "--out", str(out)], check=True, env=env, cwd=REPO, timeout=300, capture_output=True)
    res = json.loads(out.read_text())
    assert {"commit", "device", "torch", "triton", "timer", "results", "best"} <= set(res)
    assert res["device"] == "cpu" and res["triton_interpret"] == "1"
    seen = {(r["kernel"], r["rows"]) for r in res["results"]}
    assert seen == {(k, rows) for k in ("hc_expand_site", "hc_site", "route_rows") for rows in (1, 4)}
    for r in res["results"]:
        assert len(r["configs"]) >= 3 and sum(c["config"]["default"] for c in r["configs"]) == 1
        for c in r["configs"]:
            assert c["us"] > 0, c
            assert c["check"]["ok"] and c["check"]["row_invariant"], (r["kernel"], r["rows"], c)
            if r["kernel"] == "route_rows":
                assert c["check"]["ids_equal"] and c["check"]["logits_rel"] <= 1e-5
                assert {"block_e", "block_d", "d_splits", "num_warps"} <= set(c["config"])
            else:
                assert c["check"]["x_equal"] and "splits" in c["config"]
    best = {(b["kernel"], b["rows"]) for b in res["best"]}
    assert best == seen | {(k, "all") for k in ("hc_expand_site", "hc_site", "route_rows")}
