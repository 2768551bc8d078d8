"""`dsv41 eval` end to end (issue 36): one subprocess runs every part on the tiny model — the reference written and
checked against the same model, MMLU on a generated file, needles at two lengths, drafting with lookup drafts, and
a tool chain through a `dsv41 serve` it starts itself — and writes the JSON and the table. Refusals are one line
before anything loads."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dsv41.cli import main

from server_harness import server  # noqa: F401  (the session's shared server)

REPO = Path(__file__).resolve().parents[1]


def write_questions(folder: Path) -> Path:
    questions = folder / "facts_test.csv"
    with questions.open("w", newline="") as f:
        csv.writer(f).writerows([["What is 1 + 1?", "1", "2", "3", "4", "B"], ["Sky colour?", "red", "green",
                                                                               "blue", "black", "C"]])
    return questions


def test_every_part_end_to_end(tmp_path):
    questions = write_questions(tmp_path)
    out, ref = tmp_path / "results" / "eval.json", tmp_path / "ref.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src") + os.pathsep
               + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "dsv41.cli", "eval", "all", "--device", "cpu", "--cpu-threads", "1",
           "--out", str(out), "--write-reference", str(ref), "--reference-tokens", "40", "--mmlu", str(questions),
           "--needle-lengths", "96,160", "--needle-depths", "0.5", "--needle-max-tokens", "6",
           "--draft-lookup", "on", "--draft-tokens", "12",
           "--tool-scenarios", "temperature", "--tool-thinking", "off", "--tool-max-tokens", "6"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    parts = results["parts"]
    assert list(parts) == ["tools", "write-reference", "agreement", "mmlu", "needle", "drafting"]
    assert results["backend"] == "engine" and results["model"].endswith(Path(results["model"]).name)
    assert all("error" not in p and p["seconds"] > 0 for p in parts.values())
    assert parts["write-reference"]["prompts"] == 4 and ref.is_file()
    assert parts["agreement"]["top1"] == 1.0 and parts["agreement"]["mean_kl"] == 0.0
    assert parts["mmlu"]["questions"] == 2 and parts["mmlu"]["correct"] in (0, 1, 2)
    assert parts["needle"]["cells"] == 2 and set(parts["needle"]["by_length"]) == {"96", "160"}
    assert set(parts["drafting"]["workloads"]) == {"code", "prose", "structured"}
    assert all(w["tokens_per_round"] >= 1 for w in parts["drafting"]["workloads"].values())
    assert parts["tools"]["thinking"]["off"]["chains"] == 1 and parts["tools"]["scenarios"] == ["temperature"]
    assert parts["tools"]["server"].startswith("http://127.0.0.1:")
    table = proc.stdout
    for part, figure, value in (("agreement", "top-1", "156/156 (100.0%)"), ("mmlu", "accuracy", "/2 ("),
                                ("needle", "found", "/2 ("), ("drafting", "code: tokens/round", ""),
                                ("tools", "thinking off: chains completed", "/1 (")):
        assert re.search(rf"^{part} +{re.escape(figure)} +.*{re.escape(value)}", table, re.M), table


@pytest.mark.parametrize("argv, message", [
    (["eval"], "eval: name at least one part"),
    (["eval", "speed"], "eval: no part 'speed'"),
    (["eval", "agreement"], "eval agreement: needs --reference FILE"),
    (["eval", "mmlu"], "eval mmlu: needs --mmlu"),
    (["eval", "drafting", "--url", "http://127.0.0.1:9"], "eval drafting: reads the batched engine's figures"),
    (["eval", "needle", "--needle-depths", "1.5"], "argument --needle-depths: must be comma-separated fractions"),
    (["eval", "tools", "--tool-scenarios", "chess"], "argument --tool-scenarios: must name chains among"),
    (["eval", "--parallel", "0", "needle"], "argument --parallel: must be an integer >= 1, got 0"),
    (["eval", "needle", "--url", "http://127.0.0.1:9"], "GET http://127.0.0.1:9/v1/models:"),  # nothing listens
])
def test_refusals_are_one_line(capsys, argv, message):
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err and err.count("\n") == 1, err


def test_a_failed_part_is_recorded_and_the_others_run(server, tmp_path, capsys):  # noqa: F811
    key = tmp_path / "key"
    key.write_text(server.api_key + "\n")
    out = tmp_path / "eval.json"
    code = main(["eval", "agreement", "mmlu", "--url", server.url, "--api-key-file", str(key), "--reference",
                 str(tmp_path / "missing.jsonl"), "--mmlu", str(write_questions(tmp_path)), "--out", str(out)])
    assert code == 1
    parts = json.loads(out.read_text())["parts"]
    assert parts["agreement"]["error"].startswith(f"--reference {tmp_path / 'missing.jsonl'}: No such file")
    assert parts["mmlu"]["answered"] == 2 and parts["mmlu"]["errors"] == []  # through the server's completions
    assert re.search(r"^agreement +error +--reference", capsys.readouterr().out, re.M)
