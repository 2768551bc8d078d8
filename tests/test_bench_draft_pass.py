"""bench/draft_pass.py: its arguments, and a smoke run on the CPU (Triton's interpreter, in a child) on the slimmed
tiny config of tests/test_runtime_fast_dspark.py with its drafter. No timing assertions: the JSON's shape, positive
times and the commit it names."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_runtime_fast_dspark import SLIM

REPO = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("draft_pass_bench", REPO / "bench" / "draft_pass.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("bad", [["--depths", "0,6"], ["--seqs", "7"], ["--verify-rows", "7"],
                                 ["--chains", "greedy,beam"], ["--reps", "0"]])
def test_arguments_out_of_range_are_one_line(bad, capsys):
    with pytest.raises(SystemExit) as exc:
        _bench().main(bad)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_smoke_on_the_cpu(tmp_path, tiny_model_dir):
    from dsv41.tiny.model import _engram_rows

    config = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    text = {**config["text_config"], **SLIM}
    text["engram_num_embeddings"] = _engram_rows(text)
    (tmp_path / "config.json").write_text(json.dumps({**config, "text_config": text}))
    out = tmp_path / "draft_pass.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", BENCH_COMMIT="abc1234", PYTHONPATH=str(REPO / "src"))
    subprocess.run([sys.executable, str(REPO / "bench" / "draft_pass.py"), "--config", str(tmp_path), "--device",
                    "cpu", "--seqs", "1", "--depths", "2", "--verify-rows", "3", "--chains", "sampled", "--reps", "1",
                    "--warmup", "0", "--context", "40", "--out", str(out)], check=True, env=env, cwd=REPO, timeout=300)
    res = json.loads(out.read_text())
    assert res["commit"] == "abc1234" and res["gpu"] == "cpu" and res["graphs"] == "off"
    assert res["layers"] == res["layers_real"] == SLIM["num_hidden_layers"]
    (draft,) = res["draft_pass"]
    assert (draft["seqs"], draft["depth"], draft["chain"], draft["graphs"]) == (1, 2, "sampled", "off")
    (verify,) = res["verify"]
    (round_,) = res["rounds"]
    assert verify["rows"] == 3 and round_["verify_rows"] == 3
    assert min(draft["ms"], verify["ms"], round_["round_ms"], round_["verify_ms"]) > 0
    assert res["graph_stats"]["off"]["captures"] == 0
